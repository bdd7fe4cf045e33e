"""vLLM's metric names, beside kvpool's own: the series the fleet's tools already read.

Gateways (the Gateway API Inference Extension, llm-d's scheduler) score a
pod by `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` and `vllm:cache_config_info`; autoscalers and load
tools query the prefix-cache counters, the latency histograms and
`vllm:request_success_total`. A worker exports them with vLLM's names, types,
labels (`model_name`, `engine`) and histogram buckets, counted at the moments
vLLM counts them: a request's prompt and prefix-cache figures, and its time to
first token, when that token comes; the rest as each token or completion ends.

Where kvpool differs, the series says kvpool's meaning:
- `vllm:kv_cache_usage_perc` is the usage of the pool this worker draws its
  pages from: memd's, shared by every worker of the host, 0 to 1, as of memd's
  latest answer. It is what decides whether this worker can admit a request.
  This worker's own share (pages its running sequences hold) is
  `kvpool_inferd_kv_cache_share`.
- `vllm:cache_config_info` carries the labels a gateway reads that kvpool has
  (`block_size`; `num_gpu_blocks`: the pool's pages, on a GPU or not;
  `cache_dtype`: "auto", the model's dtype), each a string as vLLM writes them.
- A completion cancelled by its client or by a session reset finished as
  `abort`, as vLLM's do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from collections.abc import Iterator

    from prometheus_client.metrics_core import Metric

ENGINE = "0"                    # vLLM's label for its one engine (data-parallel rank 0)
LABELS = ("model_name", "engine")
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
# Why kvpool's completions end, as vLLM's finished_reason says it.
REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "reset": "abort", "error": "error"}
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class VllmMetrics:
    """The series vLLM's server exports under its names, fed by inferd's events (`inferd.completions`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.labels = (model_name, ENGINE)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(*self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*self.labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that produced a first "
                                     "token, cached ones included.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(memd's, and a session's own K/V).")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens whose K/V memd already held.")
        success = Counter("vllm:request_success", "Completions finished, by finish reason.",
                          [*LABELS, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*self.labels, reason) for reason in FINISHED_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token, in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between a completion's tokens, in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "A completion's mean time per token after its first, in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to a completion's end, in seconds.",
                             REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to memd's first placing of the request's "
                               "sequence, in seconds.", REQUEST_BUCKETS)

    def first_token(self, prompt_tokens: int, cached_tokens: int, ttft_s: float, queue_s: float) -> None:
        """A request's first token: its prompt, what memd had of it, and how long it took."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)
        self.ttft.observe(ttft_s)
        self.queue.observe(queue_s)

    def finished(self, reason: str, generated: int, e2e_s: float, tpot_s: float) -> None:
        """One completion ended (a request of n > 1 ends n times, as vLLM's does)."""
        self.success[REASONS.get(reason, "abort")].inc()
        self.generation_tokens.inc(generated)
        self.e2e.observe(e2e_s)
        if tpot_s:
            self.tpot.observe(tpot_s)

    def families(self, running: int, waiting: int, pool_usage: float, preemptions: int, block_size: int,
                 num_blocks: int) -> Iterator[Metric]:
        """The gauges read at a scrape, and the preemptions counted by the scheduler."""
        for name, doc, value in (("vllm:num_requests_running", "Requests in the batch.", running),
                                 ("vllm:num_requests_waiting", "Requests waiting for pages or a seat.", waiting),
                                 ("vllm:kv_cache_usage_perc", "Usage of the KV pool this worker draws from "
                                  "(memd's, shared by the host's workers); 1 means 100 percent.", pool_usage)):
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(self.labels, value)
            yield gauge
        counted = CounterMetricFamily("vllm:num_preemptions", "Running sequences given up for memory.",
                                      labels=LABELS)
        counted.add_metric(self.labels, preemptions)
        yield counted
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache this worker uses: memd's pool.",
                                 labels=["block_size", "num_gpu_blocks", "cache_dtype", "engine"])
        info.add_metric([str(block_size), str(num_blocks), "auto", ENGINE], 1)
        yield info
