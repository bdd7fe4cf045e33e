"""The decoder (Llama, Qwen2, Mistral), reading and writing K/V in memd's pool.

Each pool page is one block of this model: [layers, K/V, block_size,
kv_heads, head_dim]. A forward pass writes the new tokens' K/V straight into
their positions, then attends over each sequence's context gathered through its
block table. Nothing is copied through memd; the pool is mapped here.

One `forward` serves prefill, decode and any mix of the two: the batch is a
flat run of new tokens, plus per sequence its context length and block table.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from inferd import flex_decode, paged_kernel
from inferd.block_table import padded_tables
from inferd.checkpoint import ModelConfig
from inferd.decoder_weights import DecoderWeights
from inferd.layer_stack import (
    AttentionGroup,
    AttentionLayout,
    LayerStack,
    PassGraphs,
    SplitAttention,
    WeightSets,
    kind_of,
)
from inferd.paged_kernel import KernelUnavailable


@dataclass(slots=True)
class Batch:
    """What one forward pass computes: new tokens of several sequences, back to back."""

    token_ids: torch.Tensor      # [T] long: every sequence's new tokens, in sequence order
    positions: torch.Tensor      # [T] long: absolute position of each new token
    slot_blocks: torch.Tensor    # [T] long: pool block receiving each new token's K/V
    slot_offsets: torch.Tensor   # [T] long: position within that block
    query_lens: list[int]        # new tokens per sequence
    context_lens: list[int]      # tokens per sequence after this pass (cached + new)
    block_tables: torch.Tensor   # [B, max_blocks] long, padded with any valid block id
    seq_lens: torch.Tensor       # [B] long: context_lens
    last_rows: torch.Tensor      # [B] long: each sequence's last new token among the pass's


def build_batch(seqs: list[tuple[list[int], int, list[int]]], block_size: int,
                device: torch.device | str = "cpu") -> Batch:
    """From (new token ids, tokens already in the cache, block table) per sequence."""
    tokens, positions, blocks, offsets, qlens, clens = [], [], [], [], [], []
    for new, cached, table in seqs:
        pos = range(cached, cached + len(new))
        tokens += new
        positions += pos
        blocks += [table[p // block_size] for p in pos]
        offsets += [p % block_size for p in pos]
        qlens.append(len(new))
        clens.append(cached + len(new))
    # Only the blocks that hold context are read: a table's lookahead blocks would widen every gather.
    tables = padded_tables([t for _, _, t in seqs], [-(-ctx // block_size) for ctx in clens])
    if tables.device != torch.device(device):
        tables = tables.to(device)
    # One tensor for the per-token rows and, padded to as long, the per-sequence ones: one op, not one a
    # tensor. On inferd's forward thread every op outside its traced graph may wait for the GIL behind the
    # event loop, so a step makes as few as it can.
    pad = [0] * (len(tokens) - len(seqs))
    last = list(itertools.accumulate(qlens, initial=-1))[1:]
    rows = torch.tensor([tokens, positions, blocks, offsets, clens + pad, last + pad], dtype=torch.long,
                        device=device)
    token_ids, positions_t, blocks_t, offsets_t, lens, last_t = rows.unbind(0)
    if pad:
        lens, last_t = lens[:len(seqs)], last_t[:len(seqs)]
    return Batch(token_ids, positions_t, blocks_t, offsets_t, qlens, clens, tables, lens, last_t)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE frequencies, with Llama 3's long-context rescaling when the config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.float()
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled).float()


ATTENTION = ("auto", "paged", "flex", "gather")


def _attention(asked: str, kv: torch.Tensor, config: ModelConfig) -> str:
    if asked not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, not {asked!r}")
    device, block_size = kv.device, kv.shape[3]
    if asked == "flex":
        why = flex_decode.unavailable(device, block_size, config.num_heads, config.num_kv_heads, config.head_dim,
                                      pool_elements=kv.numel())
        if device.type != "cpu" and why is not None:         # on the CPU it compiles for tests, as it is
            raise KernelUnavailable(why)
        return asked
    if asked == "gather" or (asked == "auto" and device.type != "cpu"):
        return "gather"
    if device.type != "cpu":
        raise KernelUnavailable(f"the paged kernel reads CPU memory; this pool is on {device}")
    return "paged" if paged_kernel.available(required=asked == "paged") else "gather"


class PagedDecoder:
    """Weights plus the pool view; `forward` returns the logits of each sequence's last new token."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor] | DecoderWeights, kv: torch.Tensor,
                 device: torch.device | str = "cpu", *, traced: bool = True, attention: str = "auto",
                 pack_weights: bool = True, fused: bool = True) -> None:
        """`weights`: a checkpoint's tensors, or a `DecoderWeights` already prepared on `device`.

        `attention`: how decode rows attend. "paged" reads K/V from the pages with inferd's CPU kernel
        (inferd.paged_kernel), "flex" with torch's flex attention (inferd.flex_decode, built for a GPU),
        "gather" copies each sequence's pages out for scaled_dot_product_attention. "auto" takes "paged"
        where the pool is in CPU memory and the kernel builds, else "gather": "flex" is asked for by name,
        since torch's kernel refuses the pools of 2**31 elements or more that production runs
        (inferd.flex_decode.MAX_POOL_ELEMENTS).

        `pack_weights` (with a checkpoint's tensors): lay the linear weights out once for oneDNN where it
        runs them (inferd.packed_linear).

        `fused`: run each layer's norms, RoPE and K/V store as one CPU op each (inferd/layer_kernels.cpp),
        where the pool is in CPU memory and inferd's kernels build; else as torch's ops."""
        self.config = config
        self.device = torch.device(device)
        self.kv = kv                                   # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
        self.block_size = kv.shape[3]
        if not isinstance(weights, DecoderWeights):
            weights = DecoderWeights.prepare(config, weights, self.device, pack=pack_weights)
        elif weights.device != self.device:
            raise ValueError(f"these weights were prepared on {weights.device}, not {self.device}")
        self.weights = weights
        self.embed, self.norm, self.lm_head, self.layers = weights.embed, weights.norm, weights.lm_head, weights.layers
        self.inv_freq = rope_inv_freq(config).to(self.device)
        self.attention = _attention(attention, self.kv, config)
        self.fused = fused and self.kv.device.type == "cpu" and paged_kernel.load()
        self._flex = flex_decode.FlexDecode(kv, config.num_heads, config.max_position) \
            if self.attention == "flex" else None
        self._stack = LayerStack(config, paged=self.attention == "paged", fused=self.fused, flex=self._flex)
        around = (self.embed, self.inv_freq, self.norm)
        one_row = weights.one_row
        self._weights = WeightSets(((*around, self.lm_head), self.layers),
                                   ((*around, one_row[0]), one_row[1]) if one_row else None)
        self._graphs = PassGraphs(self._stack, self._weights) if traced else None

    def compile_ahead(self, rows: int) -> list[int]:
        """Where decode attends through flex attention: compile it now for steps of up to `rows` sequences
        (inferd.flex_decode.FlexDecode.compile_ahead), so that no request waits for it. The batch sizes."""
        return self._flex.compile_ahead(rows, self.kv) if self._flex is not None else []

    def warm_up(self) -> list[str]:
        """Trace every kind of pass a request can need now, on scratch pages: the kinds traced.

        A kind is traced on its first pass, which then takes the trace's time
        too: the first prompt that followed cached tokens (a session's second
        turn) waited for the trace before its first token. Run before inferd
        says it is ready, no request waits for it.
        The scratch pages are a few blocks of the pool's shape; the graphs take
        the pages as an input, so they serve the pool as they serve these.
        """
        if self._graphs is None:
            return []
        scratch = torch.zeros((6, *self.kv.shape[1:]), dtype=self.kv.dtype, device=self.device)
        one, other = [0, 1, 2], [3, 4, 5]                        # three tokens at most: any block size holds them
        passes = ([([1, 2], 0, one)],                            # a whole prompt
                  [([1, 2], 1, one)],                            # a prompt after cached tokens
                  [([3], 2, one)],                               # one sequence's decode step
                  [([3], 2, one), ([4], 2, other)])              # several sequences' decode step
        for seqs in passes:
            self.forward(build_batch(seqs, self.block_size, self.device), kv=scratch)
        return self.traced_graphs

    @property
    def weight_layout(self) -> str:
        """How the linear weights are laid out (inferd.decoder_weights.DecoderWeights.layout)."""
        return self.weights.layout

    @property
    def traced_graphs(self) -> list[str]:
        """The kinds of pass that run as a traced graph: "batch" (a decode step of several sequences),
        "single" (of one), "prompt" (one whole prompt), "chunk" (one sequence's tokens after its cached ones)
        and "pages" (a decode step through flex attention)."""
        return self._graphs.kinds if self._graphs is not None else []

    def flops_per_token(self) -> int:
        """Matrix work of one new token through every layer (the LM head runs once per sequence)."""
        return self.weights.flops_per_token

    @torch.inference_mode()
    def forward(self, batch: Batch, kv: torch.Tensor | None = None) -> torch.Tensor:
        """`kv`: pages to write and read instead of the pool's (a recompute that must not touch shared pages).

        A decode step of a small model is mostly the cost of launching ops, so each layer launches
        few (inferd.layer_stack.LayerStack.logits), and a pass of one kind (a decode step, one
        sequence's prompt or chunk) runs as one traced graph, embeddings to logits
        (inferd.layer_stack.PassGraphs).
        """
        pages = self.kv if kv is None else kv
        layout = self._attention_layout(batch, flex=kv is None)
        args = (batch.token_ids, batch.positions, pages, batch.slot_blocks, batch.slot_offsets, batch.block_tables,
                batch.last_rows)
        if self._graphs is not None:
            return self._graphs.run(args, layout)
        return self._stack.logits(*args, layout, *self._weights.of(kind_of(layout)))

    def _attention_layout(self, batch: Batch, *, flex: bool = True) -> AttentionLayout | SplitAttention:
        """Which keys each new token sees, in as few attention calls as keep every query a real one.

        A decode step (one new token per sequence) attends in one call, its keys masked to each
        sequence's context; one sequence attends alone, its keys cut to its context (causal over a
        whole prompt, masked for a chunk after cached tokens). A pass mixing the two splits into
        those groups, rather than padding every sequence to the longest chunk's queries.

        `flex=False`: decode rows attend over a gathered copy even where flex attention reads the pool's
        pages (its views span the pool; other pages, a recompute's, are not the pool).
        """
        flex_pages = self._flex is not None and flex
        if len(batch.query_lens) == 1:
            if batch.query_lens[0] == 1 and flex_pages:
                return self._pages_read(batch.seq_lens, batch.block_tables)
            if batch.query_lens[0] == 1 and self.attention == "paged":
                return AttentionLayout(None, batch.context_lens[0], lens=batch.seq_lens)
            return self._one_sequence(batch.query_lens[0], batch.context_lens[0])
        if max(batch.query_lens) == 1:
            if flex_pages:
                return self._pages_read(batch.seq_lens, batch.block_tables)
            return self._decode_rows(batch.context_lens, batch.block_tables.shape[1], batch.seq_lens)
        groups, start, decode_rows, decode_seqs = [], 0, [], []
        for i, (new, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
            if new == 1:
                decode_rows.append(start)
                decode_seqs.append(i)
            else:
                tables = batch.block_tables[i:i + 1, :-(-ctx // self.block_size)]
                groups.append(AttentionGroup(slice(start, start + new), tables, self._one_sequence(new, ctx)))
            start += new
        if decode_seqs:
            clens = [batch.context_lens[i] for i in decode_seqs]
            blocks = -(-max(clens) // self.block_size)
            seqs = torch.tensor(decode_seqs, device=self.device)
            tables = batch.block_tables[seqs, :blocks]
            lens = torch.tensor(clens, device=self.device)
            layout = self._pages_read(lens, tables) if flex_pages else \
                self._decode_rows(clens, blocks, lens)
            groups.append(AttentionGroup(torch.tensor(decode_rows, device=self.device), tables, layout))
        return SplitAttention(groups)

    def _one_sequence(self, new: int, ctx: int) -> AttentionLayout:
        """One sequence's `new` tokens, the last of its `ctx`: causal over a whole prompt, else masked."""
        if new == 1:                   # over a gathered copy: the paged kernel's step is `_attention_layout`'s
            return AttentionLayout(None, ctx)
        if new == ctx:
            return AttentionLayout(None, ctx, causal=True)
        qpos = torch.arange(ctx - new, ctx, device=self.device)
        mask = torch.arange(ctx, device=self.device)[None, :] <= qpos[:, None]       # [new, ctx]
        return AttentionLayout(mask[None, None], ctx)

    def _pages_read(self, lens: torch.Tensor, tables: torch.Tensor) -> AttentionLayout:
        """Decode rows (`lens` keys each) reading their pages through flex attention (inferd.flex_decode)."""
        assert self._flex is not None
        return AttentionLayout(None, None, block_mask=self._flex.mask(tables, lens))

    def _decode_rows(self, context_lens: list[int], blocks: int, lens: torch.Tensor) -> AttentionLayout:
        """Decode rows of several sequences: each row's key count (`lens`) for the paged kernel, else a key
        mask over the gathered copy (a mask the kernel does not read costs a decode step ops on its thread)."""
        if self.attention == "paged":
            return AttentionLayout(None, None, lens=lens)
        return AttentionLayout(self._key_mask(context_lens, blocks), None)

    def _key_mask(self, context_lens: list[int], blocks: int) -> torch.Tensor:
        """[B, 1, 1, keys]: which of `blocks` blocks' key positions hold each sequence's context."""
        clens = torch.tensor(context_lens, device=self.device)
        keys = torch.arange(blocks * self.block_size, device=self.device)
        return (keys[None, :] < clens[:, None])[:, None, None, :]
