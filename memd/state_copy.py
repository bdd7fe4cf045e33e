"""A copy of memd's pool and sequences as they were at one instant, taken a slice at a time between Steps.

Copying a million blocks' ref counts, access times and prefix hashes in one
go holds memd's event loop for as long as the whole copy takes, and every
worker's Step waits for it; parked sequences add to it in proportion to
their number. So the copy is taken in slices of a fraction of a millisecond
each, and the loop serves Steps in between. Meanwhile the pool and the
manager note every block and sequence a Step changes (`BlockPool.watches`,
`KvManager.watches`, and the lowest the swap tier's free stack got,
`SwapSlots.low_marks`); those are copied again at the end, and the last of
them in one go, with nothing awaited: the copy is the state of that last
instant, as consistent as if it had been taken in one piece. Should Steps
change state faster than the copy catches up, the re-copying repeats in
slices until what is left is small.

`memctl snapshot` shows the copy; `memctl check` checks it (memd.invariants).
The check's copy carries more per block (queue links, whether the prefix
index agrees, whether a checksum is set) and per sequence.

The per-block copies are flat arrays, not lists: the garbage collector walks
every item of a list on each pass, and dropping a list of a million items
releases each item in turn. And they are kept an array per slice: growing
one array of a million items reallocates it, copying all it holds at once.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from memd.sequences import SeqState, Sequence

if TYPE_CHECKING:
    from memd.kv_state import KvState
    from memd.pool import BlockPool

SLICE_S = 0.001                # a slice ends at the first place it may once it has held the loop this long
MAX_PAUSE_S = 0.002            # the longest a slice waits for Steps to run before the next
# Where a slice may end: every this many entries, few enough that a slice overruns SLICE_S by little.
SLICE_BLOCKS = 2_048           # pool entries copied (and the copy's arrays: one per this many blocks)
CHECKED_SLICE_BLOCKS = 512     # the same for a check's copy, which looks each block's hash up
SLICE_SEQS = 64                # sequences copied
SETTLE = 4_096                 # changed blocks and sequences few enough to copy again in one go
MAX_ROUNDS = 16                # rounds of re-copying in slices before the last one is taken regardless


class Pacer:
    """Between two slices, the loop is left to Steps for as long as the slice ran (two milliseconds at most).

    A slice ends by the clock, not by a count of entries: the work runs
    through `checkpoint`s a few entries apart, and the first one reached
    after SLICE_S of holding pauses. Counts sized for a quiet host hold the
    loop several times as long on a loaded one (every process slowed by the
    others on its cores), and Steps wait that much longer.

    Yielding one turn of the loop is not enough: a Step needs several turns
    (the request read, the handler, the reply written), and would meet a
    slice at each; at half the loop's time an operator call takes twice as
    long, and a Step meets at most about one slice.

    Each slice's length goes to `Pacer.observe` when memd serves metrics
    (kvpool_memd_operator_hold_seconds): how long an operator call held the
    loop at a time, apart from what else kept a Step waiting on a busy host.
    """

    observe: ClassVar[Callable[[float], None] | None] = None
    __slots__ = ("_observed", "_since")

    def __init__(self, *, observed: bool = True) -> None:
        """`observed=False`: a pacer that only paces, where the slices between its pauses wait on other things."""
        self._since = time.perf_counter()
        self._observed = observed

    async def checkpoint(self) -> None:
        """A place the slice may end: it does, once it has held the loop SLICE_S."""
        if time.perf_counter() - self._since >= SLICE_S:
            await self.pause()

    async def pause(self) -> None:
        held = self.held()
        await asyncio.sleep(min(MAX_PAUSE_S, held))
        self.resumed()

    def held(self) -> float:
        """The slice since the loop last came back, observed: call it wherever a slice ends without a pause
        (the last one, or one that ends in a yield to a stream)."""
        held = time.perf_counter() - self._since
        if self._observed and Pacer.observe is not None:
            Pacer.observe(held)
        return held

    def resumed(self) -> None:
        """A slice starts: the loop came back after an await of something else."""
        self._since = time.perf_counter()


@dataclass(frozen=True, slots=True)
class SeqCopy:
    """One sequence's fields as the copy shows and checks them (its tables copied: the live ones change)."""

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
    slots: tuple[int, ...]
    block_size: int
    num_hashes: int
    has_session: bool            # session_id is not None (an empty name is still a session)
    tenant: str
    retain_until: float

    @classmethod
    def of(cls, s: Sequence) -> SeqCopy:
        return cls(s.seq_id, s.session_id or "", s.state.value, s.owner or 0, s.state is SeqState.RUNNING,
                   s.num_committed, len(s.token_ids), tuple(s.block_ids), s.model, s.last_access, s.heat,
                   s.heat_at, tuple(s.slots), s.block_size, len(s.hashes), s.session_id is not None, s.tenant,
                   s.retain_until)

    @property
    def swapped_blocks(self) -> int:
        return len(self.slots)


class BlockCopy:
    """Per block: ref count, access time, whether it carries a prefix hash; for a check, more. An array per slice."""

    __slots__ = ("cached", "checked", "hash_ok", "last_access", "next", "prev", "ref", "slice", "written")

    def __init__(self, slice_blocks: int, checked: bool) -> None:
        self.slice, self.checked = slice_blocks, checked
        self.ref: list[array] = []
        self.last_access: list[array] = []
        self.cached: list[bytearray] = []
        # For a check only: the free queue's links, whether the prefix index maps the block's hash to
        # it (1 when it carries none), whether its page carries a checksum.
        self.next: list[array] = []
        self.prev: list[array] = []
        self.hash_ok: list[bytearray] = []
        self.written: list[bytearray] = []

    def add_slice(self, pool: BlockPool, start: int) -> None:
        end = min(start + self.slice, pool.num_blocks)
        self.ref.append(array("q", pool.ref[start:end]))
        self.last_access.append(array("d", pool.last_access[start:end]))
        self.cached.append(bytearray(map(bool, pool.hash_of[start:end])))    # a digest is never empty
        if self.checked:
            nexts, prevs = pool.free.links(start, end)
            self.next.append(array("q", nexts))
            self.prev.append(array("q", prevs))
            ok, get, hashes = bytearray(b"\x01") * (end - start), pool.by_hash.get, pool.hash_of
            for block in itertools.compress(range(start, end), self.cached[-1]):
                ok[block - start] = get(hashes[block]) == block          # type: ignore[arg-type]
            self.hash_ok.append(ok)
            self.written.append(bytearray(map(bool, pool.checksum[start:end])))

    def copy_again(self, pool: BlockPool, blocks: list[int] | set[int]) -> None:
        ref, last_access, hash_of, end = pool.ref, pool.last_access, pool.hash_of, pool.num_blocks
        for block in blocks:
            if block >= end:
                continue                         # the free queue's sentinel: `StateCopy.queue_ends`
            at, i = divmod(block, self.slice)
            self.ref[at][i], self.last_access[at][i] = ref[block], last_access[block]
            digest = hash_of[block]
            self.cached[at][i] = digest is not None
            if self.checked:
                self.next[at][i], self.prev[at][i] = pool.free.link(block)
                self.hash_ok[at][i] = digest is None or pool.by_hash.get(digest) == block
                self.written[at][i] = bool(pool.checksum[block])

    def value(self, column: list[array] | list[bytearray], block: int) -> int:
        """One block's entry in one of the columns (`self.ref`, `self.written` ...)."""
        at, i = divmod(block, self.slice)
        return column[at][i]

    def rows(self) -> Iterator[tuple[int, float, int]]:
        """(ref count, last access, cached) of every block, in block order."""
        chain = itertools.chain.from_iterable
        return zip(chain(self.ref), chain(self.last_access), chain(self.cached), strict=True)


@dataclass(slots=True)
class SwapCopy:
    """The swap tier's slots: the free stack (bottom first), the slots copies own, the swap-outs in flight."""

    num_slots: int
    free: list[int]
    in_copy: frozenset[int] = frozenset()
    jobs: dict[int, str] = field(default_factory=dict)   # seq id -> what is wrong with its swap-out ("": nothing)


@dataclass(slots=True)
class StateCopy:
    """The pool's per-block state (when asked for) and every sequence, as of one instant."""

    heat_decay: float
    heat_interval_s: float
    num_blocks: int
    blocks: BlockCopy | None = None             # None: not asked for
    seqs: dict[int, SeqCopy] = field(default_factory=dict)
    fences: dict[int, tuple[int, ...]] = field(default_factory=dict)      # pid -> pages fenced for it
    # For a check: the rest of the instant.
    sessions: dict[str, int] = field(default_factory=dict)
    workers: frozenset[int] = frozenset()
    queue_len: int = 0
    queue_ends: tuple[int, int] = (0, 0)        # the sentinel's (next, prev): the first and last free block
    num_hashed: int = 0                          # entries in the prefix index
    swap: SwapCopy | None = None
    rounds: int = 0                              # of re-copying: how busy memd was meanwhile
    # Each tenant's and model's pages as memd keeps them (memd.holder_ledger), checked against the tables.
    holder_pages: dict[tuple[str, str], int] = field(default_factory=dict)
    # And what it keeps of each holder's sequences: (count per state, sessions, swap slots), as memctl tenants
    # shows them (memd.seq_index).
    holder_rows: dict[tuple[str, str], tuple[dict[str, int], int, int]] = field(default_factory=dict)

    def heat(self, seq: SeqCopy, now: float) -> float:
        """As `KvManager.heat` computed it at `now` (the copy's instant)."""
        return seq.heat * self.heat_decay ** (max(0.0, now - seq.heat_at) / self.heat_interval_s)

    async def drop(self) -> None:
        """Let go of the sequences a slice at a time: dropping 100k of them at once is milliseconds of the loop."""
        pacer = Pacer()
        while self.seqs:
            for _ in range(min(SLICE_SEQS, len(self.seqs))):
                self.seqs.popitem()
            await pacer.checkpoint()


async def take(manager: KvState, *, blocks: bool = True, checked: bool = False) -> StateCopy:
    """The copy; awaits between slices. When it returns, nothing has run since its last instant: the caller
    may add what else it shows (workers, the time) before its next await, and it belongs to the same instant.

    `checked`: with what a check needs (implies `blocks`).
    """
    copy, pacer = StateCopy(manager.heat_decay, manager.heat_interval_s, manager.pool.num_blocks), Pacer()
    for _ in _steps(manager, copy, blocks or checked, checked):
        await pacer.checkpoint()
    pacer.held()                                    # the last stretch: the changes copied again in one go
    return copy


def take_now(manager: KvState, *, blocks: bool = True, checked: bool = False) -> StateCopy:
    """The copy in one go, for callers that may hold the loop (tests, start-up)."""
    copy = StateCopy(manager.heat_decay, manager.heat_interval_s, manager.pool.num_blocks)
    for _ in _steps(manager, copy, blocks or checked, checked):
        pass
    return copy


def pool_now(pool: BlockPool) -> StateCopy:
    """A check's copy of a pool alone (no sequences), in one go."""
    copy = StateCopy(0.0, 1.0, pool.num_blocks, BlockCopy(CHECKED_SLICE_BLOCKS, checked=True))
    for start in range(0, pool.num_blocks, CHECKED_SLICE_BLOCKS):
        copy.blocks.add_slice(pool, start)          # type: ignore[union-attr]
    _copy_pool_totals(pool, copy)
    return copy


def _copy_pool_totals(pool: BlockPool, copy: StateCopy) -> None:
    copy.queue_len, copy.num_hashed = len(pool.free), len(pool.by_hash)
    copy.queue_ends = pool.free.link(pool.num_blocks)


def _steps(manager: KvState, copy: StateCopy, blocks: bool, checked: bool) -> Iterator[None]:
    """Copies into `copy`, yielding where the loop may run Steps; the last stretch yields nothing."""
    pool, swap = manager.pool, manager.swap
    changed_blocks: set[int] = set()
    changed_seqs: set[int] = set()
    low_mark = [swap.num_free if swap is not None else 0]
    pool.watches.append(changed_blocks)
    manager.watches.append(changed_seqs)
    if swap is not None:
        swap.low_marks.append(low_mark)
    try:
        if blocks:
            copy.blocks = BlockCopy(CHECKED_SLICE_BLOCKS if checked else SLICE_BLOCKS, checked)
            for start in range(0, pool.num_blocks, copy.blocks.slice):
                copy.blocks.add_slice(pool, start)
                yield
        seq_ids = list(manager.seqs)           # ones created meanwhile are noted as changed
        for start in range(0, len(seq_ids), SLICE_SEQS):
            _copy_seqs(manager, copy, seq_ids[start:start + SLICE_SEQS])
            yield
        free_slots: list[int] = []
        if checked and swap is not None:
            for start in range(0, swap.num_free, SLICE_BLOCKS):
                free_slots += swap.free_slots(start, start + SLICE_BLOCKS)
                yield
        while len(changed_blocks) + len(changed_seqs) > SETTLE and copy.rounds < MAX_ROUNDS:
            copy.rounds += 1
            again_blocks, again_seqs = sorted(changed_blocks), list(changed_seqs)
            changed_blocks.clear()
            changed_seqs.clear()
            for start in range(0, len(again_blocks), CHECKED_SLICE_BLOCKS):
                if copy.blocks is not None:
                    copy.blocks.copy_again(pool, again_blocks[start:start + CHECKED_SLICE_BLOCKS])
                yield
            for start in range(0, len(again_seqs), SLICE_SEQS):
                _copy_seqs(manager, copy, again_seqs[start:start + SLICE_SEQS])
                yield
        # The last instant: nothing yielded from here on.
        if copy.blocks is not None:
            copy.blocks.copy_again(pool, changed_blocks)
        _copy_seqs(manager, copy, changed_seqs)
        copy.fences = {pid: tuple(pages) for pid, pages in manager.fences.items()}
        if checked:
            copy.sessions = dict(manager.sessions)
            copy.workers = frozenset(manager.workers)
            manager.index.refresh()
            index = manager.index
            copy.holder_pages = {key: n for key, n in index.ledger.usage.items() if n}
            copy.holder_rows = {key: ({state: n for state, n in states.items() if n},
                                      index.holder_sessions.get(key, 0), index.holder_slots.get(key, 0))
                                for key, states in index.holder_states.items() if any(states.values())}
            _copy_pool_totals(pool, copy)
            if swap is not None:
                kept = min(low_mark[0], len(free_slots))        # below it the stack is as it was copied
                del free_slots[kept:]                           # in place: a slice would copy every kept slot
                free_slots += swap.free_slots(kept)
                copy.swap = SwapCopy(swap.num_slots, free_slots,
                                     frozenset(swap.in_copy),
                                     {seq_id: _job_problem(manager, seq_id, job.seq, job.blocks)
                                      for seq_id, job in manager.swap_jobs.items()})
    finally:                                   # by identity: another reader's set may be equal to ours
        pool.watches[:] = [w for w in pool.watches if w is not changed_blocks]
        manager.watches[:] = [w for w in manager.watches if w is not changed_seqs]
        if swap is not None:
            swap.low_marks[:] = [m for m in swap.low_marks if m is not low_mark]


def _job_problem(manager: KvState, seq_id: int, seq: Sequence, blocks: list[int]) -> str:
    if manager.seqs.get(seq_id) is not seq or seq.state is not SeqState.PARKED:
        return f"a swap-out is in flight for sequence {seq_id}, which is not parked"
    return "" if blocks == seq.block_ids else \
        f"the swap-out of sequence {seq_id} copies other blocks than the sequence holds"


def _copy_seqs(manager: KvState, copy: StateCopy, seq_ids: list[int] | set[int]) -> None:
    live, seqs = manager.seqs, copy.seqs
    for seq_id in seq_ids:
        seq = live.get(seq_id)
        if seq is None:
            seqs.pop(seq_id, None)
        else:
            seqs[seq_id] = SeqCopy.of(seq)
