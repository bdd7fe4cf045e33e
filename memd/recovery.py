"""What a restarted memd makes of the journal it found: sequences to adopt, pages still fenced.

Never trusts a record. What comes back, and how:
- PARKED sequences keep their pages and resume with no recompute.
- SWAPPED ones keep their swap slots (the swap tier is a file too).
- RUNNING ones (their worker lost memd mid-request) are parked at their
  committed length, as a worker crash would park them, and marked
  interrupted: the client's retry of that turn replaces it (StepTxn._retry_turn).
- A sequence whose pages memd was still filling (a swap-in or a page's copy
  in flight), or whose pages or slots cannot be reopened (a new pool size, a
  cuda pool, a changed swap ratio), comes back DROPPED: its token ids stay, so
  a resume recomputes it and still answers the same.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from memd.journal import (
    BLOCK_SIZE,
    BLOCK_SUMS,
    BLOCKS,
    COMMITTED,
    HEAT,
    HEAT_AT,
    LAST_ACCESS,
    MID_TURN,
    MODEL,
    OWNER_PID,
    PENDING,
    RETAIN_UNTIL,
    SALT,
    SESSION,
    SLOT_SUMS,
    SLOTS,
    STATE,
    TENANT,
    TOKENS,
    TURN_ID,
    TURN_START,
    Recovered,
)
from memd.sequences import SeqState, Sequence, blocks_for


@dataclass(slots=True)
class Restored:
    """What recovery made of the records; logged at start-up."""

    sequences: list[Sequence] = field(default_factory=list)
    fences: dict[int, list[int]] = field(default_factory=dict)    # pid -> pages its late writes may reach
    by_state: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)       # reason -> sequences that came back DROPPED
    discarded: int = 0                                          # records that made no sense
    slot_checksums: dict[int, int] = field(default_factory=dict)   # swap slot -> what its swap-out wrote
    block_checksums: dict[int, int] = field(default_factory=dict)  # page -> what its worker committed
    # Sequences kept otherwise than their record says (parked, dropped): the journal resumed must say so
    # (memd.journal.WriteAheadLog.resume).
    changed: set[int] = field(default_factory=set)


def restore(found: Recovered, *, pool_kept: bool, swap_kept: bool, num_blocks: int, num_slots: int) -> Restored:
    """Sequences to adopt from the records: checked, RUNNING ones parked, unusable ones DROPPED.

    Never trusts a record: a block or slot out of range, a slot claimed twice,
    a table that does not fit the committed length all demote the sequence to
    DROPPED (token ids only), and a record that makes no sense is skipped.
    """
    recovery = _Recovery(pool_kept, swap_kept, num_blocks, num_slots,
                         {pid: list(blocks) for pid, blocks in found.fences.items()} if pool_kept else {})
    for seq_id in sorted(found.records):
        recovery.add(seq_id, found.records[seq_id])
    return recovery.finish()


class _Recovery:
    """The checks that span records: pages and slots claimed once, one sequence per session, late writers."""

    def __init__(self, pool_kept: bool, swap_kept: bool, num_blocks: int, num_slots: int,
                 late: dict[int, list[int]]) -> None:
        self.pool_kept, self.swap_kept, self.num_blocks, self.num_slots = pool_kept, swap_kept, num_blocks, num_slots
        self.out = Restored()
        self.slots_taken: set[int] = set()
        self.full_blocks: set[int] = set()       # shareable: full committed blocks of some sequence
        self.writable_blocks: set[int] = set()   # a sequence's partial last block: its own
        self.sessions: dict[str, Sequence] = {}
        self.late = late                         # pid -> pages a worker alive before may still write

    def add(self, seq_id: int, record: list) -> None:
        parsed = _parse(seq_id, record)
        if parsed is None:
            self.out.discarded += 1
            return
        seq, owner_pid = parsed
        # Taken before a running sequence's table is cut back to what it committed.
        sums = dict(zip(seq.block_ids, _checksums(record, BLOCK_SUMS, len(seq.block_ids)), strict=False))
        if seq.interrupted and seq.session_id is None:
            if owner_pid > 0 and self.pool_kept:   # only its worker knew it; what that worker may still write
                self.late.setdefault(owner_pid, []).extend(seq.block_ids[seq.num_full_blocks:])
            return
        if seq.state is SeqState.RUNNING:
            self._park_running(seq, owner_pid)
        if seq.state is not SeqState.SWAPPED and seq.slots:
            seq.slots = []
            self.out.changed.add(seq_id)
        if record[PENDING]:
            self._drop(seq, "pages being filled when memd stopped")
        elif seq.state is SeqState.PARKED:
            self._check_pages(seq, sums)
        elif seq.state is SeqState.SWAPPED:
            self._check_slots(seq, record)
        elif seq.state is SeqState.DROPPED and (seq.block_ids or seq.num_committed):
            seq.block_ids, seq.slots, seq.num_committed = [], [], 0
            self.out.changed.add(seq_id)
        if seq.session_id:
            earlier = self.sessions.get(seq.session_id)
            if earlier is not None:            # cannot happen; keep the newer sequence
                self.out.sequences.remove(earlier)     # (a scan of the list, for a journal that is wrong)
                self.out.discarded += 1
            self.sessions[seq.session_id] = seq
        self.out.sequences.append(seq)

    def _park_running(self, seq: Sequence, owner_pid: int) -> None:
        """Its worker lost memd mid-turn: parked at its committed length, as a worker crash parks it."""
        needed = blocks_for(seq.num_committed, seq.block_size)
        if owner_pid > 0 and self.pool_kept:       # as KvManager.reclaim fences: its whole blocks stay
            seq.num_committed -= seq.num_committed % seq.block_size
            needed = seq.num_full_blocks
            self.late.setdefault(owner_pid, []).extend(seq.block_ids[needed:])
        seq.state, seq.block_ids = SeqState.PARKED, seq.block_ids[:needed]
        self.out.changed.add(seq.seq_id)

    def _check_pages(self, seq: Sequence, sums: dict[int, int]) -> None:
        """A PARKED table must fit the reopened pool and share only full blocks with others.

        Its pages' checksums come back too (older journals have none): memd
        checks the reopened pages against them before it serves.
        """
        needed = blocks_for(seq.num_committed, seq.block_size)
        if not self.pool_kept:
            self._drop(seq, "pool not reopened")
        elif len(seq.block_ids) != needed or len(set(seq.block_ids)) != needed \
                or any(not 0 <= b < self.num_blocks for b in seq.block_ids):
            self._drop(seq, "block table does not fit the pool")
        else:
            full = seq.block_ids[:seq.num_full_blocks]
            tail = set(seq.block_ids[seq.num_full_blocks:])
            # Each page against the pages seen so far, not a union of them per sequence: linear in the journal.
            if not self.writable_blocks.isdisjoint(full) or not tail.isdisjoint(self.full_blocks) \
                    or not tail.isdisjoint(self.writable_blocks):
                self._drop(seq, "block table clashes with another sequence's")
            else:
                self.full_blocks.update(full)
                self.writable_blocks.update(tail)
                for block in seq.block_ids:
                    if sums.get(block):
                        self.out.block_checksums.setdefault(block, sums[block])

    def _check_slots(self, seq: Sequence, record: list) -> None:
        """A SWAPPED sequence's slots must fit the reopened swap tier, each claimed once.

        Their checksums come back too (older journals have none): a swap-in checks the pages against them.
        """
        needed = blocks_for(seq.num_committed, seq.block_size)
        if not self.swap_kept:
            self._drop(seq, "swap tier not reopened")
        elif len(seq.slots) != needed or any(not 0 <= s < self.num_slots or s in self.slots_taken for s in seq.slots) \
                or len(set(seq.slots)) != needed or seq.block_ids:
            self._drop(seq, "swap slots do not fit the swap tier")
        else:
            self.slots_taken.update(seq.slots)
            self.out.slot_checksums.update(zip(seq.slots, _checksums(record, SLOT_SUMS, len(seq.slots)), strict=False))

    def _drop(self, seq: Sequence, reason: str) -> None:
        seq.state, seq.block_ids, seq.slots, seq.num_committed = SeqState.DROPPED, [], [], 0
        self.out.changed.add(seq.seq_id)
        self.out.dropped[reason] = self.out.dropped.get(reason, 0) + 1

    def finish(self) -> Restored:
        """Count by state, and fence again the pages a worker alive before may still write (none held)."""
        out = self.out
        for seq in out.sequences:
            out.by_state[seq.state.value] = out.by_state.get(seq.state.value, 0) + 1
        held = {b for seq in out.sequences for b in seq.block_ids}
        for pid, blocks in self.late.items():
            fenced = [b for b in dict.fromkeys(blocks) if 0 <= b < self.num_blocks and b not in held]
            held.update(fenced)
            if fenced:
                out.fences[pid] = fenced
        return out


def _checksums(record: list, field: int, count: int) -> list[int]:
    """The record's `count` checksums at `field`; none when absent (an older journal) or not what they should be."""
    sums = record[field] if len(record) > field else []
    if isinstance(sums, list) and len(sums) == count and all(isinstance(c, int) and 0 <= c < 2**64 for c in sums):
        return sums
    return []


def _parse(seq_id: int, r: list) -> tuple[Sequence, int] | None:
    """The sequence a record describes and the pid of the worker running it (0: none); None if it makes no sense."""
    try:
        seq = Sequence(seq_id, str(r[MODEL]), int(r[BLOCK_SIZE]), None, SeqState(r[STATE]),
                       [int(b) for b in r[BLOCKS]], int(r[COMMITTED]), array("I", r[TOKENS]),
                       session_id=r[SESSION] or None, last_access=float(r[LAST_ACCESS]),
                       heat=float(r[HEAT]), heat_at=float(r[HEAT_AT]), slots=[int(s) for s in r[SLOTS]],
                       turn_start=int(r[TURN_START]), interrupted=bool(r[MID_TURN]),
                       turn_id=r[TURN_ID] if len(r) > TURN_ID else "", salt=r[SALT] if len(r) > SALT else "",
                       tenant=r[TENANT] if len(r) > TENANT else "",
                       retain_until=float(r[RETAIN_UNTIL]) if len(r) > RETAIN_UNTIL else 0.0)
        if not isinstance(r[MODEL], str) or not isinstance(r[SESSION], str | None) \
                or not isinstance(seq.turn_id, str) or not isinstance(seq.salt, str) or not isinstance(seq.tenant, str):
            raise TypeError("model, session, turn id, salt and tenant must be strings")
    except Exception:        # any record that makes no sense is skipped
        return None
    # (Token ids out of uint32's range never got here: the array("I") above refused them.)
    if seq.block_size <= 0 or not 0 <= seq.num_committed <= len(seq.token_ids) \
            or not 0 <= seq.turn_start <= len(seq.token_ids):
        return None
    return seq, int(r[OWNER_PID]) if seq.state is SeqState.RUNNING else 0
