"""How inferd's C heap treats the tensors a forward pass frees: kept for the next pass, not given back.

torch takes a CPU tensor's memory from malloc. A decode pass allocates and
frees the same few megabytes every step (each layer's gathered K/V, attention
and MLP outputs), and glibc's defaults give them back to the kernel: a chunk
over the mmap threshold (128 KiB at first) is unmapped on free, and a heap top
over the trim threshold is trimmed. The next pass then faults the pages in
again, and the kernel zeroes each one; as contexts grow, each pass's tensors
are a little larger than any freed before, which glibc maps afresh. On a small
model that kernel time is a large share of each pass. Through `inferd serve`
the forward thread has a malloc arena of its own, which gives back less, yet
still faults more the longer the prompts. `keep_freed_memory` raises both
thresholds, as a glibc user would with GLIBC_TUNABLES or a serving stack by
preloading tcmalloc or jemalloc, but from inside the process, so `inferd
serve` gets it however it is started.

What it costs: freed memory up to `TRIM_THRESHOLD` stays in the heap, at most
what one pass needs at its peak, and is used again by the next. Allocations
over `MMAP_THRESHOLD` (glibc's most, 32 MiB) are still mapped and unmapped
each time: a long context's gathered K/V on a large model still faults.
"""

from __future__ import annotations

import ctypes
import os

import structlog

log = structlog.get_logger("inferd.heap")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20                       # glibc's ceiling for it on 64-bit hosts
TRIM_THRESHOLD = 256 << 20


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; whether they were set.

    Left alone where the user chose malloc's settings themselves (a `glibc.malloc`
    tunable in GLIBC_TUNABLES), and where the C library is not glibc."""
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        log.info("heap thresholds left as GLIBC_TUNABLES sets them")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        log.info("heap thresholds left alone: the C library has no mallopt")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Setting either turns off glibc's sliding mmap threshold, so both are set together.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
