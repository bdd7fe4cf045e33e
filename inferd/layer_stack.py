"""The decoder's layers as a function of tensors and the config alone, and its passes as traced graphs.

`LayerStack.run` is every layer of a forward pass: RMS norm, fused QKV, RoPE
on Q and K at once, the new K/V written into the pool's pages, attention over
each sequence's pages gathered through its block table, the MLP. It holds no
tensor: the weights are an argument, so a graph traced from it keeps none.

`PassGraphs` traces `run` once per kind of pass, with torch.jit.trace:
"batch" (a decode step of several sequences, a key mask), "single" (one
sequence's decode step, its keys cut to a stand-in tensor's length, which the
trace keeps symbolic), "prompt" (one sequence's whole prompt, causal, keys
cut the same way), "chunk" (one sequence's new tokens after its cached
ones, a query-by-key mask) and "pages" (a decode step whose rows read their
pages through flex attention: inferd.flex_decode). A pass mixing decode rows with prompts runs
eager. A traced graph runs its ops in C++ without taking the GIL between
them. The eager layers take it back after every op, so on inferd's forward
thread they wait behind the event loop's Python work at every op, the
longer the busier the loop is. A graph holds the same ops, so its results
are the eager ones bit for bit, and nothing in it depends on a shape: one
graph serves every batch size, prompt and context length.

A graph's inputs must not be released inside it. torch ties each tensor
Python can see to its Python object: when the last reference other than the
Python object's goes, torch takes the GIL to let go of that object. The
interpreter drops each input once its last op has run, so every weight and
every per-pass tensor would take the GIL in the middle of the graph, waiting
behind the event loop each time. So a `torch.ScriptList` (references on
the C++ side) holds the weights for the graphs' life and each pass's
tensors for its call, and the last reference of each goes back on the
calling thread, which holds the GIL.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from inferd.checkpoint import ModelConfig
from inferd.flex_decode import FlexDecode
from inferd.packed_linear import linear
from inferd.paged_kernel import paged_decode

log = structlog.get_logger("inferd.layer_stack")

# torch.jit.trace is deprecated in favour of torch.compile and torch.export, neither of which yet runs a graph
# without the GIL on the CPU: this one message is not for inferd's users.
warnings.filterwarnings("ignore", message=r"`torch\.jit\.trace` is deprecated", category=DeprecationWarning)

Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor,
              torch.Tensor]    # ln1, qkv_w, qkv_b, o_w, ln2, gate_up, down
Around = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]     # embed, RoPE's inv_freq, norm, lm_head


@dataclass(slots=True)
class AttentionLayout:
    """How the new tokens of one group of sequences attend: decode rows together, or one sequence alone."""

    mask: torch.Tensor | None        # [B, 1, queries, keys] boolean, or None when no key must be hidden
    key_len: int | None              # one sequence: its keys cut to this length
    causal: bool = False
    lens: torch.Tensor | None = None  # [B] long, decode rows through the paged kernel only: each row's keys
    block_mask: Any = None           # decode rows through flex attention only: their pages (inferd.flex_decode)


@dataclass(slots=True)
class AttentionGroup:
    rows: torch.Tensor | slice       # the group's new tokens among the pass's
    tables: torch.Tensor             # [sequences, blocks] the group's block tables, cut to the blocks it reads
    layout: AttentionLayout


@dataclass(slots=True)
class SplitAttention:
    """A pass mixing decode rows with prompt chunks: each group attends on its own.

    Padding every sequence to the longest chunk's queries would make each decode row attend with
    hundreds of padded queries: its attention would grow with the chunk's length, not its own one."""

    groups: list[AttentionGroup]


@dataclass(slots=True)
class WeightSets:
    """The weights a pass runs with: the layers' linear weights as laid out for passes of several rows, and,
    where the decoder keeps them (inferd.decoder_weights), as laid out for a decode step of one sequence."""

    rows: tuple[Around, list[Layer]]
    one_row: tuple[Around, list[Layer]] | None = None

    def of(self, kind: str | None) -> tuple[Around, list[Layer]]:
        if self.for_one_row(kind):
            assert self.one_row is not None
            return self.one_row
        return self.rows

    def for_one_row(self, kind: str | None) -> bool:
        """Whether a pass of `kind` (`kind_of`) runs with the one-row weights."""
        return kind == "single" and self.one_row is not None


def kind_of(layout: AttentionLayout | SplitAttention) -> str | None:
    """The kind of pass a layout makes (see PassGraphs), or None where it mixes sequences' prompts.

    A mask (or the paged kernel's key counts) and no key length is a decode step of several sequences;
    keys cut to a length with no mask, one sequence's decode step (its one new token sees every key) or,
    causal, its whole prompt; keys cut to the mask's width, one sequence's chunk after its cached tokens.
    Decode rows reading their pages through flex attention, one sequence or several, make "pages"."""
    if isinstance(layout, SplitAttention):
        return None
    if layout.block_mask is not None:
        return "pages"
    if (layout.mask is not None or layout.lens is not None) and layout.key_len is None:
        return "batch"
    if layout.key_len is not None and layout.mask is None:
        return "prompt" if layout.causal else "single"
    if layout.key_len is not None and layout.key_len == layout.mask.shape[-1] and not layout.causal:
        return "chunk"
    return None


class LayerStack:
    """Every layer, from the config alone; `paged`: decode rows attend through `inferd.paged_kernel`;
    `fused`: the norms, RoPE and the K/V store run as inferd's CPU ops (inferd/layer_kernels.cpp);
    `flex`: decode rows whose layout carries a block mask attend through it (inferd.flex_decode)."""

    def __init__(self, config: ModelConfig, *, paged: bool = False, fused: bool = False,
                 flex: FlexDecode | None = None) -> None:
        # The flex decoder by number only: a traced graph, which torch keeps for the process's life, holds this.
        self.config, self.paged, self.fused = config, paged, fused
        self.flex_id = flex.id if flex is not None else None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """As transformers computes it: in float32, scaled by the weight after the cast back."""
        if self.fused:
            return torch.ops.kvpool.rms_norm(x, weight, self.config.rms_norm_eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, self.config.rms_norm_eps).to(x.dtype)

    def logits(self, token_ids: torch.Tensor, positions: torch.Tensor, pages: torch.Tensor,
               slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, block_tables: torch.Tensor,
               last: torch.Tensor, layout: AttentionLayout | SplitAttention, around: Around,
               layers: list[Layer]) -> torch.Tensor:
        """A whole pass: the new tokens' embeddings and RoPE angles, every layer, the logits of the `last` rows.

        Q and K are rotated together: a half-turn `roll` with a signed sine stands for rotate_half, and
        each op still rounds where transformers' does, so a bfloat16 model's logits match its bit for bit."""
        c = self.config
        embed, inv_freq, norm, lm_head = around
        freqs = positions.float()[:, None] * inv_freq[None, :]                # [T, dim / 2]
        half_cos = freqs.cos()
        cos = torch.cat((half_cos, half_cos), dim=-1).to(c.dtype)[:, None, :]     # cat: cheaper than repeat(1, 2)
        sin = freqs.sin()
        signed_sin = torch.cat((-sin, sin), dim=-1).to(c.dtype)[:, None, :]
        h = self.run(embed[token_ids], cos, signed_sin, pages, slot_blocks, slot_offsets, block_tables, layout,
                     layers)
        return linear(self.rms_norm(h[last], norm), lm_head).float()

    def run(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, pages: torch.Tensor,
            slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, block_tables: torch.Tensor,
            layout: AttentionLayout | SplitAttention, layers: list[Layer]) -> torch.Tensor:
        """Every layer, on the hidden states `h` of the new tokens; their K/V written into `pages`."""
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        half, inter = c.head_dim // 2, c.intermediate_size
        for layer, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up, down) in enumerate(layers):
            x = self.rms_norm(h, ln1)
            qkv = linear(x, qkv_w, qkv_b)
            cache = pages[:, layer]                                     # [blocks, 2, bs, kv_heads, dim]
            if self.fused:
                torch.ops.kvpool.rope_store(qkv, cos, signed_sin, cache, slot_blocks, slot_offsets, c.num_heads,
                                            c.num_kv_heads)
            else:
                qk = qkv[:, :q_size + kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
                turned = qk.roll(half, dims=-1)
                qk.copy_(qk * cos + turned * signed_sin)                 # RoPE, on Q and K at once
                # index_put_, not `cache[slot_blocks, :, slot_offsets] = ...`: a traced setitem of one token drops
                # its leading 1 with a fixed view, and the graph then failed on passes of more tokens.
                cache.transpose(1, 2).index_put_((slot_blocks, slot_offsets),
                                                 qkv[:, q_size:].view(-1, 2, c.num_kv_heads, c.head_dim))
            attn = self.attend(qkv[:, :q_size].view(-1, c.num_heads, c.head_dim), cache, block_tables, layout)
            h = h + linear(attn, o_w)
            x = self.rms_norm(h, ln2)
            gu = linear(x, gate_up)
            h = h + linear(F.silu(gu[:, :inter]).mul_(gu[:, inter:]), down)
        return h

    def chunk_attention(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """A prompt's new tokens after its cached ones ([1, heads, new, dim] over [1, kv heads, keys, dim]):
        every cached key, unmasked, then the new keys causally, as two calls merged.

        One call with a query-by-key mask computes every query against every
        key, the half the mask hides included; split, the cached keys need no
        mask and the new ones a causal one. torch's CPU flash attention returns
        the log-sum-exp the merge needs; it wants as many K/V heads as query heads.
        """
        c = self.config
        new = queries.shape[2]
        cached = keys.shape[2] - new
        repeat = c.num_heads // c.num_kv_heads
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        # The cached keys, unmasked: the query heads that share a K/V head go as one run of queries over it,
        # so those keys are not copied once per query head (for 1,750 cached keys a copy of 11 MB a layer).
        stacked = queries.reshape(1, c.num_kv_heads, repeat * new, c.head_dim)
        past, past_lse = flash(stacked, keys[:, :, :cached], values[:, :, :cached], 0.0, False)
        past, past_lse = past.reshape(1, c.num_heads, new, c.head_dim), past_lse.reshape(1, c.num_heads, new)
        own_keys = keys[:, :, cached:].repeat_interleave(repeat, 1)
        own_values = values[:, :, cached:].repeat_interleave(repeat, 1)
        own, own_lse = flash(queries, own_keys, own_values, 0.0, True)
        return _merged(past, past_lse, own, own_lse)

    def attend(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               layout: AttentionLayout | SplitAttention) -> torch.Tensor:
        c = self.config
        if isinstance(layout, SplitAttention):
            out = q.new_empty(q.shape[0], c.num_heads * c.head_dim)
            for group in layout.groups:
                out[group.rows] = self.attend(q[group.rows], cache, group.tables, group.layout)
            return out
        if layout.lens is not None:                         # one new token per row, read from its pages
            return paged_decode(q, cache, block_tables, layout.lens, c.head_dim ** -0.5)
        if layout.block_mask is not None:                   # likewise, on a GPU: the mask the step made last
            assert self.flex_id is not None
            return torch.ops.kvpool.flex_decode(q, cache, self.flex_id, c.head_dim ** -0.5)
        bsz = block_tables.shape[0]
        # K and V gathered apart: each gather is [B, max_blocks, bs, kv_heads, dim], whose block and slot dims
        # merge into one without a copy; gathering both at once would need a second copy to separate them.
        blocks = block_tables.view(-1)
        keys = cache[:, 0].index_select(0, blocks).view(bsz, -1, c.num_kv_heads, c.head_dim).transpose(1, 2)
        values = cache[:, 1].index_select(0, blocks).view(bsz, -1, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if layout.key_len is not None:                      # one sequence: its new tokens are its queries
            keys, values = keys[:, :, :layout.key_len], values[:, :, :layout.key_len]
            queries = q[None].transpose(1, 2)               # [1, heads, new tokens, dim]
            if layout.mask is not None and queries.device.type == "cpu":
                return self.chunk_attention(queries, keys, values).transpose(1, 2).reshape(
                    -1, c.num_heads * c.head_dim)
        else:                                               # one new token per sequence
            queries = q[:, None].transpose(1, 2)            # [B, heads, 1, dim]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=layout.mask, is_causal=layout.causal,
                                             enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, c.num_heads * c.head_dim)


def _merged(past: torch.Tensor, past_lse: torch.Tensor, own: torch.Tensor, own_lse: torch.Tensor) -> torch.Tensor:
    """Two attentions of the same queries over disjoint keys, as one: each weighted by its share of the
    softmax's denominator (their log-sum-exps)."""
    top = torch.maximum(past_lse, own_lse)
    w_past, w_own = (past_lse - top).exp().unsqueeze(-1), (own_lse - top).exp().unsqueeze(-1)
    return (past * w_past + own * w_own) / (w_past + w_own)


class PassGraphs:
    """A decoder's traced passes, one graph per kind, each traced on its first pass with its kind's weights."""

    def __init__(self, stack: LayerStack, weights: WeightSets) -> None:
        self.stack, self.weights = stack, weights
        sets = {False: weights.rows} if weights.one_row is None else {False: weights.rows, True: weights.one_row}
        # Each set as a graph's last inputs, and every one held: none is let go inside a graph (the docstring).
        self._inputs = {one_row: [*around, *(w for layer in layers for w in layer if w is not None)]
                        for one_row, (around, layers) in sets.items()}
        self._held_weights = torch.ScriptList([w for inputs in self._inputs.values() for w in inputs])
        self._present = [tuple(w is not None for w in layer) for layer in weights.rows[1]]
        self._graphs: dict[str, torch.jit.ScriptFunction | None] = {}                # None: tracing failed

    @property
    def kinds(self) -> list[str]:
        return sorted(kind for kind, graph in self._graphs.items() if graph is not None)

    def run(self, args: tuple[torch.Tensor, ...], layout: AttentionLayout | SplitAttention) -> torch.Tensor:
        """`LayerStack.logits` of this pass: through its kind's graph, or eager where it mixes sequences' prompts
        (`kind_of` says which)."""
        kind = kind_of(layout)
        if kind is None:
            return self._eager(args, layout, kind)
        assert isinstance(layout, AttentionLayout)
        # A decode step's or chunk's mask, else a tensor whose length alone counts (the keys' cut; none for
        # "pages", whose op reads the mask the step made).
        if kind == "batch":
            stand_in = layout.mask if layout.mask is not None else layout.lens    # the paged kernel's key counts
        elif kind == "chunk":
            stand_in = layout.mask
        else:
            stand_in = torch.empty(layout.key_len or 0, dtype=torch.uint8)
        inputs = (*args, stand_in, *self._inputs[self.weights.for_one_row(kind)])
        if kind not in self._graphs:
            try:
                # Tracing runs the layers once, on this pass's inputs: it writes the K/V the graph then writes
                # again, the same values into the same slots.
                self._graphs[kind] = _trace(self.stack, self._present, kind, len(args) + 1, inputs)
            except Exception as exc:
                logits = self._eager(args, layout, kind)    # a fault of the pass itself raises here, and
                self._graphs[kind] = None                     # the kind runs eager from now on
                log.warning("passes of this kind run eager: tracing them failed", kind=kind, error=str(exc))
                return logits
        graph = self._graphs[kind]
        if graph is None:
            return self._eager(args, layout, kind)
        held = torch.ScriptList([*args, stand_in])     # let go here, after the graph, with the GIL (the docstring)
        with torch.jit.optimized_execution(False):     # no profiling or fusing: the same ops, every time
            out = graph(*inputs)
        del held
        return out

    def _eager(self, args: tuple[torch.Tensor, ...], layout: AttentionLayout | SplitAttention,
               kind: str | None) -> torch.Tensor:
        return self.stack.logits(*args, layout, *self.weights.of(kind))


def _trace(stack: LayerStack, present: list[tuple[bool, ...]], kind: str, leading: int,
           inputs: tuple[torch.Tensor, ...]) -> torch.jit.ScriptFunction:
    """`stack.logits` of a pass of `kind`, traced: the `leading` inputs are the pass's, then the weights.

    Module-level, closing over no decoder: torch keeps every traced function for
    the process's life, and one holding a decoder would hold its weights and pool."""
    def layers_of_a_pass(*tensors: torch.Tensor) -> torch.Tensor:
        *args, stand_in = tensors[:leading]
        around, weights = tensors[leading:leading + 4], iter(tensors[leading + 4:])
        layers = [tuple(next(weights) if there else None for there in layer) for layer in present]
        # The paged kernel's key counts are the stand-in (one sequence: its length), so the graph keeps them an input.
        if kind == "batch":
            layout = AttentionLayout(None, None, lens=stand_in) if stack.paged else AttentionLayout(stand_in, None)
        elif kind == "chunk":
            layout = AttentionLayout(stand_in, stand_in.shape[-1])
        elif kind == "single":
            lens = torch.ones_like(stand_in, dtype=torch.long).sum(0, keepdim=True) if stack.paged else None
            layout = AttentionLayout(None, stand_in.shape[0], lens=lens)
        elif kind == "pages":
            layout = AttentionLayout(None, None, block_mask=True)     # attend: torch.ops.kvpool.flex_decode
        else:
            layout = AttentionLayout(None, stand_in.shape[0], causal=True)
        return stack.logits(*args, layout, around, layers)    # type: ignore[arg-type]
    return torch.jit.trace(layers_of_a_pass, inputs, check_trace=False)
