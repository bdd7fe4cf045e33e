"""The decoder (Llama, Qwen2, Mistral), reading and writing K/V in memd's pool.

Each pool page is one block of this model: [layers, K/V, block_size,
kv_heads, head_dim]. A forward pass writes the new tokens' K/V straight into
their positions, then attends over each sequence's context gathered through its
block table. Nothing is copied through memd; the pool is mapped here.

One `forward` serves prefill, decode and any mix of the two: the batch is a
flat run of new tokens, plus per sequence its context length and block table.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.checkpoint import ModelConfig


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
    used = [table[:-(-ctx // block_size)] for table, ctx in zip((t for _, _, t in seqs), clens, strict=True)]
    width = max(len(t) for t in used)
    tables = [t + [t[0]] * (width - len(t)) for t in used]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return Batch(as_long(tokens), as_long(positions), as_long(blocks), as_long(offsets), qlens, clens,
                 as_long(tables))


@dataclass(slots=True)
class _Layout:
    mask: torch.Tensor | None        # [B, 1, max_q, keys] boolean, or None when no key must be hidden
    gather: torch.Tensor | None      # [B, max_q] indices of each sequence's new tokens, None when not padded
    valid: torch.Tensor | None       # [B, max_q] which padded query rows are real
    key_len: int | None              # one sequence: its keys cut to this length
    causal: bool = False


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


class PagedDecoder:
    """Weights plus the pool view; `forward` returns the logits of each sequence's last new token."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], kv: torch.Tensor,
                 device: torch.device | str = "cpu", *, traced_decode: bool = True) -> None:
        self.config = config
        self.device = torch.device(device)
        self.kv = kv                                   # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
        self.block_size = kv.shape[3]

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint lacks {name}")
            return weights[name].to(self.device)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if config.tie_embeddings or "lm_head.weight" not in weights \
            else w("lm_head.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if config.qkv_bias else None
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
            self.layers.append((w(p + "input_layernorm.weight"), qkv_w, qkv_b, w(p + "self_attn.o_proj.weight"),
                                w(p + "post_attention_layernorm.weight"), gate_up, w(p + "mlp.down_proj.weight")))
        self.inv_freq = rope_inv_freq(config).to(self.device)
        # _decode_graph's, by kind ("batch", "single"), each made on its first step; False: the eager layers.
        self._traced = traced_decode
        self._graphs: dict[str, torch.jit.ScriptFunction | bool] = {}

    @property
    def decode_graphs(self) -> list[str]:
        """The kinds of decode step ("batch": several sequences, "single": one) that run as a traced graph."""
        return sorted(kind for kind, graph in self._graphs.items() if graph)

    def flops_per_token(self) -> int:
        """Matrix work of one new token through every layer (the LM head runs once per sequence)."""
        return 2 * sum(w.numel() for (_, qkv_w, _, o_w, _, gate_up, down) in self.layers
                       for w in (qkv_w, o_w, gate_up, down))

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """As transformers computes it: in float32, scaled by the weight after the cast back."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, self.config.rms_norm_eps).to(x.dtype)

    @torch.inference_mode()
    def forward(self, batch: Batch, kv: torch.Tensor | None = None) -> torch.Tensor:
        """`kv`: pages to write and read instead of the pool's (a recompute that must not touch shared pages).

        A decode step of a small model is mostly the cost of launching ops, so each layer launches
        few: Q and K are rotated together (a half-turn `roll` with a signed sine stands for
        rotate_half), and K and V go into the pool in one write. Each op still rounds where
        transformers' does, so a bfloat16 model's logits match its bit for bit. A decode step of
        several sequences, or of one, runs its layers as one traced graph (`_decode_graph`).
        """
        c = self.config
        pages = self.kv if kv is None else kv
        freqs = batch.positions.float()[:, None] * self.inv_freq[None, :]      # [T, dim / 2]
        cos = freqs.cos().repeat(1, 2).to(c.dtype)[:, None, :]
        sin = freqs.sin()
        signed_sin = torch.cat((-sin, sin), dim=-1).to(c.dtype)[:, None, :]
        layout = self._attention_layout(batch)
        args = (self.embed[batch.token_ids], cos, signed_sin, pages, batch.slot_blocks, batch.slot_offsets,
                batch.block_tables)
        traced = self._decode_graph(args, layout, batch) if self._traced else None
        if traced is not None:
            graph, extra = traced
            with torch.jit.optimized_execution(False):
                h = graph(*args, extra)
        else:
            h = self._layers(*args, layout)
        last = torch.tensor([sum(batch.query_lens[:i + 1]) - 1 for i in range(len(batch.query_lens))],
                            device=self.device)
        return F.linear(self._rms_norm(h[last], self.norm), self.lm_head).float()

    def _layers(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, pages: torch.Tensor,
                slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, block_tables: torch.Tensor,
                layout: _Layout) -> torch.Tensor:
        """Every layer, on the hidden states `h` of the new tokens; their K/V written into `pages`."""
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        half = c.head_dim // 2
        for layer, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up, down) in enumerate(self.layers):
            x = self._rms_norm(h, ln1)
            qkv = F.linear(x, qkv_w, qkv_b)
            qk = qkv[:, :q_size + kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
            turned = qk.roll(half, dims=-1)
            qk.copy_(qk * cos + turned * signed_sin)                     # RoPE, on Q and K at once
            cache = pages[:, layer]                                     # [blocks, 2, bs, kv_heads, dim]
            cache[slot_blocks, :, slot_offsets] = qkv[:, q_size:].view(-1, 2, c.num_kv_heads, c.head_dim)
            attn = self._attend(qkv[:, :q_size].view(-1, c.num_heads, c.head_dim), cache, block_tables, layout)
            h = h + F.linear(attn, o_w)
            x = self._rms_norm(h, ln2)
            gu = F.linear(x, gate_up)
            inter = gu.shape[-1] // 2
            h = h + F.linear(F.silu(gu[:, :inter]).mul_(gu[:, inter:]), down)
        return h

    def _decode_graph(self, args: tuple[torch.Tensor, ...], layout: _Layout,
                      batch: Batch) -> tuple[torch.jit.ScriptFunction, torch.Tensor] | None:
        """`_layers` for a decode step, traced once per kind into a TorchScript graph, and the tensor that stands
        for the layout in it (the key mask of several sequences; for one, a tensor as long as its keys); None:
        not a decode step, or tracing is not available (the eager layers serve).

        A traced graph runs its ops in C++ without taking the GIL between
        them. The eager layers take it back after every op, so on the forward
        thread they wait behind the event loop's Python work: with the loop
        busy 75% of the time, a 16-sequence decode step of the bench model
        took 32-36 ms eager and 11-13 ms traced (7.5-7.9 ms traced and
        8.7-10.6 eager with the loop quiet). The graph holds the same ops,
        so its results are the eager ones bit for bit; nothing in it depends
        on a shape (the keys of one sequence are cut to a tensor's length,
        which the trace keeps symbolic), so one graph serves every batch size
        and context length.
        """
        if layout.mask is not None and layout.gather is None:
            kind, extra = "batch", layout.mask
        elif layout.key_len is not None and not layout.causal and batch.query_lens == [1]:
            kind, extra = "single", torch.empty(layout.key_len, dtype=torch.uint8, device=self.device)
        else:
            return None
        if kind not in self._graphs:
            def decode_layers(*tensors: torch.Tensor) -> torch.Tensor:
                *inputs, stand_in = tensors
                return self._layers(*inputs, _Layout(stand_in, None, None, None) if kind == "batch"
                                    else _Layout(None, None, None, stand_in.shape[0]))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")     # torch.jit.trace's deprecation: no GIL-free successor yet
                    # Tracing runs the layers once, on this pass's inputs: it writes the K/V the graph then
                    # writes again, the same values into the same slots.
                    self._graphs[kind] = torch.jit.trace(decode_layers, (*args, extra), check_trace=False)
            except Exception:                           # any failure: the eager layers serve
                self._graphs[kind] = False
        graph = self._graphs[kind]
        return (graph, extra) if graph else None

    def _attention_layout(self, batch: Batch) -> _Layout:
        """How the flat new tokens become padded [B, max_q] queries, and which keys each may see.

        Two common cases skip the padding and the mask: a decode step (one new
        token per sequence) needs no query gather, and a single sequence sees
        exactly its own context, so its keys are cut to length instead of masked.
        """
        single, decode = len(batch.query_lens) == 1, max(batch.query_lens) == 1
        ctx = batch.context_lens[0] if single else None
        if single and (decode or batch.query_lens[0] == ctx):
            return _Layout(None, None, None, ctx, causal=not decode)
        if decode:
            mask = self._key_mask(batch)[:, None, None, :]
            return _Layout(mask, None, None, None)
        qlens = torch.tensor(batch.query_lens, device=self.device)
        clens = torch.tensor(batch.context_lens, device=self.device)
        max_q = int(qlens.max())
        max_ctx = batch.block_tables.shape[1] * self.block_size
        starts = torch.cumsum(qlens, 0) - qlens
        qi = torch.arange(max_q, device=self.device)
        gather = (starts[:, None] + qi[None, :]).clamp(max=int(qlens.sum()) - 1)        # [B, max_q]
        qpos = clens[:, None] - qlens[:, None] + qi[None, :]                            # absolute positions
        kpos = torch.arange(max_ctx, device=self.device)
        mask = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < clens[:, None, None])
        valid = qi[None, :] < qlens[:, None]
        mask &= valid[:, :, None] | (kpos[None, None, :] == 0)                           # padded rows: any key
        return _Layout(mask[:, None], gather, valid, None)

    def _key_mask(self, batch: Batch) -> torch.Tensor:
        """[B, max_ctx]: which padded key positions hold a sequence's context."""
        max_ctx = batch.block_tables.shape[1] * self.block_size
        clens = torch.tensor(batch.context_lens, device=self.device)
        return torch.arange(max_ctx, device=self.device)[None, :] < clens[:, None]

    def _attend(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                layout: _Layout) -> torch.Tensor:
        c = self.config
        bsz = block_tables.shape[0]
        # K and V gathered apart: each gather is [B, max_blocks, bs, kv_heads, dim], whose block and slot dims
        # merge into one without a copy; gathering both at once would need a second copy to separate them.
        blocks = block_tables.view(-1)
        keys = cache[:, 0].index_select(0, blocks).view(bsz, -1, c.num_kv_heads, c.head_dim).transpose(1, 2)
        values = cache[:, 1].index_select(0, blocks).view(bsz, -1, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if layout.key_len is not None:
            keys, values = keys[:, :, :layout.key_len], values[:, :, :layout.key_len]
        if layout.gather is None:                           # one sequence, or one new token per sequence
            queries = (q[None] if layout.key_len is not None else q[:, None]).transpose(1, 2)
        else:
            queries = q[layout.gather].transpose(1, 2)      # [B, heads, max_q, dim]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=layout.mask, is_causal=layout.causal,
                                             enable_gqa=True)
        out = out.transpose(1, 2).reshape(bsz, -1, c.num_heads * c.head_dim)   # [B, max_q, hidden]
        return out.reshape(-1, c.num_heads * c.head_dim) if layout.valid is None else out[layout.valid]
