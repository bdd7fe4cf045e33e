"""The swap tier: host memory holding the pages of SWAPPED sequences.

Allocated once at start-up (`--swap-ratio` x the pool), like the pool itself:
once populated, a swap-out never allocates, so it meets no allocation stall or
failure when memory is short. On the shm backend it is an anonymous mapping
(or a file in the state directory), populated and `mlock`ed on a thread of its
own while memd starts and serves (a fraction of a second per GiB; start-up
used to wait for it), so the kernel cannot page the swap tier out in turn when
other processes need host memory; on CUDA it is pinned host memory, copied by
DMA on a stream of its own.

Copies come as (source, destination) index pairs; runs of consecutive pairs
go as one copy, and a large copy is split over a few threads (memmove
releases the GIL), as torch's own `copy_` does: one thread of memmove on
scattered pages reaches only about 60% of the bandwidth.

`SWAP_LATENCY_TEST=seconds` delays each copy, so tests and benchmarks can see
what slow swapping does to everyone else (tail latency under a swap storm).
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import structlog

from memd.background import give_way
from memd.memory import (
    Allocation,
    PoolMemoryError,
    ShmMemory,
    kept_file,
    open_backing_file,
    require_host_memory,
)
from shared.page_checksum import checksums_at, xxh3_at
from shared.sizes import format_size

log = structlog.get_logger("memd.swap")

# A large copy is split over as many threads as memd may use cores, up to 4, as a plain torch copy_ is
# (the bandwidth figure's anchor). Half the cores would leave a 2-core host one thread, short of copy_'s
# bandwidth: one core does not saturate memory. The copy is memory-bound and short; it holds the GIL
# only between spans, and the event loop's thread, woken by a Step, still gets a core from the kernel.
COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))
# glibc's memmove uses non-temporal stores only above about 3/4 of the L3 cache: scattered
# pages of 1-8 MiB are then copied through the cache, slower than a plain copy_, and faster
# than it with this setting. It must be in the environment when memd starts
# (systemd/memd.service sets it); memd says at start-up whether it is.
NON_TEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x100000"
PARALLEL_BYTES = 4 << 20         # smaller copies are not worth a hand-off to the threads
# A swap-out that can be called off checks between chunks of this size: a reset waits for at most one
# (a few ms), and each chunk is still large enough to keep every copy thread busy.
HALT_CHUNK_BYTES = 64 << 20
LOCK_CHUNK_BYTES = 16 << 20      # the swap tier is locked (populated) this much at a time, after READY
SWAP_ADVICE = " (lower --swap-ratio or use --disable-swap)"


class SwapMemory(Protocol):
    num_slots: int
    delay_s: float

    def copy_out(self, pairs: list[tuple[int, int]], halt: threading.Event | None = None) -> bool: ...
    # (block, slot) pairs; False: `halt` was set before the copy was done (the slots hold a part of it)
    def copy_out_checked(self, pairs: list[tuple[int, int]], halt: threading.Event | None = None) \
        -> list[int] | None: ...          # and the pages' checksums, as the pool's; None: halted (as copy_out)
    def copy_in(self, pairs: list[tuple[int, int]]) -> None: ...     # (slot, block)
    def copy_in_checked(self, pairs: list[tuple[int, int]]) -> list[int]: ...   # and the pages' checksums after
    def checksums(self, slots: list[int]) -> list[int]: ...          # of the slots' bytes now, as the pool's
    def allocated(self) -> None: ...      # every slot allocated; raises PoolMemoryError if it could not be
    def close(self) -> None: ...


def latency_test_delay() -> float:
    raw = os.environ.get("SWAP_LATENCY_TEST", "")
    try:
        delay = float(raw) if raw else 0.0
    except ValueError:
        raise PoolMemoryError(f"SWAP_LATENCY_TEST={raw!r} is not a number of seconds") from None
    if delay < 0:
        raise PoolMemoryError(f"SWAP_LATENCY_TEST={raw!r} is negative")
    return delay


def latency_test_wait(delay_s: float, halt: threading.Event | None = None) -> bool:
    """Sleep `SWAP_LATENCY_TEST`'s delay before a copy; True if `halt` was set meanwhile (the copy is off)."""
    if halt is not None:
        return halt.wait(delay_s) if delay_s else halt.is_set()
    if delay_s:
        time.sleep(delay_s)
    return False


def spans(index: Any) -> list[tuple[int, int, int]]:
    """(source, destination, count) for each run of `index`'s (source, destination) rows consecutive on both
    sides: one copy each. Vectorized: a swap of thousands of pages plans its copies in a few numpy calls."""
    np = _numpy()
    if not len(index):
        return []
    s, d = index[:, 0], index[:, 1]
    starts = np.flatnonzero(np.concatenate(([True], (np.diff(s) != 1) | (np.diff(d) != 1))))
    counts = np.diff(np.append(starts, len(index)))
    return list(zip(s[starts].tolist(), d[starts].tolist(), counts.tolist(), strict=True))


def pair_index(pairs: list[tuple[int, int]]) -> Any:
    """(source, destination) pairs as an [n, 2] numpy array."""
    np = _numpy()
    # fromiter, given the dtype and count, fills one buffer; np.array inspects each tuple (the GIL held either way)
    return np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.intp, count=2 * len(pairs)).reshape(-1, 2)


def check_bounds(index: Any, sources: int, destinations: int) -> None:
    """Refuse a copy naming a page or slot past the end: a gather would clamp it, a slice would drop it."""
    for side, rows in ((index[:, 0], sources), (index[:, 1], destinations)):
        if len(side) and (side.min() < 0 or side.max() >= rows):
            bad = int(side.min()) if side.min() < 0 else int(side.max())
            raise IndexError(f"a swap copy names page or slot {bad} of {rows}")


class HostSwap:
    """Host memory, populated and locked at start-up; memmove copies (the GIL is released).

    Anonymous, or a file in memd's state directory (`path`) whose slots a restarted memd reopens (`reopened`).
    """

    def __init__(self, pool: ShmMemory, num_slots: int, block_bytes: int, delay_s: float = 0.0,
                 path: Path | None = None) -> None:
        size = num_slots * block_bytes
        self.reopened = kept_file(path, size)
        if not self.reopened:
            require_host_memory("swap tier", size, SWAP_ADVICE)
        self.num_slots, self.block_bytes, self.delay_s = num_slots, block_bytes, delay_s
        fd = None
        if path is None:
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            fd = open_backing_file(path, size, "kvpool-swap", "swap tier")
            try:
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            except BaseException:
                os.close(fd)
                raise
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self._base = ctypes.addressof(self._anchor)
        self._pool_base, self._pool_size = pool.base, pool.size
        self._row_views: tuple[Any, Any] | None = None
        # Allocated, populated and locked on a thread of its own, a chunk at a time, while memd starts and
        # serves: gigabytes of page faults held start-up for seconds. A swap file's pages are allocated first,
        # once the pool's are (READY=1 waits for the pool's alone, which the swap file's would slow down);
        # a copy waits for them (`allocated`). A slot not locked yet faults in on its first copy; nothing
        # waits for that. `locked`: None while it runs.
        self.locked: bool | None = None
        self._stop = threading.Event()
        self._pool_allocation = pool.allocation
        self._allocating = Allocation([(fd, size)], "swap tier", background=True, after=pool.allocation) \
            if fd is not None else None
        self._locking = threading.Thread(target=self._populate_and_lock, args=(size, fd), name="memd-swap-lock",
                                         daemon=True)
        self._locking.start()
        self._threads = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="memd-swap-copy", initializer=give_way) \
            if COPY_THREADS > 1 else None

    def allocated(self) -> None:
        """Wait until a swap file's pages are allocated; PoolMemoryError if the host had not the memory."""
        if self._allocating is not None:
            self._allocating.wait()

    def populated(self) -> bool | None:
        """Wait until the tier is populated; whether it is locked in RAM (a bench measures it settled)."""
        self._locking.join()
        return self.locked

    def _populate_and_lock(self, size: int, fd: int | None) -> None:
        """Once a swap file's pages are allocated (then its `fd` is closed), mlock each chunk (which populates
        it); where locking is refused, populate the rest unlocked."""
        self._pool_allocation.wait(check=False)    # the pool first: READY=1 waits for it, not for this
        if self._allocating is not None:
            assert fd is not None
            try:
                self._allocating.wait()
            except PoolMemoryError:                 # the copies raise it (`allocated`): swap-outs fail, sessions stay
                self.locked = False
                return
            finally:
                os.close(fd)
        _numpy()                          # imported here, off the event loop, before the first copy needs it
        started, lock = time.monotonic(), True
        for offset in range(0, size, LOCK_CHUNK_BYTES):
            if self._stop.is_set():
                return
            chunk = min(LOCK_CHUNK_BYTES, size - offset)
            if lock and not _mlock(self._base + offset, chunk, total=size):
                lock = False
                _munlock(self._base, offset)           # all or nothing: no share of the limit held for a part
            if not lock and not _populate(self._base + offset, chunk):
                break                                  # an old kernel: the rest faults in on first use
        self.locked = lock
        if lock and size:
            log.info("swap tier populated and locked in RAM", swap=format_size(size),
                     seconds=round(time.monotonic() - started, 2))

    def copy_out(self, pairs: list[tuple[int, int]], halt: threading.Event | None = None) -> bool:
        return self._copy(pairs, out=True, halt=halt)

    def copy_in(self, pairs: list[tuple[int, int]]) -> None:
        self._copy(pairs, out=False)

    def copy_out_checked(self, pairs: list[tuple[int, int]], halt: threading.Event | None = None) \
            -> list[int] | None:
        """Copy out and return each page's checksum, hashed right after its copy while it is still in cache.

        What memd's swap-out needs (the swap-in checks the page it brings back
        against it). A copy and then a hash of every page read the pool twice.
        None: `halt` was set before the copy was done (checked between chunks).
        """
        self.allocated()
        if latency_test_wait(self.delay_s, halt):
            return None
        chunk = max(1, HALT_CHUNK_BYTES // self.block_bytes) if halt is not None else max(1, len(pairs))
        sums: list[int] = []
        for start in range(0, len(pairs), chunk):
            if halt is not None and halt.is_set():
                return None
            sums += self._checked(pairs[start:start + chunk], out=True)
        return sums

    def copy_in_checked(self, pairs: list[tuple[int, int]]) -> list[int]:
        """Copy in and return each page's checksum, taken right after its copy while it is still in cache.

        Hashing the pages after the whole copy reads them from memory a
        second time; hashed page by page, each is read while its copy has
        just left it in cache.
        """
        self.allocated()
        latency_test_wait(self.delay_s)
        return self._checked(pairs, out=False)

    def _checked(self, pairs: list[tuple[int, int]], out: bool) -> list[int]:
        """Page by page, copy and hash; shared among the copy threads where the copy is large enough."""
        if not pairs:
            return []
        pool_rows, slot_rows = self._rows()
        check_bounds(pair_index(pairs), *((len(pool_rows), len(slot_rows)) if out else
                                          (len(slot_rows), len(pool_rows))))
        if self._threads is None or len(pairs) * self.block_bytes < PARALLEL_BYTES:
            return self._copy_checked(pairs, out)
        share = -(-len(pairs) // COPY_THREADS)
        parts = [pairs[i:i + share] for i in range(0, len(pairs), share)]
        return [c for part in self._threads.map(lambda part: self._copy_checked(part, out), parts) for c in part]

    def _copy_checked(self, pairs: list[tuple[int, int]], out: bool) -> list[int]:
        """The pool's page is hashed either way: going out, the copy has just read it (in cache, where a
        non-temporal store left the slot's copy in memory only); coming in, it is what the check is about."""
        size, swap_base, pool_base = self.block_bytes, self._base, self._pool_base
        result = []
        for a, b in pairs:
            if out:
                page = pool_base + a * size
                ctypes.memmove(swap_base + b * size, page, size)
            else:
                page = pool_base + b * size
                ctypes.memmove(page, swap_base + a * size, size)
            result.append(xxh3_at(page, size))
        return result

    def _copy(self, pairs: list[tuple[int, int]], out: bool, halt: threading.Event | None = None) -> bool:
        """False if `halt` was set before the copy was done (checked between chunks, and during the test delay)."""
        self.allocated()
        if latency_test_wait(self.delay_s, halt):
            return False
        if not pairs:
            return True
        pool_rows, slot_rows = self._rows()
        src, dst = (pool_rows, slot_rows) if out else (slot_rows, pool_rows)
        index = pair_index(pairs)
        check_bounds(index, len(src), len(dst))               # take(mode="clip") would clamp, not refuse
        chunk = max(1, HALT_CHUNK_BYTES // self.block_bytes) if halt is not None else len(index)
        for start in range(0, len(index), chunk):
            if halt is not None and halt.is_set():
                return False
            self._copy_rows(src, dst, index[start:start + chunk])
        return True

    def _copy_rows(self, src: Any, dst: Any, index: Any) -> None:
        if self._threads is None or len(index) * self.block_bytes < PARALLEL_BYTES:
            copy_pages(src, dst, index)
        else:
            shares = [share for share in _numpy().array_split(index, COPY_THREADS) if len(share)]
            list(self._threads.map(lambda share: copy_pages(src, dst, share), shares))

    def _rows(self) -> tuple[Any, Any]:
        """The pool and the swap tier as numpy arrays of rows (pages, slots), made on the first copy."""
        if self._row_views is None:
            self._row_views = (_rows_at(self._pool_base, self._pool_size // self.block_bytes, self.block_bytes),
                               _rows_at(self._base, self.num_slots, self.block_bytes))
        return self._row_views

    def view(self) -> memoryview:
        """The raw bytes, for tests and benchmarks."""
        return memoryview(self._map)

    def checksums(self, slots: list[int]) -> list[int]:
        """Of the bytes in these slots now, by the pool's checksum (a scrub checks them against the swap-out's)."""
        return checksums_at(self._base, self.block_bytes, slots)

    def close(self) -> None:
        self._stop.set()
        if self._allocating is not None:
            self._allocating.cancel()
        self._locking.join()                           # it must not touch the mapping once it is gone
        if self._threads is not None:
            self._threads.shutdown(wait=True)
        self._row_views = None
        del self._anchor
        self._map.close()


def _numpy() -> Any:
    """numpy, imported on first use: memd's start-up does not wait for its import, only a swap copy needs it."""
    import numpy

    return numpy


def _rows_at(base: int, count: int, block_bytes: int) -> Any:
    """`count` rows of `block_bytes` at `base` as a numpy array; the mapping must outlive it (it holds no export)."""
    np = _numpy()
    return np.frombuffer((ctypes.c_char * (count * block_bytes)).from_address(base), dtype=np.uint8) \
        .reshape(count, block_bytes)


def copy_pages(src: Any, dst: Any, index: Any) -> None:
    """Copy rows src[i] to dst[j] for each (i, j) row of `index`, in as few calls as the pairs allow.

    Each call copies many pages in C with the GIL released: a run consecutive
    on both sides is one memmove; a run consecutive on one side only is one
    numpy gather (`take` into consecutive destination rows) or scatter (from
    consecutive source rows). A memmove per page would cost each page a
    Python call and two GIL hand-overs, which the copy threads take in turn;
    one numpy call per run pays them once.
    """
    np = _numpy()
    s, d = index[:, 0], index[:, 1]
    s_breaks = np.flatnonzero(np.diff(s) != 1) + 1
    d_breaks = np.flatnonzero(np.diff(d) != 1) + 1
    gather = len(d_breaks) <= len(s_breaks)              # cut where the side with fewer runs breaks
    cuts, other = (d_breaks, s_breaks) if gather else (s_breaks, d_breaks)
    bounds = [0, *cuts.tolist(), len(index)]
    for a, b in itertools.pairwise(bounds):
        s0, d0, n = int(s[a]), int(d[a]), b - a
        if np.searchsorted(other, a, "right") == np.searchsorted(other, b, "left"):   # consecutive on both
            ctypes.memmove(dst[d0:d0 + n].ctypes.data, src[s0:s0 + n].ctypes.data, n * src.shape[1])
        elif gather:
            np.take(src, s[a:b], axis=0, out=dst[d0:d0 + n], mode="clip")    # "raise" would copy through a buffer
        else:
            dst[d[a:b]] = src[s0:s0 + n]


MADV_POPULATE_WRITE = 23      # Linux 5.14: fault pages in writable without writing them


def _populate(address: int, size: int) -> bool:
    """Fault a range in (no data changes); False where the kernel does not know how."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), MADV_POPULATE_WRITE) == 0


def _munlock(address: int, size: int) -> None:
    if size:
        ctypes.CDLL(None, use_errno=True).munlock(ctypes.c_void_p(address), ctypes.c_size_t(size))


def _mlock(address: int, size: int, total: int | None = None) -> bool:
    """Lock (and so populate) part of the swap tier in RAM; where the limit forbids it, warn and go on unlocked."""
    if not size:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) == 0:
        return True
    err = ctypes.get_errno()
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else format_size(soft)
    log.warning(f"swap tier not locked in RAM ({os.strerror(err)}; RLIMIT_MEMLOCK is {limit}): the kernel may "
                "page it out under host memory pressure; raise LimitMEMLOCK= for memd", swap=format_size(total or size))
    return False

