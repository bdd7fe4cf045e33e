"""kvroute's Prometheus metrics (`GET /metrics`): where requests went and why, and each worker's state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.directory import SessionDirectory
from kvroute.kv_index import EventSource
from kvroute.workers import Workers

REASONS = ("affinity", "kv", "prefix", "load", "failover")


class RouteMetrics(Collector):
    def __init__(self, workers: Workers, directory: SessionDirectory, sources: list[EventSource] | None = None) -> None:
        self.workers, self.directory, self.sources = workers, directory, sources or []
        self.registry = CollectorRegistry()
        self.requests = Counter("kvpool_route_requests", "requests sent to a worker, by why it was chosen: "
                                "affinity (it holds the session), kv (its pool holds most of the prompt's leading "
                                "blocks, by its memd's KV events), prefix (the prompt's leading text hashes to it), "
                                "load (the least loaded), failover (another worker failed or left)",
                                ["worker", "reason"], registry=self.registry)
        self.upstream_errors = Counter("kvpool_route_upstream_errors", "requests a worker could not take "
                                       "(connection failed, or it answered 503)", ["worker"], registry=self.registry)
        self.unplaced = Counter("kvpool_route_unplaced", "requests answered 503: no worker could take them",
                                registry=self.registry)
        for worker in workers.all:
            for reason in REASONS:
                self.requests.labels(worker.url, reason)
            self.upstream_errors.labels(worker.url)
        self.registry.register(self)

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("kvpool_route_worker_up", "1 while the worker's /health answers 200",
                               labels=["worker"])
        load = GaugeMetricFamily("kvpool_route_worker_load", "running and waiting requests, as placement sees them",
                                 labels=["worker"])
        for worker in self.workers.all:
            up.add_metric([worker.url], int(worker.up))
            load.add_metric([worker.url], worker.load)
        yield up
        yield load
        yield CounterMetricFamily("kvpool_route_directory_errors", "session directory reads and writes the "
                                  "cluster store did not answer", value=self.directory.errors)
        if self.sources:
            blocks = GaugeMetricFamily("kvpool_route_kv_blocks", "blocks in a pool's prefix cache, by its memd's KV "
                                       "events", labels=["events"])
            batches = CounterMetricFamily("kvpool_route_kv_batches", "KV-event batches read from a memd",
                                          labels=["events"])
            gaps = CounterMetricFamily("kvpool_route_kv_gaps", "times a memd's KV events were caught up from its "
                                       "replay socket (batches missed, or a new memd)", labels=["events"])
            for source in self.sources:
                blocks.add_metric([source.endpoint], sum(len(index.key_of) for index in source.indexes.values()))
                batches.add_metric([source.endpoint], source.batches)
                gaps.add_metric([source.endpoint], source.gaps)
            yield blocks
            yield batches
            yield gaps
