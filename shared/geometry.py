"""Block geometry and the sizing formulas.

memd's pages are shape-agnostic bytes; a worker gives them meaning. The
formulas below are the bridge: how many bytes one token's K/V takes for a
model, how many of those fit a page, and how many pages fit a budget:

    bytes_per_token = layers x 2 (K and V) x kv_heads x head_dim x dtype_bytes
    block_bytes     = block_size x bytes_per_token
    num_blocks      = pool_bytes // block_bytes

Llama-2-7B in fp16 (32 layers, 32 KV heads, head_dim 128) takes 512 KiB per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {
    "float32": 4, "float": 4,
    "float16": 2, "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}

# Pages are aligned so that any dtype view (and vectorised copies) lines up.
PAGE_ALIGN = 16


class GeometryError(ValueError):
    """A model, block size or budget that cannot make a pool."""


@dataclass(slots=True, frozen=True)
class ModelShape:
    """What of a model decides its KV size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """layers × 2 (K and V) × kv_heads × head_dim × dtype_bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def page_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        """A page seen as one block of this model: [layers, K/V, tokens, kv_heads, head_dim]."""
        return (self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)


def load_config_json(model_dir: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json, or a GeometryError that names the file."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise GeometryError(f"{path}: no such file (expected a Hugging Face model directory)") from None
    except json.JSONDecodeError as exc:
        raise GeometryError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise GeometryError(f"{path}: not a JSON object")
    return config


def read_model_shape(model_dir: str | Path, dtype: str | None = None) -> ModelShape:
    """The KV shape of a Hugging Face checkpoint, from its config.json."""
    path = Path(model_dir) / "config.json"
    config = load_config_json(model_dir)
    try:
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        shape = ModelShape(
            num_layers=int(config["num_hidden_layers"]),
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            dtype=dtype or str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise GeometryError(f"{path}: missing or bad field {exc}") from None
    if shape.dtype not in DTYPE_BYTES:
        raise GeometryError(f"{path}: unsupported dtype {shape.dtype!r}")
    return shape


@dataclass(slots=True, frozen=True)
class PoolGeometry:
    """The physical pool: `num_blocks` pages of `block_bytes`, one allocation."""

    num_blocks: int
    block_bytes: int
    block_size: int = 0        # tokens per page of the default model; 0 when unknown
    bytes_per_token: int = 0   # of the default model; 0 when unknown

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def plan_pool(
    pool_bytes: int,
    *,
    block_bytes: int | None = None,
    shape: ModelShape | None = None,
    block_size: int | None = None,
) -> PoolGeometry:
    """Size a pool from a budget and either a page size or a model + block size."""
    if (block_bytes is None) == (shape is None):
        raise GeometryError("give either a block size in bytes, or a model and a block size in tokens")
    bytes_per_token = 0
    if shape is not None:
        if not block_size or block_size <= 0:
            raise GeometryError("a block size in tokens (--block-size) is needed with --model")
        bytes_per_token = shape.bytes_per_token
        block_bytes = block_size * bytes_per_token
    assert block_bytes is not None
    if block_bytes <= 0 or block_bytes % PAGE_ALIGN:
        raise GeometryError(f"block size of {block_bytes} bytes must be a positive multiple of {PAGE_ALIGN}")
    num_blocks = pool_bytes // block_bytes
    if num_blocks < 1:
        raise GeometryError(f"a pool of {pool_bytes} bytes holds no block of {block_bytes} bytes")
    return PoolGeometry(num_blocks, block_bytes, block_size or 0, bytes_per_token)
