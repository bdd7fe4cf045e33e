"""What memd knows of all its sequences at once, kept as they change rather than counted when asked.

A host's memd parks hundreds of thousands of conversations. Anything that
walks them all on the event loop (a Step short of pages choosing whom to
evict, the idle-TTL tick, `Stats`, a capped Step checking its tenant's max)
delays every Step behind it by what memd holds instead of what the Step
needs. The index keeps, per sequence, the view it last counted, and from
those views:

- counts by state (and per tenant and model), swap slots held;
- each tenant's and model's pages (memd.holder_ledger);
- eviction order: PARKED sequences in heaps per (tenant, model) cell and
  retention, by heat; SWAPPED ones (unretained) in one heap, by heat;
- the idle-TTL order: PARKED, SWAPPED and sessionless DROPPED sequences by
  last access;
- the pages each holder's retention promises hold, and when each promise ends.

Heat decays by the same factor for every sequence, so its order never
changes between touches: a sequence's rank, log(heat) + heat_at x
(-log(decay) / interval), orders sequences as their heat at any later
instant does. A touch re-ranks only the sequence touched.

What changed reaches the index as the journal learns of it (the manager's
change notes: `KvState.watches`); `refresh` reads those sequences again, and
so costs what changed. Heap entries are never removed in place: a sequence
re-ranked or gone leaves a stale entry, skipped when met (its view says
what is current) and swept out when stale ones outnumber live ones.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Protocol

from memd.holder_ledger import HolderLedger
from memd.pool import BlockPool
from memd.quotas import Key
from memd.retention import holder as promise_holder
from memd.retention import pages as promise_pages
from memd.sequences import SeqState, Sequence


class Indexed(Protocol):
    """What the index reads of memd's state (memd.kv_state.KvState has it all)."""

    seqs: dict[int, Sequence]
    watches: list[set[int]]
    pool: BlockPool
    heat_decay: float
    heat_interval_s: float


Cell = tuple[int, bool]          # (ledger cell id, retained): one heap of PARKED sequences each
SWEEP_SLACK = 4096               # stale heap entries tolerated beyond the live ones


class _View:
    """A sequence as the index last counted it."""

    __slots__ = ("blocks", "cell", "heap", "last_access", "promise", "rank", "session", "slots", "state")

    def __init__(self, state: SeqState, cell: int, blocks: list[int], slots: int, session: bool) -> None:
        self.state, self.cell, self.blocks, self.slots, self.session = state, cell, blocks, slots, session
        self.heap: Cell | None = None        # the PARKED heap it is ranked in (None: swapped heap, or none)
        self.rank: float | None = None       # its rank there (or in the swapped heap)
        self.last_access: float | None = None     # its idle-TTL entry, if it has one
        self.promise: tuple[Key, int, float] | None = None      # (holder, pages, until) while retained


class SeqIndex:
    def __init__(self, state: Indexed) -> None:
        self.state = state
        self.views: dict[int, _View] = {}
        self.dirty: set[int] = set(state.seqs)
        state.watches.append(self.dirty)
        self.by_state: Counter[SeqState] = Counter()
        self.holder_states: dict[Key, Counter[str]] = {}
        self.holder_sessions: Counter[Key] = Counter()
        self.holder_slots: Counter[Key] = Counter()
        self.swapped_slots = 0
        self.ledger = HolderLedger(state.pool.num_blocks)
        self.parked: dict[Cell, list[tuple[float, int]]] = {}
        self.swapped: list[tuple[float, int]] = []
        self.idle: list[tuple[float, int]] = []
        self.retained: Counter[Key] = Counter()
        self.promises: list[tuple[float, int]] = []       # (wall-clock end, seq id)
        self.entries = 0                                  # heap entries, live or stale
        self.refreshed: set[int] | None = None            # ids read since `mark` (a Step that may roll back)
        self._slope = -math.log(state.heat_decay) / state.heat_interval_s

    # ---- keeping up -------------------------------------------------------------------------------------

    def rank(self, seq: Sequence) -> float:
        """Orders sequences as their heat does at any instant after their last touch."""
        return math.log(seq.heat) + seq.heat_at * self._slope if seq.heat > 0 else -math.inf

    def refresh(self, seq_ids: Iterable[int] | None = None) -> None:
        """Read again what changed (and `seq_ids`): promises that ended, sequences the manager noted."""
        wall = time.time()
        while self.promises and self.promises[0][0] <= wall:
            self.dirty.add(heapq.heappop(self.promises)[1])
        if seq_ids is not None:
            self.dirty.update(seq_ids)
        if not self.dirty:
            return
        changed = list(self.dirty)
        self.dirty.clear()
        if self.refreshed is not None:
            self.refreshed.update(changed)
        for seq_id in changed:
            self._reread(seq_id, wall)
        if self.entries > 2 * len(self.views) + SWEEP_SLACK:
            self._sweep()

    def mark(self) -> None:
        """A Step begins: note what is read from here on, for `settled`."""
        self.refreshed = set()

    def settled(self, rolled_back: bool) -> None:
        """The Step is over; if it rolled back, what was read during it is read again."""
        if rolled_back and self.refreshed:
            self.dirty.update(self.refreshed)
        self.refreshed = None

    def _reread(self, seq_id: int, wall: float) -> None:
        old = self.views.pop(seq_id, None)
        seq = self.state.seqs.get(seq_id)
        ledger = self.ledger
        if old is not None:
            self.by_state[old.state] -= 1
            self.swapped_slots -= old.slots
            for key in ledger.cells[old.cell]:
                self.holder_states[key][old.state.value] -= 1
                self.holder_sessions[key] -= old.session
                self.holder_slots[key] -= old.slots
            if old.promise is not None:
                self.retained[old.promise[0]] -= old.promise[1]
        if seq is None:
            if old is not None:
                ledger.remove(old.cell, old.blocks)
            return
        cell = ledger.cell(seq)
        new = seq.block_ids
        if old is not None and old.cell == cell:
            blocks = old.blocks
            if blocks != new:
                if len(new) > len(blocks) and new[:len(blocks)] == blocks:
                    ledger.add(cell, new[len(blocks):])
                else:
                    ledger.remove(cell, blocks)
                    ledger.add(cell, new)
                blocks = list(new)
        else:
            if old is not None:
                ledger.remove(old.cell, old.blocks)
            ledger.add(cell, new)
            blocks = list(new)
        view = _View(seq.state, cell, blocks, len(seq.slots), seq.session_id is not None)
        self.views[seq_id] = view
        self.by_state[seq.state] += 1
        self.swapped_slots += view.slots
        for key in ledger.cells[cell]:
            self.holder_states.setdefault(key, Counter())[seq.state.value] += 1
            self.holder_sessions[key] += view.session
            self.holder_slots[key] += view.slots
        kept = seq.retain_until > wall
        if kept:
            view.promise = (promise_holder(seq), promise_pages(seq), seq.retain_until)
            self.retained[view.promise[0]] += view.promise[1]
            if old is None or old.promise is None or old.promise[2] != seq.retain_until:
                heapq.heappush(self.promises, (seq.retain_until, seq_id))
        self._order(seq, view, old, kept)

    def _order(self, seq: Sequence, view: _View, old: _View | None, kept: bool) -> None:
        """Its entries in the eviction and idle-TTL heaps (new ones only where its place changed)."""
        state = seq.state
        if state is SeqState.PARKED and seq.block_ids:
            view.heap, view.rank = (view.cell, kept), self.rank(seq)
            if old is None or old.heap != view.heap or old.rank != view.rank:
                heapq.heappush(self.parked.setdefault(view.heap, []), (view.rank, seq.seq_id))
                self.entries += 1
        elif state is SeqState.SWAPPED and not kept:
            view.rank = self.rank(seq)
            if old is None or old.state is not SeqState.SWAPPED or old.promise is not None or old.rank != view.rank:
                heapq.heappush(self.swapped, (view.rank, seq.seq_id))
                self.entries += 1
        if state in (SeqState.PARKED, SeqState.SWAPPED) or (state is SeqState.DROPPED and seq.session_id is None):
            view.last_access = seq.last_access
            if old is None or old.last_access != seq.last_access:
                heapq.heappush(self.idle, (seq.last_access, seq.seq_id))
                self.entries += 1

    def _sweep(self) -> None:
        """Stale entries outnumber live ones: every heap rebuilt from the views (rare: amortized per change)."""
        parked: dict[Cell, list[tuple[float, int]]] = {}
        swapped, idle = [], []
        for seq_id, view in self.views.items():
            if view.heap is not None and view.rank is not None:
                parked.setdefault(view.heap, []).append((view.rank, seq_id))
            elif view.state is SeqState.SWAPPED and view.rank is not None:
                swapped.append((view.rank, seq_id))
            if view.last_access is not None:
                idle.append((view.last_access, seq_id))
        for heap in (swapped, idle, *parked.values()):
            heapq.heapify(heap)
        self.parked, self.swapped, self.idle = parked, swapped, idle
        self.entries = len(swapped) + len(idle) + sum(map(len, parked.values()))

    # ---- reading ----------------------------------------------------------------------------------------

    def is_parked_entry(self, cell: Cell, rank: float, seq_id: int) -> bool:
        view = self.views.get(seq_id)
        return view is not None and view.heap == cell and view.rank == rank

    def coldest_parked(self, cells: Iterable[Cell]) -> Iterator[Sequence]:
        """PARKED sequences of `cells`, coldest first, as current as the last `refresh`.

        Entries are popped as they are read and pushed back when the reader
        stops (close the iterator): reading the k coldest costs k log n.
        """
        heaps = {cell: self.parked[cell] for cell in cells if self.parked.get(cell)}
        front = [(heap[0][0], heap[0][1], cell) for cell, heap in heaps.items()]
        heapq.heapify(front)
        taken: list[tuple[Cell, tuple[float, int]]] = []
        seqs = self.state.seqs
        try:
            while front:
                _, _, cell = front[0]
                heap = heaps[cell]
                entry = heapq.heappop(heap)
                if heap:
                    heapq.heapreplace(front, (heap[0][0], heap[0][1], cell))
                else:
                    heapq.heappop(front)
                if not self.is_parked_entry(cell, *entry):
                    self.entries -= 1
                    continue
                taken.append((cell, entry))
                seq = seqs.get(entry[1])
                if seq is not None:
                    yield seq
        finally:
            for cell, entry in taken:
                heapq.heappush(self.parked[cell], entry)

    def coldest_swapped(self) -> Iterator[Sequence]:
        """Unretained SWAPPED sequences, coldest first (popped as read, pushed back when the reader stops)."""
        taken: list[tuple[float, int]] = []
        seqs, views, heap = self.state.seqs, self.views, self.swapped
        try:
            while heap:
                entry = heapq.heappop(heap)
                view = views.get(entry[1])
                if view is None or view.state is not SeqState.SWAPPED or view.rank != entry[0] \
                        or view.promise is not None:
                    self.entries -= 1
                    continue
                taken.append(entry)
                seq = seqs.get(entry[1])
                if seq is not None:
                    yield seq
        finally:
            for entry in taken:
                heapq.heappush(heap, entry)

    def idle_since(self, before: float) -> list[Sequence]:
        """Sequences the idle TTL may take, last touched before `before` (monotonic); their entries go."""
        out, seqs, views, heap = [], self.state.seqs, self.views, self.idle
        while heap and heap[0][0] < before:
            at, seq_id = heapq.heappop(heap)
            self.entries -= 1
            view = views.get(seq_id)
            if view is None or view.last_access != at:
                continue
            view.last_access = None             # out of the heap: read again (and queued again) if it changes
            seq = seqs.get(seq_id)
            if seq is not None:
                out.append(seq)
        return out

    def requeue_idle(self, seq: Sequence, at: float) -> None:
        """Look at `seq` again for the idle TTL at `at` (a promise keeps it until then)."""
        view = self.views.get(seq.seq_id)
        if view is not None:
            view.last_access = at
            heapq.heappush(self.idle, (at, seq.seq_id))
            self.entries += 1

    def cells(self) -> list[Cell]:
        return list(self.parked)

    def state_counts(self) -> dict[str, int]:
        return {state.value: self.by_state[state] for state in SeqState}

    def retained_pages(self, key: Key, without: Sequence | None = None) -> int:
        """The pages `key`'s sessions under a promise hold (but `without`'s), as of the last `refresh`."""
        held = self.retained[key]
        view = self.views.get(without.seq_id) if without is not None else None
        if view is not None and view.promise is not None and view.promise[0] == key:
            held -= view.promise[1]
        return held
