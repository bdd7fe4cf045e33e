"""memd's Prometheus metrics: pool, swap, sequences, evictions, Step latency.

Served by prometheus-client's HTTP server on its own thread. The pool's state
lives on memd's event loop and changes under it, so a scrape does not read it
from the HTTP thread: it asks the loop for one consistent reading
(`run_coroutine_threadsafe`) and renders that. Only the histograms (Step
latency, operator calls' holds on the loop) are updated as things happen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from memd.integrity import Where
from memd.loop_lag import LoopLag
from memd.quotas import Holding
from memd.sequences import EvictionReason
from shared.full_collections import metric_families
from shared.metrics_http import serve_metrics

if TYPE_CHECKING:
    from memd.service import MemdService

SCRAPE_TIMEOUT_S = 5.0
# (metric suffix, manager counter, help): every counter a dashboard needs, with Prometheus names.
COUNTERS = (
    ("steps", "steps", "Steps applied"),
    ("steps_refused", "steps_refused", "Steps refused (every op rolled back)"),
    ("steps_waited_for_room", "steps_waited_for_room", "Steps that waited for evictions before applying"),
    ("ops", "ops", "operations in applied Steps"),
    ("blocks_allocated", "blocks_allocated", "blocks handed out"),
    ("prefix_query_tokens", "prefix_query_tokens", "tokens looked up in the prefix cache"),
    ("prefix_hit_tokens", "prefix_hit_tokens", "tokens served from the prefix cache"),
    ("session_hit_tokens", "session_hit_tokens",
     "tokens a resumed session found computed: its own K/V, parked or swapped"),
    ("swap_outs", "swap_outs", "sequences swapped out"),
    ("swap_ins", "swap_ins", "sequences swapped back in"),
    ("swap_out_blocks", "swap_out_blocks", "blocks copied to the swap tier"),
    ("swap_in_blocks", "swap_in_blocks", "blocks copied back from the swap tier"),
    ("drops", "drops", "sequences whose pages were dropped (token ids kept)"),
    ("preemptions", "preemptions", "running sequences workers preempted for memory"),
    ("resumes", "resumes", "parked, swapped or dropped sequences resumed"),
    ("forks", "forks", "sequences forked"),
    ("blocks_copied_on_write", "blocks_copied_on_write",
     "full blocks a resent conversation diverged inside, copied to keep the K/V before the divergence"),
    ("reclaims", "reclaims", "workers whose lease ended and whose sequences memd took back"),
    ("pages_verified", "pages_verified", "pages checked against their checksum where K/V crossed a boundary"),
    ("cluster_puts", "cluster_puts", "blocks published to the cluster store"),
    ("cluster_hits", "cluster_hits", "blocks fetched intact from the cluster store"),
    ("cluster_misses", "cluster_misses", "blocks a fetch did not get intact (gone from the store, or corrupt)"),
    ("cluster_errors", "cluster_errors", "cluster store calls that failed (the session stayed local)"),
    ("cluster_sessions_fetched", "cluster_sessions_fetched", "sessions another host published, taken over"),
    ("cluster_bytes_out", "cluster_bytes_out", "bytes published to the cluster store"),
    ("cluster_bytes_in", "cluster_bytes_in", "bytes fetched from the cluster store"),
)


class MemdMetrics(Collector):
    def __init__(self, service: MemdService, loop: asyncio.AbstractEventLoop) -> None:
        self.service, self.loop = service, loop
        self.registry = CollectorRegistry()
        self.step_seconds = Histogram(
            "kvpool_memd_step_duration_seconds", "Step RPC latency in memd, page effects included",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry)
        # Snapshots and checks run between Steps a slice at a time (memd.state_copy.Pacer): each slice is how
        # long a Step could have waited for one. A Step's own latency also counts the host's other processes.
        self.operator_holds = Histogram(
            "kvpool_memd_operator_hold_seconds",
            "how long an operator call (snapshot, check) held memd's event loop at a time, between Steps",
            buckets=(0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1), registry=self.registry)
        # How late memd's loop woke (memd.loop_lag): whatever held it, every Step queued behind it waited as long.
        self.loop_lag_seconds = Histogram(
            "kvpool_memd_loop_lag_seconds", "how late memd's event loop woke for a 20 ms timer: how long it was held",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=self.registry)
        self.loop_lag: LoopLag | None = None
        self.registry.register(self)

    def serve(self, port: int, host: str) -> None:
        serve_metrics(self.registry, host, port)

    async def reading(self) -> dict[str, Any]:
        """One consistent reading of the pool, taken on the event loop."""
        m = self.service.manager
        swap = m.swap
        return {
            "total": m.geometry.num_blocks, "free": m.pool.num_free, "cached": m.pool.num_cached,
            "swap_total": swap.num_slots if swap else 0, "swap_free": swap.num_free if swap else 0,
            "swapped": m.swapped_blocks(),
            "sequences": m.state_counts(), "workers": len(m.workers), "counters": dict(m.counters),
            "rpcs": dict(self.service.rpcs),
            "holdings": m.holdings(),
        }

    def collect(self) -> Iterator[Any]:
        if not self.loop.is_running():
            return
        r = asyncio.run_coroutine_threadsafe(self.reading(), self.loop).result(SCRAPE_TIMEOUT_S)
        blocks = GaugeMetricFamily("kvpool_memd_blocks", "pool blocks by state", labels=["state"])
        blocks.add_metric(["free"], r["free"])
        blocks.add_metric(["used"], r["total"] - r["free"])
        blocks.add_metric(["cached"], r["cached"])
        yield blocks
        yield GaugeMetricFamily("kvpool_memd_pool_blocks", "blocks in the pool", value=r["total"])
        yield GaugeMetricFamily("kvpool_memd_pool_usage_ratio", "used blocks over all blocks",
                                value=(r["total"] - r["free"]) / r["total"] if r["total"] else 0.0)
        swap = GaugeMetricFamily("kvpool_memd_swap_blocks", "swap tier slots by state", labels=["state"])
        swap.add_metric(["free"], r["swap_free"])
        swap.add_metric(["used"], r["swap_total"] - r["swap_free"])
        swap.add_metric(["swapped"], r["swapped"])
        yield swap
        seqs = GaugeMetricFamily("kvpool_memd_sequences", "sequences by state", labels=["state"])
        for state, count in r["sequences"].items():
            seqs.add_metric([state], count)
        yield seqs
        yield GaugeMetricFamily("kvpool_memd_workers", "workers holding a lease", value=r["workers"])
        if self.loop_lag is not None:
            yield GaugeMetricFamily("kvpool_memd_loop_lag_max_seconds", "the longest memd's event loop was held "
                                    "since start", value=self.loop_lag.max_s)
        counters = r["counters"]
        for suffix, key, text in COUNTERS:
            yield CounterMetricFamily(f"kvpool_memd_{suffix}", text, value=counters.get(key, 0))
        evictions = CounterMetricFamily("kvpool_memd_evictions", "sequences evicted, by reason", labels=["reason"])
        for reason in EvictionReason:
            evictions.add_metric([reason.value], counters.get(reason.counter, 0))
        yield evictions
        failures = CounterMetricFamily("kvpool_memd_integrity_failures",
                                       "pages whose bytes were not what was written, by where they were checked",
                                       labels=["where"])
        for where in Where:
            failures.add_metric([where.value], counters.get(where.counter, 0))
        yield failures
        yield from holder_families(r["holdings"])
        rpcs = CounterMetricFamily("kvpool_memd_rpcs", "gRPC calls received, by method", labels=["method"])
        for method, count in sorted(r["rpcs"].items()):
            rpcs.add_metric([method], count)
        yield rpcs
        yield from metric_families("kvpool_memd", "memd")


def holder_families(holdings: list[Holding]) -> Iterator[Any]:
    """Per tenant and model (memd.quotas): pages held, quota, evictions, refusals at its max."""
    labels = ["kind", "name"]
    pages = GaugeMetricFamily("kvpool_memd_holder_pages", "pool pages a tenant's or model's sequences hold "
                              "(a page two tenants share counts for each)", labels=labels)
    guaranteed = GaugeMetricFamily("kvpool_memd_holder_guaranteed_pages",
                                   "pages others' pressure never evicts a tenant or model below", labels=labels)
    limit = GaugeMetricFamily("kvpool_memd_holder_max_pages", "pages a tenant or model may hold (0: no max)",
                              labels=labels)
    evictions = CounterMetricFamily("kvpool_memd_holder_evictions", "a tenant's or model's sequences evicted",
                                    labels=labels)
    retained = GaugeMetricFamily("kvpool_memd_holder_retained_pages", "pages of a tenant's or model's sessions "
                                 "under a retention promise", labels=labels)
    refusals = CounterMetricFamily("kvpool_memd_holder_quota_refusals", "Steps refused at a tenant's or model's "
                                   "max pages", labels=labels)
    for h in holdings:
        key = list(h.key)
        pages.add_metric(key, h.pages)
        guaranteed.add_metric(key, h.quota.guaranteed)
        limit.add_metric(key, h.quota.max)
        evictions.add_metric(key, h.evictions)
        refusals.add_metric(key, h.refusals)
        retained.add_metric(key, h.retained_pages)
    yield from (pages, guaranteed, limit, evictions, refusals, retained)
