"""A sequence's block table: the list of pool blocks memd handed out, with the same ids kept as a tensor.

A forward pass reads its sequences' K/V through their tables, as one padded
int64 tensor. Converting every table from Python ints at every decode step
costs time in proportion to the context, on the forward thread. A
`BlockTable` keeps its ids in a tensor as well, grown by the ids appended
since it was last read (`ids`), so a step's batch is built from the tensors
in a few ops (`padded_tables`) whatever the context.

A table is a list, and a worker's code treats it as one. The tensor is
trusted up to `_valid` entries: appending leaves those as they are, and
every other change (an entry set, entries deleted or reordered) lowers
`_valid` to where the change began, under the lock that `ids` takes. A
plain list works wherever a table is read; it is converted whole.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any, SupportsIndex

import torch
from torch.nn.utils.rnn import pad_sequence

# Below this many entries in all, converting the lists at once is cheaper than the tensor ops per table:
# a conversion costs per entry, the tensor ops a fixed amount per table.
FEW_ENTRIES = 1024


class BlockTable(list[int]):
    __slots__ = ("_buf", "_lock", "_valid")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        super().__init__(ids)
        self._buf = torch.empty(0, dtype=torch.long)
        self._valid = 0
        # The forward thread reads a table (a pass run ahead) while the event loop may change it.
        self._lock = threading.Lock()

    def ids(self) -> torch.Tensor:
        """The table as a CPU int64 tensor (a view, good until the table changes)."""
        with self._lock:
            n, valid = len(self), self._valid
            if valid < n:
                if n > self._buf.numel():
                    grown = torch.empty(max(n, 2 * self._buf.numel(), 16), dtype=torch.long)
                    grown[:valid] = self._buf[:valid]
                    self._buf = grown
                self._buf[valid:n] = torch.tensor(list.__getitem__(self, slice(valid, n)), dtype=torch.long)
                self._valid = n
            return self._buf[:n]

    def __reduce__(self) -> tuple[type[BlockTable], tuple[list[int]]]:
        return BlockTable, (list(self),)          # a copy gets a tensor of its own

    def _start(self, key: SupportsIndex | slice) -> int:
        """The first entry a change at `key` can touch (0 when unsure)."""
        if isinstance(key, slice):
            return key.indices(len(self))[0] if key.step in (None, 1) else 0
        index = key.__index__()
        return max(index + len(self) if index < 0 else index, 0)

    def __setitem__(self, key: Any, value: Any) -> None:
        with self._lock:
            self._valid = min(self._valid, self._start(key))
            super().__setitem__(key, value)

    def __delitem__(self, key: SupportsIndex | slice) -> None:
        with self._lock:
            self._valid = min(self._valid, self._start(key))
            super().__delitem__(key)

    def insert(self, index: SupportsIndex, value: int) -> None:
        with self._lock:
            self._valid = min(self._valid, self._start(index))
            super().insert(index, value)

    def pop(self, index: SupportsIndex = -1) -> int:
        with self._lock:
            self._valid = min(self._valid, self._start(index))
            return super().pop(index)

    def remove(self, value: int) -> None:
        with self._lock:
            self._valid = 0
            super().remove(value)

    def clear(self) -> None:
        with self._lock:
            self._valid = 0
            super().clear()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self._valid = 0
            super().sort(*args, **kwargs)

    def reverse(self) -> None:
        with self._lock:
            self._valid = 0
            super().reverse()

    def __imul__(self, count: SupportsIndex) -> BlockTable:   # type: ignore[override,misc]
        with self._lock:
            self._valid = 0
            super().__imul__(count)
        return self


def padded_tables(tables: Sequence[list[int]], counts: list[int]) -> torch.Tensor:
    """[B, max(counts)] int64: the first `counts[i]` ids of each table, padded with its own first id (any
    valid block serves: a mask hides the padding, and a block of its own holds nothing another wrote)."""
    if sum(counts) < FEW_ENTRIES or not all(isinstance(t, BlockTable) for t in tables):
        width = max(counts)
        return torch.tensor([t[:n] + [t[0]] * (width - n) for t, n in zip(tables, counts, strict=True)],
                            dtype=torch.long)
    rows = [t.ids()[:n] for t, n in zip(tables, counts, strict=True)]   # type: ignore[union-attr]
    out = pad_sequence(rows, batch_first=True, padding_value=-1)
    return torch.where(out < 0, out[:, :1], out)
