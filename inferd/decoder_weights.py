"""The decoder's weights as its passes use them, built once from a checkpoint's tensors.

Q, K and V are fused into one matrix, gate and up into another, and on the CPU
every linear weight is laid out for oneDNN's matmul (`inferd.packed_linear`):
each of those is a new tensor. `inferd serve` keeps this object across its
attachments to memd (each builds a decoder on the pool it maps) in place of
the checkpoint's tensors, so no weight is held twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.checkpoint import ModelConfig
from inferd.layer_stack import Layer
from inferd.packed_linear import packed

__all__ = ["DecoderWeights"]


@dataclass(slots=True)
class DecoderWeights:
    device: torch.device
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor                 # the embeddings themselves where the checkpoint ties them
    layers: list[Layer]
    flops_per_token: int                  # matrix work of one new token through every layer

    @classmethod
    def prepare(cls, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                *, pack: bool = True) -> DecoderWeights:
        """From a checkpoint's tensors (`inferd.checkpoint.load_weights`), on `device`.

        `pack`: lay the linear weights out once for oneDNN where it runs them. An LM head tied to the
        embeddings keeps its layout: the lookup needs it, and a copy would double it."""
        device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint lacks {name}")
            return weights[name].to(device)

        lay_out = packed if pack else lambda weight: weight
        embed = w("model.embed_tokens.weight")
        tied = config.tie_embeddings or "lm_head.weight" not in weights
        layers: list[Layer] = []
        flops = 0
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
            o_w, down = w(p + "self_attn.o_proj.weight"), w(p + "mlp.down_proj.weight")
            flops += 2 * sum(m.numel() for m in (qkv_w, o_w, gate_up, down))
            layers.append((w(p + "input_layernorm.weight"), lay_out(qkv_w), qkv_b, lay_out(o_w),
                           w(p + "post_attention_layernorm.weight"), lay_out(gate_up), lay_out(down)))
        return cls(device, embed, w("model.norm.weight"), embed if tied else lay_out(w("lm_head.weight")), layers,
                   flops)

    @property
    def layout(self) -> str:
        """"onednn" where the layers' linear weights are laid out for oneDNN's matmul, else "checkpoint"."""
        return "onednn" if self.layers and self.layers[0][1].is_mkldnn else "checkpoint"
