"""The K/V namespace of a vLLM engine in memd: everything that makes its blocks' bytes mean something.

memd shares a block only between workers attached under one model
namespace. vLLM's CPU attention packs K and V by instruction set (AMX, AVX-512,
NEON: `_get_attn_isa`), so two engines of the same model on different CPUs
write different bytes for the same tokens; the namespace covers the model
(path or name, revision, config, weights where they are files here), the
dtypes, the block size, the heads, the attention ISA and the KV layout, and the
parallel shape. Both vLLM processes compute it from the same config, so the
scheduler (which asks memd) and the worker (which maps the pool) agree.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from shared.weight_digests import weight_digests

VERSION = 1


def attention_isa(dtype: Any, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    """The CPU attention's block packing vLLM picks for these shapes on this CPU ("amx", "vec", "neon", ...);
    "gpu" where vLLM runs on a GPU, "unknown" where this vLLM does not say."""
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            return "gpu"
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        return str(_get_attn_isa(dtype, block_size, head_size, kv_cache_dtype))
    except (ImportError, AttributeError, NotImplementedError):
        return "unknown"


def namespace(vllm_config: Any, kv_cache_config: Any) -> tuple[str, int]:
    """(`vllm:{model}-{12 hex}`, bytes per token of every layer) for this engine."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    layers = len(group.layer_names)
    isa = attention_isa(spec.dtype, spec.block_size, spec.head_size, str(cache.cache_dtype))
    parts = [f"kvpool-vllm-namespace-{VERSION}", str(model.model), str(model.revision or ""),
             str(model.tokenizer), str(model.dtype), str(cache.cache_dtype), str(spec.dtype),
             f"bs{spec.block_size}", f"heads{spec.num_kv_heads}", f"hd{spec.head_size}", f"layers{layers}",
             f"page{spec.page_size_bytes}", f"isa:{isa}", f"layout:{kv_cache_config.kv_cache_layout}",
             f"tp{parallel.tensor_parallel_size}", f"pp{parallel.pipeline_parallel_size}"]
    h = hashlib.blake2b("\0".join(parts).encode(), digest_size=16)
    where = Path(str(model.model))
    if (where / "config.json").is_file():
        h.update((where / "config.json").read_bytes())
        for name, digest in weight_digests(where).items():
            h.update(f"{name}\0".encode() + bytes.fromhex(digest))
    bytes_per_token = spec.page_size_bytes * layers // spec.block_size
    return f"vllm:{where.name or 'model'}-{h.hexdigest()[:12]}", bytes_per_token
