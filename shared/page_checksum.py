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

import ctypes
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    import torch

UNKNOWN = 0
YIELD_EVERY = 32                               # pages hashed between two lets-go of the GIL, without _XXH3
_WEIGHTS: dict[tuple[str, int], Any] = {}      # (device, words per page) -> int64 weights
_CHUNK_BYTES = 16 << 20                        # pages summed per kernel launch (twice this on the GPU)


def _native_xxh3() -> Callable[[int, int], int] | None:
    """XXH3_64bits from the xxhash package's own extension, called through ctypes, which lets the GIL go.

    Its Python functions keep the GIL for inputs up to 64 KiB, the default
    page: a thread hashing pages with them makes every other thread (memd's
    event loop) wait out the interpreter's switch interval (5 ms by default). None where
    the extension does not export the symbol, or it disagrees with xxhash.
    """
    try:
        import xxhash._xxhash as extension

        fn = ctypes.CDLL(extension.__file__).XXH3_64bits
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_uint64, (ctypes.c_void_p, ctypes.c_size_t)
    probe = ctypes.create_string_buffer(b"kvpool page checksum probe" * 100)
    if fn(ctypes.addressof(probe), len(probe)) != xxhash.xxh3_64_intdigest(probe.raw):
        return None
    return fn


_XXH3 = _native_xxh3()


def xxh3_at(address: int, size: int) -> int:
    """XXH3-64 of `size` bytes at `address` (a shared-memory pool's page), never 0."""
    if _XXH3 is not None:
        return _XXH3(address, size) or 1
    return xxhash.xxh3_64_intdigest((ctypes.c_char * size).from_address(address)) or 1


def checksums_at(base: int, page_bytes: int, pages: list[int]) -> list[int]:
    """XXH3-64 of pages of a mapping at `base` (a pool, a swap tier), never 0; other threads run meanwhile."""
    out = []
    for i, page in enumerate(pages):
        out.append(xxh3_at(base + page * page_bytes, page_bytes))
        if _XXH3 is None and i % YIELD_EVERY == YIELD_EVERY - 1:
            time.sleep(0)           # the fallback keeps the GIL: let the event loop have it now and then
    return out


def page_checksums(pages: torch.Tensor, blocks: list[int]) -> list[int]:
    """Checksums of pages `blocks` of `pages` (uint8 [num_blocks, block_bytes]), by the pool's kind."""
    if not blocks:
        return []
    if pages.is_cuda:
        return word_sums(pages, blocks)
    assert pages.is_contiguous()
    return checksums_at(pages.data_ptr(), pages.shape[1], blocks)


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
