"""Map memd's pool into this process, zero copy.

`shm`: receive the pool's files over memd's side socket (SCM_RIGHTS) and
map them as one range (shared.pool_files).
`cuda`: open the pool's CUDA IPC handle on the local GPU with the same UUID
(CUDA_VISIBLE_DEVICES may number GPUs differently here than in memd). A
process cannot open its own IPC handle, so memd and its workers are always
separate processes.
"""

from __future__ import annotations

import mmap
import os
import socket
from typing import Any

import torch

from shared.geometry import PoolGeometry
from shared.pool_files import map_stripes


class PoolMapError(RuntimeError):
    """The pool handle could not be turned into memory here."""


class MappedPool:
    """The pool as pages: `pages[i]` is block i's bytes, shared with memd and every worker."""

    def __init__(self, pages: torch.Tensor, backend: str, keepalive: Any = None) -> None:
        self.pages = pages
        self.backend = backend
        self._keepalive = keepalive

    def view(self, dtype: torch.dtype, page_shape: tuple[int, ...]) -> torch.Tensor:
        """Every page seen as one block of a model: [num_blocks, *page_shape] of `dtype`.

        The page may be larger than the block; the tail of each page is unused.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        num = 1
        for dim in page_shape:
            num *= dim
        if num * itemsize > self.pages.shape[1]:
            raise PoolMapError(f"a block of {num * itemsize} bytes does not fit a page of {self.pages.shape[1]}")
        return self.pages[:, :num * itemsize].view(dtype).view(self.pages.shape[0], *page_shape)

    def synchronize(self) -> None:
        """Wait for this process's kernels on the pool's device (no-op on the CPU)."""
        if self.pages.is_cuda:
            torch.cuda.synchronize(self.pages.device)

    def close(self) -> None:
        self.pages = torch.empty(0, dtype=torch.uint8)
        if isinstance(self._keepalive, mmap.mmap):
            try:
                self._keepalive.close()
            except BufferError:
                pass   # views are still alive; the mapping goes when they do
        self._keepalive = None


def map_pool(handle: dict[str, Any], geometry: PoolGeometry) -> MappedPool:
    if handle["size"] != geometry.pool_bytes:
        raise PoolMapError(f"pool handle is for {handle['size']} bytes, geometry says {geometry.pool_bytes}")
    if handle["backend"] == "shm":
        return _map_shm(handle, geometry)
    return _map_cuda(handle, geometry)


def receive_fds(path: str, token: bytes, count: int = 1, timeout_s: float = 10.0) -> list[int]:
    """The pool's `count` file descriptors, from memd's side socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            sock.sendall(token)
            msg, fds, _flags, _addr = socket.recv_fds(sock, 16, count)
        except OSError as exc:
            raise PoolMapError(f"cannot fetch the pool from {path}: {exc}") from None
    if msg != b"OK" or len(fds) != count:
        for fd in fds:
            os.close(fd)
        if msg == b"OK":
            raise PoolMapError(f"memd sent {len(fds)} pool files at {path}, its handle says {count}")
        raise PoolMapError(f"memd refused the pool handle at {path} (token unknown or expired)")
    return fds


def _map_shm(handle: dict[str, Any], geometry: PoolGeometry) -> MappedPool:
    sizes = handle.get("stripes") or [handle["size"]]
    if sum(sizes) != handle["size"]:
        raise PoolMapError(f"the pool's files add up to {sum(sizes)} bytes, its handle says {handle['size']}")
    fds = receive_fds(handle["socket"], handle["token"], len(sizes))
    try:
        if any(os.fstat(fd).st_size < size for fd, size in zip(fds, sizes, strict=True)):
            raise PoolMapError("a pool file is smaller than its handle says")
        try:
            mm, offset = map_stripes(fds, sizes)
        except OSError as exc:
            raise PoolMapError(f"cannot map the pool: {exc.strerror}") from None
    finally:
        for fd in fds:
            os.close(fd)    # the mapping keeps the memory alive
    pages = torch.frombuffer(mm, dtype=torch.uint8, count=handle["size"], offset=offset) \
        .view(geometry.num_blocks, geometry.block_bytes)
    return MappedPool(pages, "shm", mm)


def local_cuda_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid`."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise PoolMapError(f"GPU {uuid} holding the pool is not visible here (check CUDA_VISIBLE_DEVICES)")


def _map_cuda(handle: dict[str, Any], geometry: PoolGeometry) -> MappedPool:
    if not torch.cuda.is_available():
        raise PoolMapError("memd's pool is on a GPU, but torch sees no CUDA device here")
    index = local_cuda_index(handle["uuid"])
    torch.cuda._lazy_init()
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index, handle["handle"], handle["size"], handle["offset"], handle["ref_counter_handle"],
            handle["ref_counter_offset"], handle["event_handle"], handle["event_sync_required"])
    except (RuntimeError, TypeError) as exc:
        raise PoolMapError(f"cannot open the pool's CUDA IPC handle: {exc} (same host, shared PID and "
                           "IPC namespaces, no MIG)") from None
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage)
    pages = flat[: geometry.pool_bytes].view(geometry.num_blocks, geometry.block_bytes)
    return MappedPool(pages, "cuda", storage)
