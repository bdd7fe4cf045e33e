"""Decode attention the plain way, to hold inferd's paged reads to: a row's pages copied out, then torch's SDPA."""

from __future__ import annotations

import torch


def attention_over_a_copy(q_row: torch.Tensor, pages: torch.Tensor, layer: int, table: torch.Tensor,
                          length: int | torch.Tensor) -> torch.Tensor:
    """[heads * head_dim]: one decode row's query `q_row` [heads, head_dim] over the first `length` keys of
    its pages `table` in `pages` [blocks, layers, 2, block_size, kv_heads, head_dim]."""
    kv_heads, dim = pages.shape[-2:]
    keys = pages[table, layer, 0].reshape(-1, kv_heads, dim)[:length].transpose(0, 1)[None]
    values = pages[table, layer, 1].reshape(-1, kv_heads, dim)[:length].transpose(0, 1)[None]
    out = torch.nn.functional.scaled_dot_product_attention(q_row[None, :, None], keys, values, enable_gqa=True)
    return out.reshape(-1)
