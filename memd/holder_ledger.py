"""Each tenant's and model's pool pages, kept as sequences take and let go of pages.

A holder's usage is the number of distinct pages its sequences hold: a page
two of its sequences share counts once, a page two tenants share counts for
each (memd.quotas). Counting it from the sequences costs every page memd
holds, per capped Step; this ledger keeps it exact at the cost of the pages
that changed.

A sequence belongs to one cell, its (tenant, model) pair, and so to the
holders of that cell (memd.quotas.counted_for: a sequence of no tenant counts
for NO_TENANT, which memctl tenants shows and no quota caps). Per page the ledger keeps which
cells' sequences hold it: almost every page is held by one sequence, so a
dense array names that cell (2 bytes a page); a page several sequences hold
(a shared system prompt, forks) gets a count per cell in a small dict. A
holder's usage moves when a page gains its first holder of that holder's,
or loses its last.

`memd.seq_index` feeds it from what changed; `memctl check` compares it with
a count from the sequences' tables (memd.invariants).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable

from memd.quotas import Key, counted_for, keys_of
from memd.sequences import Sequence

MANY = 0xFFFF                  # in `sole`: several sequences hold the page (their cells are in `many`)
MAX_CELLS = MANY - 1           # cell ids 0 .. MAX_CELLS-1 fit `sole` beside 0 (no holder) and MANY


class TooManyCells(Exception):
    """More (tenant, model) pairs than a page's holder field can name."""


class HolderLedger:
    __slots__ = ("_cell_ids", "cells", "many", "sole", "usage")

    def __init__(self, num_blocks: int) -> None:
        self.sole = array("H", bytes(2 * num_blocks))      # cell id + 1 of the one sequence holding it; 0: none
        self.many: dict[int, Counter[int]] = {}            # page -> sequences holding it, per cell
        self.cells: list[tuple[Key, ...]] = []             # cell id -> the holders its sequences count for
        self._cell_ids: dict[tuple[str, str], int] = {}
        self.usage: Counter[Key] = Counter()

    def cell(self, seq: Sequence) -> int:
        """The cell id of a sequence's (tenant, model)."""
        pair = (seq.tenant, seq.model)
        found = self._cell_ids.get(pair)
        if found is None:
            if len(self.cells) >= MAX_CELLS:
                raise TooManyCells(f"more than {MAX_CELLS} (tenant, model) pairs")
            found = self._cell_ids[pair] = len(self.cells)
            self.cells.append(counted_for(seq))
        return found

    def add(self, cell: int, blocks: Iterable[int]) -> None:
        sole, usage, keys = self.sole, self.usage, self.cells[cell]
        mark = cell + 1
        for block in blocks:
            held = sole[block]
            if not held:
                sole[block] = mark
                for key in keys:
                    usage[key] += 1
                continue
            if held != MANY:
                counts = self.many[block] = Counter({held - 1: 1})
                sole[block] = MANY
            else:
                counts = self.many[block]
            present = self._keys_in(counts)
            counts[cell] += 1
            for key in keys:
                if key not in present:
                    usage[key] += 1

    def remove(self, cell: int, blocks: Iterable[int]) -> None:
        """A page it does not hold for that cell is passed over (memctl check names the holder gone wrong)."""
        sole, usage, keys = self.sole, self.usage, self.cells[cell]
        mark = cell + 1
        for block in blocks:
            held = sole[block]
            if held == mark:
                sole[block] = 0
                for key in keys:
                    usage[key] -= 1
                continue
            counts = self.many.get(block) if held == MANY else None
            if counts is None or not counts.get(cell):
                continue
            counts[cell] -= 1
            if not counts[cell]:
                del counts[cell]
            present = self._keys_in(counts)
            for key in keys:
                if key not in present:
                    usage[key] -= 1
            if sum(counts.values()) == 1:
                (only,) = counts
                sole[block] = only + 1
                del self.many[block]

    def _keys_in(self, counts: Counter[int]) -> set[Key]:
        cells = self.cells
        return {key for cell in counts for key in cells[cell]}

    def count(self, key: Key, block: int) -> int:
        """How many of `key`'s sequences hold `block`."""
        held = self.sole[block]
        if not held:
            return 0
        if held != MANY:
            return 1 if key in self.cells[held - 1] else 0
        cells = self.cells
        return sum(n for cell, n in self.many[block].items() if key in cells[cell])


class Going:
    """Holders' pages as if the sequences `take`n so far had gone: an eviction walk's view over the ledger.

    Only holders with a quota are followed (`keys`): the others have nothing to keep or to pass.
    """

    __slots__ = ("gone", "keys", "ledger", "taken")

    def __init__(self, ledger: HolderLedger, keys: Iterable[Key]) -> None:
        self.ledger, self.keys = ledger, set(keys)
        self.gone: Counter[Key] = Counter()            # pages each holder stops holding
        self.taken: dict[Key, Counter[int]] = {}       # per holder: of its sequences taken, how many hold a page

    def usage(self, key: Key) -> int:
        return self.ledger.usage[key] - self.gone[key]

    def gain(self, key: Key, seq: Sequence) -> int:
        """Pages `key` stops holding if `seq` goes too: those none of its other remaining sequences hold."""
        taken, count = self.taken.get(key, Counter()), self.ledger.count
        return sum(1 for block in set(seq.block_ids) if count(key, block) - taken[block] == 1)

    def take(self, seq: Sequence) -> None:
        count = self.ledger.count
        for key in keys_of(seq):
            if key not in self.keys:
                continue
            taken = self.taken.setdefault(key, Counter())
            for block in set(seq.block_ids):
                taken[block] += 1
                if taken[block] == count(key, block):
                    self.gone[key] += 1
