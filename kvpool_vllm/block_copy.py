"""Whole vLLM blocks between vLLM's KV cache and memd's pages, in vLLM's own layout, checksummed.

vLLM keeps one KV tensor per attention layer, its blocks along one
dimension; what a block's bytes look like inside (K and V planes, heads,
the CPU attention's instruction-set-specific packing) is vLLM's business.
So a memd page holds one vLLM block of every layer, each layer's slice as
vLLM's tensor has it, one after another: saved and loaded by two indexed
copies per layer and never read as anything but bytes. Because the bytes
mean something only to an engine with the same layout, these pages live
under a model namespace of their own (`kvpool_vllm.namespace`) and never
mix with inferd's.

A saved page's checksum is taken from the page after the copy, by the
pool's own function (`shared.page_checksum`), so memd can check it where
it checks inferd's pages (swap, restart, scrub); a loaded page is checked
against the checksum memd holds for it before a byte of it reaches vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.page_checksum import page_checksums


class LayoutError(ValueError):
    """vLLM's KV cache cannot be copied to memd's pages as they are (a block larger than a page, mixed dtypes)."""


@dataclass(frozen=True, slots=True)
class _Layer:
    cache: torch.Tensor          # vLLM's tensor for this layer
    start: int                   # where its slice of a block begins in a page, in elements of the cache dtype
    size: int                    # elements of one block of this layer


class BlockCopier:
    """Copies blocks of `caches` (vLLM's per-layer KV tensors) to and from `pages` (memd's pool, uint8
    [num_pages, page_bytes]); `block_dim` says along which dimension each layer's tensor lays its blocks."""

    def __init__(self, caches: dict[str, torch.Tensor], block_dim: int, pages: torch.Tensor) -> None:
        if not caches:
            raise LayoutError("vLLM registered no KV cache tensors")
        dtypes = {cache.dtype for cache in caches.values()}
        if len(dtypes) != 1:
            raise LayoutError(f"KV cache layers of several dtypes ({sorted(map(str, dtypes))}): not supported")
        self.dtype = dtypes.pop()
        self.pages, self.block_dim = pages, block_dim
        elt = torch.empty((), dtype=self.dtype).element_size()
        if pages.shape[1] % elt:
            raise LayoutError(f"a page of {pages.shape[1]} bytes is not whole {self.dtype} elements")
        self._elements = pages.view(self.dtype)                # [num_pages, page_bytes // elt]
        layers, start = [], 0
        for cache in caches.values():
            size = cache.numel() // cache.shape[block_dim]
            layers.append(_Layer(cache, start, size))
            start += size
        self._layers = tuple(layers)
        self.block_bytes = start * elt
        if self.block_bytes > pages.shape[1]:
            raise LayoutError(f"one vLLM block of every layer is {self.block_bytes} bytes; memd's pages are "
                              f"{pages.shape[1]}: start memd with --block-bytes {self.block_bytes} or more")

    def save(self, blocks: list[int], pages: list[int]) -> list[int]:
        """vLLM's `blocks` into memd's `pages`, one to one; returns the pages' checksums."""
        if not blocks:
            return []
        src, dst, dim = self._index(blocks), self._index(pages), self.block_dim
        for layer in self._layers:
            rows = layer.cache.index_select(dim, src).movedim(dim, 0)
            self._elements[dst, layer.start:layer.start + layer.size] = rows.reshape(len(blocks), layer.size)
        return self.checksums(pages)

    def checksums(self, pages: list[int]) -> list[int]:
        """memd's pages' checksums, by the pool's own function (what memd checks them against)."""
        return page_checksums(self.pages, pages)

    def load(self, pages: list[int], blocks: list[int]) -> None:
        """memd's `pages` into vLLM's `blocks`, one to one (checked by the caller first)."""
        if not blocks:
            return
        src, dst, dim = self._index(pages), self._index(blocks), self.block_dim
        for layer in self._layers:
            rows = self._elements[src, layer.start:layer.start + layer.size]
            shape = list(layer.cache.shape)
            del shape[dim]
            layer.cache.index_copy_(dim, dst, rows.view(len(blocks), *shape).movedim(0, dim))

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.pages.device)
