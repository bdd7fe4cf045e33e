"""Scrubbing: every page memd keeps for later checked against its checksum, without stalling Steps.

Parked and cached pool pages are checked against what their worker sent when
it committed them, swapped pages against what their swap-out copied. A page
with a checksum is never written until memd hands it out again (which clears
the checksum, on the event loop), so the bytes are hashed on a thread of their
own, in chunks, while Steps go on; a page that seems wrong is checked again on
the event loop, where nothing can change under it, before anything is done
about it (memd.integrity). `memctl scrub` runs one pass; `--scrub-interval`
runs one every so often; a memd that reopened a state directory checks the
reopened pages the same way before it serves (`check_reopened`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog

from memd import integrity
from memd.background import give_way
from memd.integrity import Where
from memd.manager import KvManager
from memd.memory import PoolMemory
from memd.sequences import SeqState, Sequence
from memd.swap import SwapMemory

log = structlog.get_logger("memd.scrub")

CHUNK_BYTES = 8 << 20          # hashed per trip to the scrub thread
SCAN_BLOCKS = 4096             # block ids looked at per turn of the event loop


@dataclass(frozen=True, slots=True)
class Failure:
    """One page (or swap slot) that failed, and whose K/V it was."""

    where: str                 # "page" or "slot"
    index: int                 # block id or slot number
    seq_ids: list[int]
    sessions: list[str]


@dataclass(slots=True)
class ScrubReport:
    pages: int = 0             # pool pages checked
    slots: int = 0             # swap slots checked
    bytes: int = 0
    seconds: float = 0.0
    failures: list[Failure] = field(default_factory=list)


class Scrubber:
    """Runs scrub passes, one at a time; `persist` journals what a failure changed."""

    def __init__(self, manager: KvManager, memory: PoolMemory, swap: SwapMemory | None,
                 persist: Callable[[], None]) -> None:
        self.manager, self.memory, self.swap, self.persist = manager, memory, swap, persist
        self.block_bytes = manager.geometry.block_bytes
        self._lock = asyncio.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memd-scrub", initializer=give_way)

    async def scrub(self, rate_bytes_s: float = 0.0) -> ScrubReport:
        """One pass over every parked, cached and swapped page; at most `rate_bytes_s` (0: as fast as it goes)."""
        async with self._lock:
            report, started = ScrubReport(), time.monotonic()
            pace = _Pace(rate_bytes_s)
            await self._pool_pages(report, pace)
            await self._swap_slots(report, pace)
            report.seconds = time.monotonic() - started
            self.manager.counters["scrubs"] += 1
            log.info("scrub done", pages=report.pages, slots=report.slots, failures=len(report.failures),
                     seconds=round(report.seconds, 3))
            return report

    def check_reopened(self) -> ScrubReport:
        """At start-up, before serving: the pages a new memd reopened from its state directory."""
        report, started = ScrubReport(), time.monotonic()
        sums = self.manager.pool.checksum
        blocks = [b for b in range(self.manager.pool.num_blocks) if sums[b]]
        found = self.memory.checksums(blocks)
        report.pages = len(blocks)
        report.bytes = len(blocks) * self.block_bytes
        self.manager.counters["pages_verified"] += len(blocks)
        for block, got in zip(blocks, found, strict=True):
            if got != sums[block]:
                self._page_failed(block, Where.RESTART, report)
        report.seconds = time.monotonic() - started
        return report

    async def _pool_pages(self, report: ScrubReport, pace: _Pace) -> None:
        sums, per_chunk = self.manager.pool.checksum, max(1, CHUNK_BYTES // self.block_bytes)
        loop = asyncio.get_running_loop()
        chunk: list[tuple[int, int]] = []
        for lo in range(0, self.manager.pool.num_blocks, SCAN_BLOCKS):
            chunk += [(b, sums[b]) for b in range(lo, min(lo + SCAN_BLOCKS, len(sums))) if sums[b]]
            while len(chunk) >= per_chunk or (chunk and lo + SCAN_BLOCKS >= len(sums)):
                batch, chunk = chunk[:per_chunk], chunk[per_chunk:]
                found = await loop.run_in_executor(self._thread, self.memory.checksums, [b for b, _ in batch])
                self._count(report, len(batch), pages=True)
                for (block, want), got in zip(batch, found, strict=True):
                    # Still the page it was (no new tenant cleared its checksum), and wrong on a second look.
                    if got != want and sums[block] == want and self.memory.checksums([block])[0] != want:
                        self._page_failed(block, Where.SCRUB, report)
                await pace.wait(len(batch) * self.block_bytes)
            if not chunk:
                await asyncio.sleep(0)             # let Steps in between long runs of unchecked blocks

    async def _swap_slots(self, report: ScrubReport, pace: _Pace) -> None:
        swap, m = self.swap, self.manager
        if swap is None or m.swap is None:
            return
        per_chunk = max(1, CHUNK_BYTES // self.block_bytes)
        loop = asyncio.get_running_loop()
        swapped = [seq for seq in m.seqs.values() if seq.state is SeqState.SWAPPED]
        chunk: list[tuple[Sequence, int, int, int]] = []
        for n, seq in enumerate(swapped, 1):
            if m.seqs.get(seq.seq_id) is seq and seq.state is SeqState.SWAPPED:
                chunk += [(seq, i, slot, m.swap.checksum[slot]) for i, slot in enumerate(seq.slots)
                          if m.swap.checksum[slot]]
            while len(chunk) >= per_chunk or (chunk and n == len(swapped)):
                batch, chunk = chunk[:per_chunk], chunk[per_chunk:]
                found = await loop.run_in_executor(self._thread, swap.checksums, [slot for _, _, slot, _ in batch])
                self._count(report, len(batch), pages=False)
                for (held, index, slot, want), got in zip(batch, found, strict=True):
                    if got != want and self._still_swapped(held, index, slot, want) \
                            and swap.checksums([slot])[0] != want:
                        report.failures.append(Failure("slot", slot, [held.seq_id], _sessions([held])))
                        integrity.slot_failed(m, held, index, Where.SCRUB)
                        self.persist()
                await pace.wait(len(batch) * self.block_bytes)

    def _still_swapped(self, seq: Sequence, index: int, slot: int, want: int) -> bool:
        m = self.manager
        return (m.seqs.get(seq.seq_id) is seq and seq.state is SeqState.SWAPPED and index < len(seq.slots)
                and seq.slots[index] == slot and m.swap is not None and m.swap.checksum[slot] == want)

    def _page_failed(self, block: int, where: Where, report: ScrubReport) -> None:
        holders = [seq for seq in self.manager.seqs.values() if block in seq.block_ids]
        if integrity.page_failed(self.manager, block, where):
            report.failures.append(Failure("page", block, [s.seq_id for s in holders], _sessions(holders)))
            self.persist()

    def _count(self, report: ScrubReport, n: int, *, pages: bool) -> None:
        if pages:
            report.pages += n
        else:
            report.slots += n
        report.bytes += n * self.block_bytes
        self.manager.counters["pages_verified"] += n

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def _sessions(seqs: list[Sequence]) -> list[str]:
    return [s.session_id for s in seqs if s.session_id]


class _Pace:
    """Keeps a pass at or under a rate of bytes per second (0: no limit)."""

    def __init__(self, rate_bytes_s: float) -> None:
        self.rate, self.started, self.done = rate_bytes_s, time.monotonic(), 0

    async def wait(self, nbytes: int) -> None:
        self.done += nbytes
        if self.rate > 0:
            ahead = self.started + self.done / self.rate - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)
