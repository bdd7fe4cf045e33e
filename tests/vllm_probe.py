"""Run by the vLLM venv's interpreter (bench/peer_engines.py makes it), never by kvpool's: vLLM's own code
reads what kvpool says in vLLM's formats, so the tests check kvpool against the other side, not against a copy.

    python tests/vllm_probe.py metrics                  the vllm:* families vLLM's server registers, as JSON
    python tests/vllm_probe.py events PUB REPLAY        KV events from a publisher, decoded by vLLM's classes
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


def events(pub: str, replay: str) -> None:
    """Subscribe as a router would: SUB first, then what was sent before from the replay socket (from sequence
    number 0), then live batches, each decoded by vLLM's own KVEventBatch and printed as one JSON line
    ({"seq", "topic", "events"}). {"replayed": N} says the replay is done. Runs until killed."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    last = -1

    def show(topic: bytes, seq: int, payload: bytes) -> None:
        batch = decode(payload)
        out = []
        for event in batch.events:
            fields = msgspec.to_builtins(event)
            fields["type"] = type(event).__name__
            out.append(fields)
        print(json.dumps({"seq": seq, "topic": topic.decode(), "ts": batch.ts, "events": out}), flush=True)

    while True:
        _, topic, seq_bytes, payload = dealer.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq < 0:
            break
        show(topic, seq, payload)
        last = seq
    print(json.dumps({"replayed": last + 1}), flush=True)
    while True:
        topic, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq > last:                          # a batch the replay already gave is not shown twice
            show(topic, seq, payload)
            last = seq


if __name__ == "__main__":
    if sys.argv[1:] == ["metrics"]:
        import vllm

        print(json.dumps({"version": vllm.__version__, "families": metric_families()}))
    elif len(sys.argv) == 4 and sys.argv[1] == "events":
        events(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: {sys.argv[0]} metrics | events PUB REPLAY")
