"""inferd's Prometheus metrics: requests, tokens, TTFT/TPOT, forward passes, preemptions, the batch,
and the same under vLLM's names (`inferd.vllm_metrics`).

Requests are counted as their events are read (`inferd.completions`): the
first token, each token after it, each completion's end. The batch's state
lives on inferd's event loop, so a scrape reads it there, as memd's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from inferd.vllm_metrics import VllmMetrics
from shared.full_collections import metric_families
from shared.metrics_http import serve_metrics

if TYPE_CHECKING:
    from inferd.engine import WorkerEngine
    from inferd.requests import Event, Request

SCRAPE_TIMEOUT_S = 5.0
PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class InferdMetrics(Collector):
    def __init__(self, engine: WorkerEngine, loop: asyncio.AbstractEventLoop, model_name: str) -> None:
        self.engine, self.loop = engine, loop
        self.registry = CollectorRegistry()
        self.vllm = VllmMetrics(self.registry, model_name)
        self.requests = Counter("kvpool_inferd_requests", "completions finished, by how they ended",
                                ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("kvpool_inferd_prompt_tokens", "prompt tokens of finished completions",
                                     registry=self.registry)
        self.cached_tokens = Counter("kvpool_inferd_cached_prompt_tokens",
                                     "prompt tokens reused from memd instead of computed", registry=self.registry)
        self.generated_tokens = Counter("kvpool_inferd_generated_tokens", "tokens generated",
                                        registry=self.registry)
        self.ttft = Histogram("kvpool_inferd_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kvpool_inferd_time_per_output_token_seconds", "mean time per token after the first",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
                              registry=self.registry)
        # Observed on the forward thread (prometheus-client's metrics take a lock of their own): a mixed pass
        # is a prompt chunk joining decode rows, and its time is how long those streams waited for a token.
        passes = Histogram("kvpool_inferd_forward_pass_seconds",
                           "forward passes and their sampling: decode steps, prompts, or prompts joining decode",
                           ["kind"], buckets=PASS_BUCKETS, registry=self.registry)
        self.passes = {kind: passes.labels(kind) for kind in ("decode", "prefill", "mixed")}
        engine.on_pass = self.forward_pass
        self.registry.register(self)

    def forward_pass(self, kind: str, seconds: float) -> None:
        self.passes[kind].observe(seconds)

    def serve(self, port: int, host: str) -> None:
        serve_metrics(self.registry, host, port)

    def first_token(self, request: Request, now: float) -> None:
        """A request's first token (of its first completion)."""
        placed = request.seq.placed_at or now
        self.vllm.first_token(request.num_prompt, request.num_cached, now - request.arrived,
                              max(0.0, placed - request.arrived))

    def token_gap(self, seconds: float) -> None:
        """The time between two tokens of one completion."""
        self.vllm.itl.observe(seconds)

    def finished(self, event: Event, request: Request, now: float) -> None:
        """One completion ended (its final event)."""
        reason = "error" if event.error is not None else (event.finish_reason or "unknown")
        self.requests.labels(reason).inc()
        usage = event.usage or {}
        self.vllm.finished(reason, int(usage.get("completion_tokens", 0)), now - request.arrived,
                           usage.get("tpot_ms", 0.0) / 1000)
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.cached_tokens.inc(usage.get("cached_tokens", 0))
        self.generated_tokens.inc(usage.get("completion_tokens", 0))
        if usage.get("ttft_ms"):
            self.ttft.observe(usage["ttft_ms"] / 1000)
        if usage.get("tpot_ms"):
            self.tpot.observe(usage["tpot_ms"] / 1000)

    async def reading(self) -> dict[str, Any]:
        scheduler = self.engine.scheduler
        check = scheduler.reuse_check if scheduler else None
        client = scheduler.client if scheduler else None
        total = client.geometry.num_blocks if client else 0
        return {
            "attached": self.engine.attached.is_set(),
            "pool_blocks": total,
            "block_size": self.engine.block_size,
            "pool_usage": (total - client.free_blocks) / total if client and total else 0.0,
            "share": sum(len(r.seq.table) for r in scheduler.running) / total if scheduler and total else 0.0,
            "running": len(scheduler.running) if scheduler else 0,
            "waiting": len(scheduler.waiting) if scheduler else 0,
            "preemptions": self.engine.preemptions + (scheduler.preemptions if scheduler else 0),
            "reuse_checks": self.engine.reuse_checks + (check.checks if check else 0),
            "reuse_mismatches": self.engine.reuse_mismatches + (check.mismatches if check else 0),
            "ahead_taken": self.engine.ahead_taken + (scheduler.forward_thread.ahead_taken if scheduler else 0),
            "ahead_dropped": self.engine.ahead_dropped + (scheduler.forward_thread.ahead_dropped if scheduler else 0),
        }

    def collect(self) -> Iterator[Any]:
        if not self.loop.is_running():
            return
        r = asyncio.run_coroutine_threadsafe(self.reading(), self.loop).result(SCRAPE_TIMEOUT_S)
        yield GaugeMetricFamily("kvpool_inferd_attached", "1 while attached to memd", value=int(r["attached"]))
        yield GaugeMetricFamily("kvpool_inferd_running_requests", "sequences in the batch", value=r["running"])
        yield GaugeMetricFamily("kvpool_inferd_waiting_requests", "requests waiting for pages or a seat",
                                value=r["waiting"])
        yield CounterMetricFamily("kvpool_inferd_preemptions", "running sequences given up for memory",
                                  value=r["preemptions"])
        yield GaugeMetricFamily("kvpool_inferd_kv_cache_share",
                                "pages this worker's running sequences hold, over the pool's (memd's, shared)",
                                value=r["share"])
        yield from self.vllm.families(r["running"], r["waiting"], r["pool_usage"], r["preemptions"],
                                      r["block_size"], r["pool_blocks"])
        ahead = CounterMetricFamily("kvpool_inferd_passes_run_ahead",
                                    "decode passes the forward thread ran ahead: taken, or dropped (the batch changed)",
                                    labels=["outcome"])
        ahead.add_metric(["taken"], r["ahead_taken"])
        ahead.add_metric(["dropped"], r["ahead_dropped"])
        yield ahead
        yield CounterMetricFamily("kvpool_inferd_reuse_checks", "prefix hits recomputed and compared (--verify-reuse)",
                                  value=r["reuse_checks"])
        yield CounterMetricFamily("kvpool_inferd_reuse_mismatches",
                                  "prefix hits whose K/V differed from the recompute (--verify-reuse)",
                                  value=r["reuse_mismatches"])
        yield from metric_families("kvpool_inferd", "inferd")
