"""A Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer.json.

Llama, Qwen2 and Mistral share one decoder shape; what differs is read from
the config (GQA, qkv bias, tied embeddings, RoPE base and Llama 3 scaling).
Both the older config spelling (`rope_theta`, `rope_scaling`) and the newer
one (`rope_parameters`) are understood.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shared.geometry import GeometryError, load_config_json

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CheckpointError(ValueError):
    """A model directory kvpool cannot serve; the message names the file and the field."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    qkv_bias: bool
    tie_embeddings: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def page_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)


def read_config(model_dir: Path, dtype: str | None = None) -> ModelConfig:
    path = model_dir / "config.json"
    try:
        raw = load_config_json(model_dir)
    except GeometryError as exc:
        raise CheckpointError(str(exc)) from None
    archs = raw.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; "
                              f"kvpool serves {', '.join(sorted(ARCHITECTURES))}")
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "default"):
        raise CheckpointError(f"{path}: unsupported rope scaling {scaling!r} (llama3 is supported)")
    eos = raw.get("eos_token_id")
    dtype_name = dtype or raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype_name not in DTYPES:
        raise CheckpointError(f"{path}: unsupported dtype {dtype_name!r}")
    try:
        heads = int(raw["num_attention_heads"])
        return ModelConfig(
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3" else None,
            # Attention here is full, so a sliding-window model (Mistral) is served only up to
            # its window, where full and windowed attention agree.
            max_position=min(int(raw.get("max_position_embeddings", 4096)),
                             int(raw.get("sliding_window") or 1 << 62)),
            qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            dtype=DTYPES[dtype_name],
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            bos_token_id=raw.get("bos_token_id"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: missing or bad field {exc}") from None


def load_weights(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file, cast to `dtype`."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return weights


def load_tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"{path}: no such file (the model needs its tokenizer.json)")
    return Tokenizer.from_file(str(path))
