"""The checksum of a page of K/V: what a worker sends when it commits a page, and what memd checks it against.

Both sides must compute the same number from the same bytes, so the function
depends only on the kind of pool, never on who computes it:

- a shared-memory pool (CPU): XXH3-64 of the page's bytes, ~17 GiB/s on one
  core (zlib's CRC-32 managed 3.8 on the same pages);
- a CUDA pool: a weighted sum of the page's 64-bit words, modulo 2**64, with a
  fixed odd weight per word position. It is one multiply and one reduction
  on the device, so no page is copied to the host, and any change of one word
  changes the sum (an odd weight has an inverse modulo 2**64). The same sum
  is computed on the host for pages held there (the swap tier of a CUDA pool).

0 means "unknown": a page whose checksum comes out 0 gets 1.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    import torch

UNKNOWN = 0
YIELD_EVERY = 32                               # pages hashed between two lets-go of the GIL
_WEIGHTS: dict[tuple[str, int], Any] = {}      # (device, words per page) -> int64 weights
_CHUNK_BYTES = 64 << 20                        # pages summed per kernel launch, in bytes


def buffer_checksums(buffer: Any, page_bytes: int, pages: list[int]) -> list[int]:
    """XXH3-64 of pages of a buffer (a pool's or swap tier's mapping, an array over one), never 0.

    xxhash keeps the GIL for a page this small, and a thread that keeps it
    makes every other thread (memd's event loop) wait out the interpreter's
    5 ms switch interval: every 32 pages (~150 us) the GIL is let go.
    """
    out = []
    with memoryview(buffer) as view, view.cast("B") as data:
        for i, page in enumerate(pages):
            out.append(xxhash.xxh3_64_intdigest(data[page * page_bytes:(page + 1) * page_bytes]) or 1)
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                time.sleep(0)
    return out


def page_checksums(pages: torch.Tensor, blocks: list[int]) -> list[int]:
    """Checksums of pages `blocks` of `pages` (uint8 [num_blocks, block_bytes]), by the pool's kind."""
    if not blocks:
        return []
    if pages.is_cuda:
        return word_sums(pages, blocks)
    return buffer_checksums(pages.numpy(), pages.shape[1], blocks)


def word_sums(pages: torch.Tensor, blocks: list[int]) -> list[int]:
    """The weighted word sum of each page in `blocks` (see the module docstring), computed where `pages` is."""
    import torch

    words = pages.shape[1] // 8
    weights = _weights(pages.device, words)
    rows = max(1, _CHUNK_BYTES // max(pages.shape[1], 1))
    out: list[int] = []
    for start in range(0, len(blocks), rows):
        index = torch.tensor(blocks[start:start + rows], device=pages.device)
        chunk = pages.index_select(0, index).view(torch.int64)
        out += (chunk * weights).sum(dim=1).tolist()
    return [(s & 0xFFFF_FFFF_FFFF_FFFF) or 1 for s in out]


def _weights(device: torch.device, words: int) -> torch.Tensor:
    """An odd, well-mixed int64 weight per word position (splitmix64 of the position), cached per device."""
    key = (str(device), words)
    cached = _WEIGHTS.get(key)
    if cached is None:
        import numpy as np
        import torch

        with np.errstate(over="ignore"):
            z = np.arange(1, words + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = (z ^ (z >> np.uint64(31))) | np.uint64(1)
        cached = torch.from_numpy(z.view(np.int64)).to(device)
        _WEIGHTS[key] = cached
    return cached
