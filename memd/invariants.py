"""What must always hold between pages, swap slots, block tables and workers.

`memctl check` and the property tests call `violations`: an empty list means
no block is leaked or double-owned, every ref count matches the tables that
name the block, and every swap slot is free, held by one SWAPPED sequence, or
owned by exactly one copy in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memd.sequences import SeqState, Sequence, blocks_for

if TYPE_CHECKING:
    from memd.manager import KvManager


def violations(m: KvManager) -> list[str]:
    """Every broken invariant, as sentences an operator can act on."""
    problems = m.pool.violations()
    refs = [0] * m.pool.num_blocks
    for seq in m.seqs.values():
        problems += _seq_violations(m, seq)
        for block in seq.block_ids:
            if 0 <= block < len(refs):
                refs[block] += 1
    for pid, blocks in m.fences.items():
        for block in blocks:
            if not 0 <= block < len(refs) or refs[block]:
                problems.append(f"block {block} is fenced for pid {pid} but also held by a sequence or twice")
            else:
                refs[block] += 1
    for block, (counted, actual) in enumerate(zip(refs, m.pool.ref, strict=True)):
        if counted != actual:
            problems.append(f"block {block} has ref count {actual} but {counted} table reference(s)")
    for session, seq_id in m.sessions.items():
        seq = m.seqs.get(seq_id)
        if seq is None or seq.session_id != session:
            problems.append(f"session {session!r} maps to sequence {seq_id}, which is not its sequence")
    return problems + _swap_violations(m)


def _seq_violations(m: KvManager, seq: Sequence) -> list[str]:
    out, name = [], f"sequence {seq.seq_id}"
    running = seq.state is SeqState.RUNNING
    swapped = seq.state is SeqState.SWAPPED
    if running != (seq.owner is not None):
        out.append(f"{name} is {seq.state} with owner {seq.owner}")
    if running and seq.owner not in m.workers:
        out.append(f"{name} runs on worker {seq.owner}, which holds no lease")
    capacity = len(seq.slots) * seq.block_size if swapped else seq.capacity
    if not 0 <= seq.num_committed <= min(len(seq.token_ids), capacity):
        out.append(f"{name} commits {seq.num_committed} of {len(seq.token_ids)} tokens with {capacity} slots")
    needed = blocks_for(seq.num_committed, seq.block_size)
    held = len(seq.slots) if swapped else len(seq.block_ids)
    if not running and held != needed:
        out.append(f"{name} is {seq.state} with {held} pages for {needed} committed")
    if swapped and seq.block_ids:
        out.append(f"{name} is swapped but still holds device blocks")
    if not swapped and seq.slots:
        out.append(f"{name} is {seq.state} but holds swap slots")
    if len(seq.hashes) != seq.num_full_blocks:
        out.append(f"{name} has {len(seq.hashes)} block hashes for {seq.num_full_blocks} full blocks")
    if len(set(seq.block_ids)) != len(seq.block_ids):
        out.append(f"{name} lists a block twice")
    for index, block in enumerate(seq.block_ids):
        if not 0 <= block < m.pool.num_blocks:
            out.append(f"{name} references block {block}, outside the pool")
        elif m.pool.ref[block] > 1 and index >= seq.num_full_blocks:
            out.append(f"{name} shares block {block}, which it may still write")
        elif running and index >= seq.num_full_blocks and m.pool.checksum[block]:
            out.append(f"{name} may still write block {block}, which carries a checksum")
    if seq.session_id is not None and m.sessions.get(seq.session_id) != seq.seq_id:
        out.append(f"{name} names session {seq.session_id!r}, which maps elsewhere")
    return out


def _swap_violations(m: KvManager) -> list[str]:
    out: list[str] = []
    for seq_id, job in m.swap_jobs.items():
        if m.seqs.get(seq_id) is not job.seq or job.seq.state is not SeqState.PARKED:
            out.append(f"a swap-out is in flight for sequence {seq_id}, which is not parked")
        elif job.blocks != job.seq.block_ids:
            out.append(f"the swap-out of sequence {seq_id} copies other blocks than the sequence holds")
    if m.swap is None:
        if any(seq.slots for seq in m.seqs.values()):
            out.append("a sequence holds swap slots, but swap is disabled")
        return out
    owners: dict[int, str] = {}

    def claim(slot: int, owner: str) -> None:
        if not 0 <= slot < m.swap.num_slots:          # type: ignore[union-attr]
            out.append(f"swap slot {slot} of {owner} is outside the swap tier")
        elif slot in owners:
            out.append(f"swap slot {slot} is held by {owners[slot]} and by {owner}")
        else:
            owners[slot] = owner

    for seq in m.seqs.values():
        for slot in seq.slots:
            claim(slot, f"sequence {seq.seq_id}")
    for slot in m.swap.in_copy:
        claim(slot, "a copy in flight")
    for slot in m.swap.free_slots():
        claim(slot, "the free list")
    if len(owners) != m.swap.num_slots:
        out.append(f"{m.swap.num_slots - len(owners)} swap slot(s) are neither free nor held: leaked")
    return out
