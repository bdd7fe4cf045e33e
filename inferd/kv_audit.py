"""Proof, pass by pass, that the K/V a running sequence reads is the K/V it wrote (`inferd serve --audit-kv`).

The pool is shared memory that other processes write: memd zeroes and
copies pages, other workers write theirs. A bookkeeping bug anywhere (a page
handed out twice, a late effect, a reclaimed worker's late pass) shows up as
answers that are wrong for no visible reason. With the audit on, each position a
sequence writes gets a fingerprint (an exact integer hash of its bytes in
every layer), and before every pass the positions the pass will read are hashed
again: one that changed under a running sequence fails its turn with the
sequence, position and page named, instead of answering from it. Slots a
sequence found written (prefix hits, swap-ins, a resumed session) are taken
as they are when it first runs here.

It reads every context position once more per pass: for tests and investigations,
not for production serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Tampered:
    position: int
    block: int
    offset: int

    def __str__(self) -> str:
        return f"the K/V of position {self.position} (page {self.block}, slot {self.offset}) changed under it"


class KvAudit:
    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv                          # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
        self.block_size = kv.shape[3]
        width = kv[0, :, :, 0].numel()
        generator = torch.Generator().manual_seed(0x6B76)
        self._weights = torch.randint(1, 2**31 - 1, (width,), generator=generator, dtype=torch.int64).to(kv.device)
        self._prints: dict[int, torch.Tensor] = {}       # per sequence key: one hash per written position

    def _hash(self, table: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[positions // self.block_size]
        slots = self.kv[blocks.to(self.kv.device), :, :, (positions % self.block_size).to(self.kv.device)]
        raw = slots.reshape(end - start, -1)
        ints = raw.view(torch.int16 if raw.element_size() == 2 else torch.int32).to(torch.int64)
        return (ints * self._weights).sum(dim=1).cpu()      # wraps on overflow: still exact and deterministic

    def check(self, key: int, table: list[int], written: int) -> Tampered | None:
        """Before a pass: the first of positions [0, written) whose bytes changed since recorded."""
        known = self._prints.get(key)
        if known is None or len(known) > written:
            self._prints[key] = self._hash(table, 0, written) if written else torch.empty(0, dtype=torch.int64)
            return None
        if not len(known):
            return None
        changed = (self._hash(table, 0, len(known)) != known).nonzero()
        if not len(changed):
            return None
        position = int(changed[0])
        return Tampered(position, table[position // self.block_size], position % self.block_size)

    def record(self, key: int, table: list[int], start: int, end: int) -> None:
        """After a pass: positions [start, end) were written by it."""
        known = self._prints.get(key, torch.empty(0, dtype=torch.int64))
        if len(known) != start:               # a gap (a table that changed): take everything as it is now
            self._prints[key] = self._hash(table, 0, end)
            return
        self._prints[key] = torch.cat([known, self._hash(table, start, end)])

    def forget(self, key: int) -> None:
        """The sequence's table changed hands or ended: its positions are no longer this worker's to vouch for."""
        self._prints.pop(key, None)
