"""The pool's memory: one allocation at start-up, shared with workers, never grown.

Two backends behind one small interface. `shm` is memfds (or state files)
allocated at start-up and handed to workers as file descriptors (memd/fdpass.py);
`cuda` is one device tensor whose CUDA IPC handle workers open. memd itself
touches page contents only to zero a page before it is handed out again and
to copy a partly written page on fork.
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import os
import threading
from pathlib import Path
from typing import Any, Protocol

from memd.page_effects import Copy, Zero
from shared.page_checksum import checksums_at, word_sums
from shared.pool_files import map_stripes, stripe_paths, stripe_sizes
from shared.sizes import format_size


class PoolMemoryError(RuntimeError):
    """The pool cannot be allocated as asked: memd refuses to start."""


class PoolMemory(Protocol):
    backend: str
    device: str

    def export(self) -> dict[str, Any]: ...
    def apply(self, effects: list[Zero | Copy]) -> None: ...
    def checksums(self, pages: list[int]) -> list[int]: ...
    def allocated(self) -> None: ...          # every page allocated; raises PoolMemoryError if it could not be
    def close(self) -> None: ...


def resolve_device(device: str) -> str:
    """"auto" is "cuda" when a GPU is usable, else "cpu"."""
    if device == "auto":
        return "cuda" if _gpu_present() else "cpu"
    return device


def allocate_pool(device: str, num_blocks: int, block_bytes: int, path: Path | None = None,
                  background: bool = False) -> PoolMemory:
    """`device` is "auto", "cpu" or "cuda[:N]"; `path`: a pool file to reopen or create (shm only).

    `background`: a shm pool's pages are allocated on a thread; `allocated()` waits for them (CUDA: at once).
    """
    device = resolve_device(device)
    if device == "cpu":
        return ShmMemory(num_blocks, block_bytes, path, background=background)
    if device.startswith("cuda"):
        return CudaMemory(device, num_blocks, block_bytes)
    raise PoolMemoryError(f"unknown device {device!r}: use auto, cpu or cuda:N")


def _gpu_present() -> bool:
    # torch takes seconds to import; a machine without NVIDIA device nodes needs no asking.
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    import torch
    return torch.cuda.is_available()


def available_host_memory() -> int | None:
    """Bytes this process may still take: MemAvailable, capped by a cgroup v2 limit."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room = int(limit) - used
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def require_host_memory(what: str, size: int, advice: str = "") -> None:
    """Refuse, in one line, an allocation the host cannot hold, before trying it."""
    available = available_host_memory()
    if available is not None and size > available:
        raise PoolMemoryError(f"{what} of {format_size(size)} does not fit: {format_size(available)} of host "
                              f"memory available{advice}")


def kept_file(path: Path | None, size: int) -> bool:
    """A backing file of exactly `size` bytes is there: reopened with its pages, not made again."""
    return path is not None and path.exists() and path.stat().st_size == size


def pool_kept(path: Path, num_blocks: int, block_bytes: int) -> bool:
    """Every file of a pool kept at `path` (shared.pool_files) is there, of its size: the pool is reopened."""
    sizes = stripe_sizes(num_blocks * block_bytes)
    return all(kept_file(p, n) for p, n in zip(stripe_paths(path, len(sizes)), sizes, strict=True))


class ShmMemory:
    """Shared memory for the pool: memfds, or files in memd's state directory that outlive memd.

    A memfd is anonymous and sealed to its size, freed when the last mapping
    and fd go. The files (`path`, on tmpfs) are what lets parked sessions
    survive a memd crash (memd.state_dir); existing ones of the right sizes are
    reopened with their pages as they were (`reopened`). A pool over 256 MiB
    is kept in several files (`shared.pool_files`), allocated side by side and
    mapped as one range. memd needs no tensor library: zeroing and copying
    pages are memset and memmove on the mapping (ctypes releases the GIL for both).
    """

    backend = "shm"
    device = "cpu"

    def __init__(self, num_blocks: int, block_bytes: int, path: Path | None = None, *,
                 background: bool = False) -> None:
        size = num_blocks * block_bytes
        self.size, self.block_bytes = size, block_bytes
        self.stripes = stripe_sizes(size)
        paths = stripe_paths(path, len(self.stripes)) if path is not None else [None] * len(self.stripes)
        self.reopened = path is not None and pool_kept(path, num_blocks, block_bytes)
        if not self.reopened:
            require_host_memory("pool", size)
        self.fds: list[int] = []
        try:
            for stripe_path, stripe in zip(paths, self.stripes, strict=True):
                self.fds.append(open_backing_file(stripe_path, stripe, "kvpool-pool", "pool"))
                if path is None:
                    # Sealed: no process can shrink the memfd under another's mapping.
                    fcntl.fcntl(self.fds[-1], fcntl.F_ADD_SEALS,
                                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.allocation = Allocation(list(zip(self.fds, self.stripes, strict=True)), "pool", background)
        except BaseException:
            for fd in self.fds:
                os.close(fd)
            raise
        try:
            self._map, self._offset = map_stripes(self.fds, self.stripes)
        except OSError as exc:
            self.close_files()
            raise PoolMemoryError(f"cannot map the pool: {exc.strerror}") from None
        self._anchor = ctypes.c_char.from_buffer(self._map, self._offset)
        self._base = ctypes.addressof(self._anchor)

    def allocated(self) -> None:
        """Wait until every page is allocated (`background`); PoolMemoryError if the host had not the memory."""
        self.allocation.wait()

    @property
    def base(self) -> int:
        """Address of the mapping in this process (for the swap tier's copies)."""
        return self._base

    def view(self) -> memoryview:
        """The raw bytes, for tests and benchmarks."""
        return memoryview(self._map)[self._offset:self._offset + self.size]

    def export(self) -> dict[str, Any]:
        return {"backend": "shm", "size": self.size, "stripes": self.stripes}

    def checksums(self, pages: list[int]) -> list[int]:
        """Of these pages as they are now (shared.page_checksum); off the event loop for many pages."""
        return checksums_at(self._base, self.block_bytes, pages)

    def apply(self, effects: list[Zero | Copy]) -> None:
        base, size = self._base, self.block_bytes
        for effect in effects:
            if isinstance(effect, Zero):
                ctypes.memset(base + effect.page * size, 0, size)
            else:
                ctypes.memmove(base + effect.page * size, base + effect.src * size, size)

    def close(self) -> None:
        del self._anchor
        try:
            self._map.close()
        finally:
            self.close_files()

    def close_files(self) -> None:
        self.allocation.cancel()
        self.allocation.wait(check=False)            # it must not fallocate an fd closed (or reused) under it
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def open_backing_file(path: Path | None, size: int, name: str, what: str) -> int:
    """An fd of `size` bytes, its pages not allocated yet (`Allocation`): a memfd, or `path` reopened or created."""
    if path is None:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    else:
        try:
            if path.exists() and not kept_file(path, size):
                path.unlink()
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise PoolMemoryError(f"cannot open the {what} file {path}: {exc.strerror}") from None
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
    except OSError as exc:
        os.close(fd)
        raise PoolMemoryError(f"cannot size the {what} file to {format_size(size)}: {exc.strerror}") from None
    return fd


ALLOCATE_CHUNK_BYTES = 256 << 20       # between two, an allocation that is no longer wanted stops


def allocate_pages(fd: int, size: int, what: str, whole: int | None = None,
                   stop: threading.Event | None = None) -> bool:
    """Allocate every page of the file now, so a short machine fails at start-up, not under load; False if
    `stop` was set first (memd is stopping).

    A file the memd before this one allocated whole (a restart with a state
    directory) is left alone: tmpfs walks every page already there again, and
    an 8 GiB pool's took 15 s here, for nothing, while workers waited for memd.
    `whole`: the size of all the files this one is part of, for the message.
    """
    if os.fstat(fd).st_blocks * 512 >= size:
        return True
    for offset in range(0, size, ALLOCATE_CHUNK_BYTES):
        if stop is not None and stop.is_set():
            return False
        try:
            os.posix_fallocate(fd, offset, min(ALLOCATE_CHUNK_BYTES, size - offset))
        except OSError as exc:
            raise PoolMemoryError(f"cannot allocate a {what} of {format_size(whole or size)}: "
                                  f"{exc.strerror}") from None
    return True


def usable_cores() -> int:
    return max(1, len(os.sched_getaffinity(0)))


class Allocation:
    """`allocate_pages` for each of `files` ((fd, size) pairs), on as many threads as there are files and
    cores, waited for now or later (`background`): before memd says READY=1.

    The kernel allocates a tmpfs file's pages one 4 KiB page at a time under
    the file's lock, so one file's pages cannot be allocated faster by more
    threads, but several files' can: an 8 GiB pool in one file took 3.0-3.3 s
    here, in 32 files on 2 cores 1.4-1.7 s. `after`: an allocation to wait
    for first (the swap file's pages come after the pool's, which READY needs).
    """

    def __init__(self, files: list[tuple[int, int]], what: str, background: bool = False,
                 after: Allocation | None = None) -> None:
        self._error: PoolMemoryError | None = None
        self._pending = list(files)
        self._whole = sum(size for _, size in files)
        self._what, self._after = what, after
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"memd-{what}-alloc", daemon=True)
                         for _ in range(min(len(files), usable_cores()))]
        for thread in self._threads:
            thread.start()
        if not background:
            self.wait()

    def _run(self) -> None:
        if self._after is not None:
            self._after.wait(check=False)
            if self._after.failed:              # memd does not start: nothing to allocate this for
                self._fail(PoolMemoryError(f"the {self._what} was not allocated: the {self._after._what} "
                                           "could not be"))
                return
        while True:
            with self._lock:
                if not self._pending or self._error is not None:
                    return
                fd, size = self._pending.pop(0)
            try:
                if not allocate_pages(fd, size, self._what, self._whole, self._stop):
                    self._fail(PoolMemoryError(f"the {self._what}'s allocation was cancelled"))
            except PoolMemoryError as exc:
                self._fail(exc)

    def _fail(self, exc: PoolMemoryError) -> None:
        with self._lock:
            self._error = self._error or exc

    @property
    def failed(self) -> bool:
        return self._error is not None

    def cancel(self) -> None:
        """Stop allocating (within one chunk per thread): memd is stopping, or did not start."""
        self._stop.set()

    def wait(self, check: bool = True) -> None:
        """Until the pages are allocated; raises what allocating them raised (unless `check` is False)."""
        for thread in self._threads:
            thread.join()
        if check and self._error is not None:
            raise self._error


class CudaMemory:
    """One device tensor for the whole pool, exported through its CUDA IPC handle."""

    backend = "cuda"

    def __init__(self, device: str, num_blocks: int, block_bytes: int) -> None:
        import torch

        if not torch.cuda.is_available():
            raise PoolMemoryError(f"device {device!r} asked for, but torch sees no CUDA GPU")
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
        if "expandable_segments:True" in conf.replace(" ", ""):
            raise PoolMemoryError("PYTORCH_CUDA_ALLOC_CONF enables expandable_segments, whose memory "
                                  "CUDA IPC cannot share; unset it for memd")
        try:
            index = torch.device(device).index
        except RuntimeError:
            raise PoolMemoryError(f"not a device: {device!r} (use cuda or cuda:N)") from None
        index = torch.cuda.current_device() if index is None else index
        if index >= torch.cuda.device_count():
            raise PoolMemoryError(f"{device}: only {torch.cuda.device_count()} GPU(s) visible")
        props = torch.cuda.get_device_properties(index)
        if "MIG" in props.name or os.environ.get("CUDA_VISIBLE_DEVICES", "").startswith("MIG-"):
            raise PoolMemoryError(f"{device} is a MIG instance: MIG has no CUDA IPC, so workers cannot map "
                                  "the pool; run memd on a whole GPU")
        size = num_blocks * block_bytes
        free, _total = torch.cuda.mem_get_info(index)
        if size > free:
            raise PoolMemoryError(f"pool of {format_size(size)} does not fit: {format_size(free)} free on {device}")
        try:
            flat = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{index}")
        except torch.cuda.OutOfMemoryError as exc:
            raise PoolMemoryError(f"cannot allocate a pool of {format_size(size)} on {device}: {exc}") from None
        torch.cuda.synchronize(index)
        self.index = index
        self.device = f"cuda:{index}"
        self.uuid = str(props.uuid)
        self.pages = flat.view(num_blocks, block_bytes)
        self._stream = torch.cuda.Stream(index)
        # Exported once: each _share_cuda_() takes a ref-counter slot and an IPC
        # event, and memd never frees the pool, so one handle serves every worker.
        (_device, handle, size, offset, ref_handle, ref_offset, event_handle,
         event_sync) = self.pages.untyped_storage()._share_cuda_()
        self._handle = {"backend": "cuda", "uuid": self.uuid, "handle": bytes(handle), "size": int(size),
                        "offset": int(offset), "ref_counter_handle": bytes(ref_handle),
                        "ref_counter_offset": int(ref_offset), "event_handle": bytes(event_handle or b""),
                        "event_sync_required": bool(event_sync)}

    def allocated(self) -> None:
        """The device tensor was allocated whole when it was made."""

    def export(self) -> dict[str, Any]:
        return dict(self._handle)

    def checksums(self, pages: list[int]) -> list[int]:
        """Of these pages as they are now: a reduction on the device (shared.page_checksum), 8 bytes back per page."""
        import torch

        with torch.cuda.stream(self._stream):
            return word_sums(self.pages, pages)

    def apply(self, effects: list[Zero | Copy]) -> None:
        """Zero and copy pages in Step order, batching runs of zeros into one kernel.

        Finished before the reply: the worker writes on its own stream, in its own process.
        """
        import torch

        pages, zeros = self.pages, []
        with torch.cuda.stream(self._stream):
            for effect in effects:
                if isinstance(effect, Zero):
                    zeros.append(effect.page)
                    continue
                if zeros:
                    pages.index_fill_(0, torch.tensor(zeros, device=pages.device), 0)
                    zeros = []
                pages[effect.page].copy_(pages[effect.src])
            if zeros:
                pages.index_fill_(0, torch.tensor(zeros, device=pages.device), 0)
        self._stream.synchronize()

    def close(self) -> None:
        """The pool lives as long as memd: workers may still have it mapped."""
