"""memd's swap tier for a GPU pool: pinned host memory, filled and emptied by DMA on streams of its own.

Scattered small pages are the hard case: one DMA each moved 64 KiB pages at
16% of a plain copy on an H200. So past a few runs they are gathered on the
GPU into a staging buffer and moved in a few large DMAs (scattered back from
it on the way in).
"""

from __future__ import annotations

import threading

import numpy
import structlog

from memd.memory import CudaMemory, PoolMemoryError, require_host_memory
from memd.swap import SWAP_ADVICE, check_bounds, latency_test_wait, pair_index, spans
from shared.page_checksum import word_sums
from shared.sizes import format_size

log = structlog.get_logger("memd.swap")

# Pages below GATHER_BELOW_BYTES, past GATHER_RUNS runs, go through a staging buffer of up to STAGING_BYTES
# (the module docstring). Measured on an H200 before the copies were queued without a wait between chunks:
# 64 KiB pages moved at 65-68% of a plain copy gathered, and pages of 1 MiB and up at 83-97% one DMA each.
GATHER_RUNS = 8
GATHER_BELOW_BYTES = 1 << 20
STAGING_BYTES = 64 << 20


class PinnedSwap:
    """Pinned host memory; copies on a CUDA stream of their own, finished before `copy_*` returns."""

    def __init__(self, pool: CudaMemory, num_slots: int, block_bytes: int, delay_s: float = 0.0, *,
                 gather: bool | None = None) -> None:
        """`gather`: move scattered pages through a staging buffer on the GPU; None: for pages under
        GATHER_BELOW_BYTES."""
        import torch

        require_host_memory("swap tier", num_slots * block_bytes, SWAP_ADVICE)
        self.num_slots, self.delay_s = num_slots, delay_s
        try:
            self.slots = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            raise PoolMemoryError(f"cannot pin a swap tier of {format_size(num_slots * block_bytes)}: "
                                  f"{exc}") from None
        self.pages = pool.pages
        self._pool = pool
        self.locked = True            # cudaHostAlloc memory is page-locked
        # One stream per direction: a swap-in (a Step waits for it) never queues behind a swap-out,
        # each with its own staging buffer (None where the GPU had no room left: one DMA per run then).
        self._out_stream = torch.cuda.Stream(pool.index)
        self._in_stream = torch.cuda.Stream(pool.index)
        rows = max(1, min(num_slots, STAGING_BYTES // block_bytes))
        self._staging: dict[str, torch.Tensor] = {}
        if gather or (gather is None and block_bytes < GATHER_BELOW_BYTES):
            try:
                self._staging = {d: torch.empty((rows, block_bytes), dtype=torch.uint8, device=self.pages.device)
                                 for d in ("out", "in")}
            except torch.cuda.OutOfMemoryError:
                log.warning("no GPU memory left for swap staging buffers: small pages swap one DMA at a time")

    def copy_out(self, pairs: list[tuple[int, int]], halt: threading.Event | None = None) -> bool:
        """False if `halt` was set before the copy started: queued on the stream, a DMA runs to its end."""
        if latency_test_wait(self.delay_s, halt):
            return False
        self._copy(pairs, "out", self._out_stream)
        return True

    def copy_out_checked(self, pairs: list[tuple[int, int]], halt: threading.Event | None = None) \
            -> list[int] | None:
        """Copy out, then sum the pages on the GPU (8 bytes per page come back); None: halted before the copy."""
        if not self.copy_out(pairs, halt):
            return None
        return self._pool.checksums([block for block, _ in pairs])

    def copy_in(self, pairs: list[tuple[int, int]]) -> None:
        latency_test_wait(self.delay_s)
        self._copy(pairs, "in", self._in_stream)

    def copy_in_checked(self, pairs: list[tuple[int, int]]) -> list[int]:
        """Copy in, then sum the pages on the GPU, on the same stream (8 bytes per page come back)."""
        import torch

        latency_test_wait(self.delay_s)
        with torch.cuda.stream(self._in_stream):
            self.move(pairs, "in")
            return word_sums(self.pages, [block for _, block in pairs])

    def _copy(self, pairs: list[tuple[int, int]], direction: str, stream: object) -> None:
        import torch

        with torch.cuda.stream(stream):
            self.move(pairs, direction)
        stream.synchronize()                                           # type: ignore[attr-defined]

    def move(self, pairs: list[tuple[int, int]], direction: str) -> None:
        """Queue the copies on the current stream: (block, slot) pairs out, (slot, block) pairs in.

        Nothing here waits for the GPU: the pages' indices go up once, before any copy is queued, so the
        host plans chunk after chunk while the DMA engine moves the one before."""
        import torch

        src, dst = (self.pages, self.slots) if direction == "out" else (self.slots, self.pages)
        index = pair_index(pairs)
        check_bounds(index, len(src), len(dst))          # a slice would drop a page past the end, silently
        copies = spans(index)
        staging = self._staging.get(direction)
        if staging is None or len(copies) < GATHER_RUNS:
            for a, b, n in copies:
                dst[b:b + n].copy_(src[a:a + n], non_blocking=True)
            return
        out = direction == "out"
        on_gpu = index[:, 0 if out else 1]
        pages = torch.from_numpy(on_gpu.copy()).to(self.pages.device, non_blocking=True)
        rows = staging.shape[0]
        for start in range(0, len(index), rows):
            chunk = index[start:start + rows]
            n = len(chunk)
            local = numpy.arange(n)
            if out:                      # gather the pages on the GPU, then DMA by runs of slots
                torch.index_select(self.pages, 0, pages[start:start + n], out=staging[:n])
                for row, slot, count in spans(numpy.stack([local, chunk[:, 1]], 1)):
                    self.slots[slot:slot + count].copy_(staging[row:row + count], non_blocking=True)
            else:                        # DMA by runs of slots, then scatter to the pages on the GPU
                for slot, row, count in spans(numpy.stack([chunk[:, 0], local], 1)):
                    staging[row:row + count].copy_(self.slots[slot:slot + count], non_blocking=True)
                self.pages.index_copy_(0, pages[start:start + n], staging[:n])

    def allocated(self) -> None:
        """Pinned whole when it was made."""

    def checksums(self, slots: list[int]) -> list[int]:
        """Of the bytes in these slots, by the CUDA pool's checksum (the word sum, computed on the host here)."""
        return word_sums(self.slots, slots)

    def close(self) -> None:
        """Freed with the process."""
