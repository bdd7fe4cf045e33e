"""A CPU pool as several shared-memory files, mapped side by side as one range.

A tmpfs allocates a file's 4 KiB pages one at a time under that file's lock
(two million of them for an 8 GiB pool), so more threads cannot
allocate one file faster; several files they can, each on a core of its own.
A pool over `STRIPE_BYTES` is therefore cut into stripes, at most
`MAX_STRIPES` (one message of SCM_RIGHTS carries them all), and memd and
every worker map the stripes back to back: the pool stays one contiguous
range of memory, block i at `i * block_bytes` whatever file it falls in.
How a pool is cut depends on its size alone, so a restarted memd finds its
files where it left them. Nothing here imports torch: memd uses it too.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

STRIPE_BYTES = 256 << 20
MAX_STRIPES = 32
ALIGN = 2 << 20              # the pool starts on a huge-page boundary, and so does every stripe

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_FIXED = 0x10


def stripe_sizes(size: int) -> list[int]:
    """The sizes of the files a pool of `size` bytes is kept in (one file up to `STRIPE_BYTES`)."""
    if size <= STRIPE_BYTES:
        return [size]
    count = min(MAX_STRIPES, -(-size // STRIPE_BYTES))
    stripe = -(-size // count // ALIGN) * ALIGN
    sizes = [stripe] * (size // stripe)
    if size % stripe:
        sizes.append(size % stripe)
    return sizes


def stripe_paths(path: Path, count: int) -> list[Path]:
    """Where a pool kept in `count` files at `path` has them: `path`, then `path.1`, `path.2` ..."""
    return [path] + [path.with_name(f"{path.name}.{i}") for i in range(1, count)]


def map_stripes(fds: list[int], sizes: list[int]) -> tuple[mmap.mmap, int]:
    """One shared, writable mapping of the files `fds` (of `sizes` bytes), one after another: the mmap
    object and the offset in it where the pool starts.

    The range is reserved as a shared mapping of an empty memfd (shared file
    mappings are not charged against the commit limit, an anonymous one of
    gigabytes would be), `ALIGN` bytes larger than the pool so that the pool
    can start on a huge-page boundary, and each file is mapped over its part
    with MAP_FIXED. Closing the mmap object unmaps all of them, and it refuses
    to close while a view of it lives.
    """
    total = sum(sizes)
    if len(fds) == 1:            # the kernel aligns a file's mapping for its huge pages itself
        return mmap.mmap(fds[0], total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), 0
    room = os.memfd_create("kvpool-pool-range", os.MFD_CLOEXEC)
    try:
        os.ftruncate(room, total + ALIGN)          # never touched: it holds no memory
        whole = mmap.mmap(room, total + ALIGN, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(room)
    anchor = ctypes.c_char.from_buffer(whole)
    try:
        start = ctypes.addressof(anchor)
        base = -(-start // ALIGN) * ALIGN
        offset = base
        for fd, size in zip(fds, sizes, strict=True):
            got = _libc.mmap(offset, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
            if got != offset:
                error = ctypes.get_errno()
                raise OSError(error, f"cannot map a pool file: {os.strerror(error)}")
            offset += size
    except BaseException:
        del anchor
        whole.close()
        raise
    del anchor
    return whole, base - start
