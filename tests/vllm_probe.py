"""Run by the vLLM venv's interpreter (bench/peer_engines.py makes it), never by kvpool's: vLLM's own code
reads what kvpool says in vLLM's formats, so the tests check kvpool against the other side, not against a copy.

    python tests/vllm_probe.py metrics        the vllm:* families vLLM's server registers, as JSON
"""

from __future__ import annotations

import json
import sys
import types


def metric_families() -> dict[str, dict]:
    """Each vllm:* family's type, label names and histogram buckets, from vLLM's PrometheusStatLogger as its
    server builds it (one engine, no LoRA, no speculative decoding), without starting an engine."""
    from prometheus_client import REGISTRY
    from vllm.config import CacheConfig, ObservabilityConfig
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    ns = types.SimpleNamespace
    config = ns(observability_config=ObservabilityConfig(),
                model_config=ns(served_model_name="probe", max_model_len=4096, is_diffusion=False),
                speculative_config=None, kv_transfer_config=None, ec_transfer_config=None, watermark_config=None,
                lora_config=None, cache_config=CacheConfig())
    PrometheusStatLogger(config, engine_indexes=[0]).log_engine_initialized()
    families = {}
    for family in REGISTRY.collect():
        if not family.name.startswith("vllm:"):
            continue
        buckets = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
        families[family.name] = {"type": family.type, "buckets": [b for b in buckets if b != float("inf")],
                                 "labels": sorted({k for s in family.samples for k in s.labels if k != "le"})}
    return families


if __name__ == "__main__":
    if sys.argv[1:] == ["metrics"]:
        import vllm

        print(json.dumps({"version": vllm.__version__, "families": metric_families()}))
    else:
        sys.exit(f"usage: {sys.argv[0]} metrics")
