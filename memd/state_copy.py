"""A copy of memd's pool and sequences as they were at one instant, taken a slice at a time between Steps.

Copying a million blocks' ref counts, access times and prefix hashes in one
go held memd's event loop for 15-30 ms, and every worker's Step waited for
it; ten thousand parked sequences cost as much again. So the copy is taken
in slices of a fraction of a millisecond each, and the loop serves Steps in
between. Meanwhile the pool and the manager note every block and sequence a
Step changes (`BlockPool.watches`, `KvManager.watches`); those are copied
again at the end, and the last of them in one go, with nothing awaited: the
copy is the state of that last instant, as consistent as if it had been
taken in one piece. Should Steps change state faster than the copy catches
up, the re-copying repeats in slices until what is left is small.

The per-block copies are flat arrays, not lists: the garbage collector walks
every item of a list on each pass (12 ms for three lists of a million), and
dropping a list of a million items costs milliseconds more. And they are
kept an array per slice: growing one array of a million items reallocates
it, milliseconds of copying at a time.
"""

from __future__ import annotations

import asyncio
import itertools
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memd.sequences import SeqState, Sequence

if TYPE_CHECKING:
    from memd.manager import KvManager
    from memd.pool import BlockPool

SLICE_BLOCKS = 8_192           # pool entries copied between two turns of the loop: under a millisecond
SLICE_SEQS = 1_024             # sequences copied between two turns of the loop
SETTLE = 4_096                 # changed blocks and sequences few enough to copy again in one go
MAX_ROUNDS = 16                # rounds of re-copying in slices before the last one is taken regardless


@dataclass(frozen=True, slots=True)
class SeqCopy:
    """One sequence's fields as the copy shows them (its block table copied: the live one grows)."""

    seq_id: int
    session_id: str
    state: str
    owner: int
    running: bool
    num_committed: int
    num_tokens: int
    block_ids: tuple[int, ...]
    model: str
    last_access: float
    heat: float                  # as of `heat_at`: decayed to the copy's instant by `StateCopy.heat`
    heat_at: float
    swapped_blocks: int

    @classmethod
    def of(cls, s: Sequence) -> SeqCopy:
        return cls(s.seq_id, s.session_id or "", s.state.value, s.owner or 0, s.state is SeqState.RUNNING,
                   s.num_committed, len(s.token_ids), tuple(s.block_ids), s.model, s.last_access, s.heat,
                   s.heat_at, len(s.slots))


class BlockCopy:
    """Each block's ref count, access time and whether it carries a prefix hash, an array per slice."""

    __slots__ = ("cached", "last_access", "ref", "slice")

    def __init__(self, slice_blocks: int) -> None:
        self.slice = slice_blocks
        self.ref: list[array] = []
        self.last_access: list[array] = []
        self.cached: list[bytes | bytearray] = []

    def add_slice(self, pool: BlockPool, start: int) -> None:
        end = start + self.slice
        self.ref.append(array("q", pool.ref[start:end]))
        self.last_access.append(array("d", pool.last_access[start:end]))
        self.cached.append(bytearray(map(bool, pool.hash_of[start:end])))    # a digest is never empty

    def copy_again(self, pool: BlockPool, blocks: list[int] | set[int]) -> None:
        ref, last_access, hash_of = pool.ref, pool.last_access, pool.hash_of
        for block in blocks:
            at, i = divmod(block, self.slice)
            self.ref[at][i], self.last_access[at][i] = ref[block], last_access[block]
            self.cached[at][i] = hash_of[block] is not None

    def rows(self) -> Iterator[tuple[int, float, int]]:
        """(ref count, last access, cached) of every block, in block order."""
        chain = itertools.chain.from_iterable
        return zip(chain(self.ref), chain(self.last_access), chain(self.cached), strict=True)


@dataclass(slots=True)
class StateCopy:
    """The pool's per-block state (when asked for) and every sequence, as of one instant."""

    heat_decay: float
    heat_interval_s: float
    blocks: BlockCopy | None = None             # None: not asked for
    seqs: dict[int, SeqCopy] = field(default_factory=dict)
    fences: dict[int, tuple[int, ...]] = field(default_factory=dict)      # pid -> pages fenced for it
    rounds: int = 0                            # of re-copying: how busy memd was meanwhile

    def heat(self, seq: SeqCopy, now: float) -> float:
        """As `KvManager.heat` computed it at `now` (the copy's instant)."""
        return seq.heat * self.heat_decay ** (max(0.0, now - seq.heat_at) / self.heat_interval_s)

    async def drop(self) -> None:
        """Let go of the sequences a slice at a time: dropping 100k of them at once is milliseconds of the loop."""
        while self.seqs:
            for _ in range(min(SLICE_SEQS, len(self.seqs))):
                self.seqs.popitem()
            await asyncio.sleep(0)


async def take(manager: KvManager, *, blocks: bool = True) -> StateCopy:
    """The copy; awaits between slices. When it returns, nothing has run since its last instant: the caller
    may add what else it shows (workers, the time) before its next await, and it belongs to the same instant."""
    pool = manager.pool
    copy = StateCopy(manager.heat_decay, manager.heat_interval_s)
    changed_blocks: set[int] = set()
    changed_seqs: set[int] = set()
    pool.watches.append(changed_blocks)
    manager.watches.append(changed_seqs)
    try:
        if blocks:
            copy.blocks = BlockCopy(SLICE_BLOCKS)
            for start in range(0, pool.num_blocks, SLICE_BLOCKS):
                copy.blocks.add_slice(pool, start)
                await asyncio.sleep(0)
        seq_ids = list(manager.seqs)           # ones created meanwhile are noted as changed
        for start in range(0, len(seq_ids), SLICE_SEQS):
            _copy_seqs(manager, copy, seq_ids[start:start + SLICE_SEQS])
            await asyncio.sleep(0)
        while len(changed_blocks) + len(changed_seqs) > SETTLE and copy.rounds < MAX_ROUNDS:
            copy.rounds += 1
            again_blocks, again_seqs = sorted(changed_blocks), list(changed_seqs)
            changed_blocks.clear()
            changed_seqs.clear()
            for start in range(0, len(again_blocks), SLICE_BLOCKS):
                if copy.blocks is not None:
                    copy.blocks.copy_again(pool, again_blocks[start:start + SLICE_BLOCKS])
                await asyncio.sleep(0)
            for start in range(0, len(again_seqs), SLICE_SEQS):
                _copy_seqs(manager, copy, again_seqs[start:start + SLICE_SEQS])
                await asyncio.sleep(0)
        # The last instant: nothing awaited from here on.
        if copy.blocks is not None:
            copy.blocks.copy_again(pool, changed_blocks)
        _copy_seqs(manager, copy, changed_seqs)
        copy.fences = {pid: tuple(pages) for pid, pages in manager.fences.items()}
        return copy
    finally:                                   # by identity: another reader's set may be equal to ours
        pool.watches[:] = [w for w in pool.watches if w is not changed_blocks]
        manager.watches[:] = [w for w in manager.watches if w is not changed_seqs]


def _copy_seqs(manager: KvManager, copy: StateCopy, seq_ids: list[int] | set[int]) -> None:
    live, seqs = manager.seqs, copy.seqs
    for seq_id in seq_ids:
        seq = live.get(seq_id)
        if seq is None:
            seqs.pop(seq_id, None)
        else:
            seqs[seq_id] = SeqCopy.of(seq)
