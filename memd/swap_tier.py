"""Which swap tier a pool gets: host shared memory beside a shared-memory pool, pinned host memory beside
a CUDA pool (memd.swap, memd.pinned_swap)."""

from __future__ import annotations

from pathlib import Path

import structlog

from memd.memory import CudaMemory, PoolMemory, PoolMemoryError, ShmMemory
from memd.pinned_swap import PinnedSwap
from memd.swap import HostSwap, SwapMemory, latency_test_delay

log = structlog.get_logger("memd.swap")


def allocate_swap(pool: PoolMemory, num_slots: int, block_bytes: int, path: Path | None = None) -> SwapMemory:
    """`path`: a swap file to reopen or create beside a pool file (shm only), so swapped sessions survive memd."""
    delay = latency_test_delay()
    if delay:
        log.warning("SWAP_LATENCY_TEST set: every swap copy is delayed", delay_s=delay)
    if isinstance(pool, ShmMemory):
        return HostSwap(pool, num_slots, block_bytes, delay, path)
    if isinstance(pool, CudaMemory):
        return PinnedSwap(pool, num_slots, block_bytes, delay)
    raise PoolMemoryError(f"no swap tier for the {pool.backend} backend")
