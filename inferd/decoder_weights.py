"""The decoder's weights as its passes use them, built once from a checkpoint's tensors.

Q, K and V are fused into one matrix, gate and up into another, and on the CPU
every linear weight is laid out for oneDNN's matmul (`inferd.packed_linear`):
each of those is a new tensor. `inferd serve` keeps this object across its
attachments to memd (each builds a decoder on the pool it maps) in place of
the checkpoint's tensors.

oneDNN's layout is made for several rows. Where MKL is at its best (on Intel
CPUs), a decode step of one sequence (one row) can run faster through MKL on
the weights as the checkpoint lays them out; with several rows the layout
wins. On an AMD EPYC, where MKL repacks the weight at every call, the layout
wins at one row too. Which is faster depends on the CPU, so inferd asks the
machine: where float32 weights are laid out and their checkpoint layout takes
at most ONE_ROW_COPY_BYTES, the first layer's products of one row are timed
both ways (once per process and shape), and if MKL's are clearly faster both
layouts are kept (`one_row`) and a one-row decode step uses the checkpoint's:
twice the linear weights' memory, for a single stream's speed. Larger models
keep only the layout: the copy would cost gigabytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.checkpoint import ModelConfig
from inferd.layer_stack import Layer
from inferd.packed_linear import linear, packed

__all__ = ["ONE_ROW_COPY_BYTES", "DecoderWeights", "one_row_prefers_checkpoint"]

ONE_ROW_COPY_BYTES = 1 << 30      # the most a checkpoint-layout copy of the linear weights may take (the docstring)
CLEARLY_FASTER = 0.85             # MKL's one-row products must take at most this share of oneDNN's to keep a copy
TIMING_ROUNDS = 7

_one_row_choices: dict[tuple, bool] = {}     # (dtype, shapes) -> the machine's answer, asked once per process


@dataclass(slots=True)
class DecoderWeights:
    device: torch.device
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor                 # the embeddings themselves where the checkpoint ties them
    layers: list[Layer]
    flops_per_token: int                  # matrix work of one new token through every layer
    one_row: tuple[torch.Tensor, list[Layer]] | None = None    # (lm_head, layers) as the checkpoint lays them out

    @classmethod
    def prepare(cls, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                *, pack: bool = True, one_row: bool | None = None) -> DecoderWeights:
        """From a checkpoint's tensors (`inferd.checkpoint.load_weights`), on `device`.

        `pack`: lay the linear weights out once for oneDNN where it runs them. An LM head tied to the
        embeddings keeps its layout: the lookup needs it, and a copy would double it.

        `one_row`: keep the checkpoint's layout too, for one-row decode steps, where the weights are laid
        out (None: as the module docstring says; True or False, whatever this machine would choose)."""
        device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint lacks {name}")
            return weights[name].to(device)

        embed = w("model.embed_tokens.weight")
        tied = config.tie_embeddings or "lm_head.weight" not in weights
        # The checkpoint's layout is kept beside oneDNN's only while a one-row copy may be wanted (the module
        # docstring); else each layer's fused weights go as soon as they are laid out.
        linear_names = [f"model.layers.{i}.{n}.weight" for i in range(config.num_layers)
                        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
        linear_names += [] if tied else ["lm_head.weight"]
        copy_bytes = sum(weights[n].numel() for n in linear_names if n in weights) * config.dtype.itemsize
        may_keep = pack and (one_row or (one_row is None and config.dtype == torch.float32
                                         and copy_bytes <= ONE_ROW_COPY_BYTES))
        lay_out = packed if pack else lambda weight: weight
        layers: list[Layer] = []
        checkpoint_layers: list[Layer] = []
        flops = 0
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
            o_w, down = w(p + "self_attn.o_proj.weight"), w(p + "mlp.down_proj.weight")
            flops += 2 * sum(m.numel() for m in (qkv_w, o_w, gate_up, down))
            ln1, ln2 = w(p + "input_layernorm.weight"), w(p + "post_attention_layernorm.weight")
            layers.append((ln1, lay_out(qkv_w), qkv_b, lay_out(o_w), ln2, lay_out(gate_up), lay_out(down)))
            if may_keep:
                checkpoint_layers.append((ln1, qkv_w, qkv_b, o_w, ln2, gate_up, down))
        checkpoint_head = embed if tied else w("lm_head.weight")
        head = checkpoint_head if tied else lay_out(checkpoint_head)
        keep = may_keep and bool(layers) and layers[0][1].is_mkldnn and \
            (one_row or one_row_prefers_checkpoint(checkpoint_layers[0], layers[0]))
        return cls(device, embed, w("model.norm.weight"), head, layers, flops,
                   (checkpoint_head, checkpoint_layers) if keep else None)

    @property
    def layout(self) -> str:
        """"onednn" where the layers' linear weights are laid out for oneDNN's matmul, "onednn+checkpoint"
        where a one-row decode step takes them as the checkpoint lays them out, else "checkpoint"."""
        if not (self.layers and self.layers[0][1].is_mkldnn):
            return "checkpoint"
        return "onednn+checkpoint" if self.one_row is not None else "onednn"


def _products(layer: Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's four linear weights: fused QKV, output, fused gate/up, down."""
    return layer[1], layer[3], layer[5], layer[6]


def one_row_prefers_checkpoint(checkpoint: Layer, laid_out: Layer) -> bool:
    """Whether this machine runs a layer's products of one row clearly faster (CLEARLY_FASTER) through MKL on the
    checkpoint's layout than through oneDNN on its own, on one thread as a one-row pass runs; asked once per
    process for each dtype and set of shapes, so that every decoder of a process makes the same choice."""
    weights = _products(checkpoint)
    key = (weights[0].dtype, tuple(tuple(w.shape) for w in weights))
    if key not in _one_row_choices:
        inputs = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights]
        ways = {"mkl": (F.linear, weights), "onednn": (linear, _products(laid_out))}
        best = dict.fromkeys(ways, float("inf"))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                for _ in range(TIMING_ROUNDS):       # taking turns; the best of each: cold rounds do not count
                    for way, (product, ws) in ways.items():
                        start = time.perf_counter()
                        for x, w in zip(inputs, ws, strict=True):
                            product(x, w)
                        best[way] = min(best[way], time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)
        _one_row_choices[key] = best["mkl"] <= CLEARLY_FASTER * best["onednn"]
    return _one_row_choices[key]
