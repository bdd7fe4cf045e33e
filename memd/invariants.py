"""What must always hold between pages, swap slots, block tables and workers.

`memctl check` and the property tests call `violations`: an empty list means
no block is leaked or double-owned, every ref count matches the tables that
name the block, and every swap slot is free, held by one SWAPPED sequence, or
owned by exactly one copy in flight.

The rules are checked on a copy of one instant (memd.state_copy), a slice at
a time: memd's Check takes the copy and checks it between Steps
(`violations_between_steps`), so a check of a million blocks (a quarter of a
second of Python) never holds a worker's Step; the tests check at once.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from memd import state_copy
from memd.collector import collections_paused
from memd.quotas import NO_TENANT, Key, counted_for
from memd.sequences import blocks_for
from memd.state_copy import SeqCopy, StateCopy

if TYPE_CHECKING:
    from memd.kv_state import KvState
    from memd.pool import BlockPool

# Where the check may let Steps run (it does once it has held the loop a millisecond: state_copy.Pacer):
SLICE = 128                 # every this many blocks, queue links or swap slots checked
SEQ_SLICE = 64              # sequences
SESSION_SLICE = 512         # sessions, or sequences' swap slots, looked up


def violations(m: KvState) -> list[str]:
    """Every broken invariant, as sentences an operator can act on (checked at once)."""
    problems: list[str] = []
    for _ in _manager_rules(state_copy.take_now(m, checked=True), m.pool, problems):
        pass
    return problems


async def violations_between_steps(m: KvState) -> list[str]:
    """As `violations`, of one instant, checked a slice at a time while Steps go on."""
    problems: list[str] = []
    with collections_paused():                  # the copy's rows would set off a full collection
        copy, pacer = await state_copy.take(m, checked=True), state_copy.Pacer()
        for _ in _manager_rules(copy, m.pool, problems):
            await pacer.checkpoint()
        pacer.held()
        await copy.drop()                       # a slice at a time: dropped at once, 10k sequences held the loop
    return problems


def pool_violations(pool: BlockPool) -> list[str]:
    """The pool's own rules: ref counts, free queue, prefix index."""
    problems: list[str] = []
    for _ in _pool_rules(state_copy.pool_now(pool), pool, problems):
        pass
    return problems


def _pool_rules(c: StateCopy, pool: BlockPool, out: list[str]) -> Iterator[None]:
    """The free queue holds exactly the blocks of ref count 0, once each, linked both ways; the prefix index
    and the blocks' hashes agree. `pool` is only read when the index holds more hashes than blocks carry."""
    blocks, end = c.blocks, c.num_blocks
    assert blocks is not None
    # Blocks the walk met (a set of a million ints would be walked by the garbage collector at every pass).
    seen, walked = bytearray(end), 0
    node, steps = c.queue_ends[0], 0
    while node != end and steps <= c.queue_len:          # the walk, on the copy: it stays as it was
        if not 0 <= node < end:
            out.append(f"the free queue links to {node}, which is not a block")
            break
        if seen[node]:
            out.append(f"block {node} is in the free queue twice")
        else:
            seen[node], walked = 1, walked + 1
        node, steps = blocks.value(blocks.next, node), steps + 1
        if steps % SLICE == 0:
            yield
    if walked != c.queue_len:
        out.append(f"free queue holds {walked} blocks but counts {c.queue_len}")
    mapped = 0                                           # blocks carrying a hash the index maps to them
    for start, at, lo, hi in _slices(blocks.slice, end):
        refs, prevs, cached, hash_ok = blocks.ref[at], blocks.prev[at], blocks.cached[at], blocks.hash_ok[at]
        for i in range(lo, hi):
            ref, block = refs[i], start + i
            queued = bool(seen[block])
            if (prevs[i] >= 0) != queued:
                out.append(f"block {block} is {'' if queued else 'not '}in the free queue but marked otherwise")
            if ref < 0:
                out.append(f"block {block} has negative ref count {ref}")
            if (ref == 0) != queued:
                out.append(f"block {block} has ref count {ref} but is {'in' if queued else 'not in'} the free queue")
            if not hash_ok[i]:
                out.append(f"block {block} carries a hash the prefix index does not map to it")
        mapped += sum(map(operator.and_, cached[lo:hi], hash_ok[lo:hi]))
        yield
    if c.num_hashed != mapped:
        # Entries no block carries. Rare, and only on a broken pool: named from the index as it is now.
        strays = [block for digest, block in list(pool.by_hash.items()) if pool.hash_of[block] != digest]
        out += [f"prefix index maps a hash to block {block}, which carries another" for block in strays] or \
            [f"the prefix index holds {c.num_hashed} hashes, {mapped} of them carried by the block they name"]


def _holder(key: Key) -> str:
    return "the sequences of no tenant" if key == NO_TENANT else f"{key[0]} {key[1]!r}"


def _row(states: dict[str, int], sessions: int, slots: int) -> str:
    shown = ", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "no sequence"
    return f"{shown}; {sessions} session(s), {slots} swap slot(s)"


def _slices(per_array: int, num_blocks: int) -> Iterator[tuple[int, int, int, int]]:
    """(first block of the array, array index, from, to): SLICE blocks at a time of a BlockCopy's arrays."""
    for start in range(0, num_blocks, per_array):
        size = min(per_array, num_blocks - start)
        for lo in range(0, size, SLICE):
            yield start, start // per_array, lo, min(lo + SLICE, size)


def _manager_rules(c: StateCopy, pool: BlockPool, out: list[str]) -> Iterator[None]:
    yield from _pool_rules(c, pool, out)
    blocks = c.blocks
    assert blocks is not None
    # Per block, the sequences and fences naming it. Flat, not a dict: growing a dict of a million
    # blocks rehashes it whole, tens of milliseconds in one go.
    counted = bytearray(8 * c.num_blocks)
    tables = memoryview(counted).cast("q")
    held: dict[Key, set[int]] = {}        # per tenant and model: the pages its sequences hold
    rows: dict[Key, tuple[Counter[str], list[int]]] = {}     # and its sequences by state, [sessions, swap slots]
    for n, seq in enumerate(c.seqs.values(), 1):
        out += _seq_rules(c, seq)
        for block in seq.block_ids:
            if 0 <= block < c.num_blocks:                 # one outside the pool: _seq_rules names it
                tables[block] += 1
        for key in counted_for(seq):
            if seq.block_ids:
                held.setdefault(key, set()).update(seq.block_ids)
            states, counts = rows.setdefault(key, (Counter(), [0, 0]))
            states[seq.state] += 1
            counts[0] += seq.has_session
            counts[1] += len(seq.slots)
        if n % SEQ_SLICE == 0:
            yield
    for key in sorted(set(held) | set(c.holder_pages)):
        if len(held.get(key, ())) != c.holder_pages.get(key, 0):
            out.append(f"{_holder(key)} is counted at {c.holder_pages.get(key, 0)} pages, but its sequences "
                       f"hold {len(held.get(key, ()))}")
    for key in sorted(set(rows) | set(c.holder_rows)):
        states, (sessions, slots) = rows.get(key, (Counter(), [0, 0]))
        kept = c.holder_rows.get(key, ({}, 0, 0))
        if (dict(states), sessions, slots) != kept:
            out.append(f"{_holder(key)} is counted at {_row(*kept)}, but its sequences are "
                       f"{_row(dict(states), sessions, slots)}")
    for pid, fenced in c.fences.items():
        for block in fenced:
            if not 0 <= block < c.num_blocks or tables[block]:
                out.append(f"block {block} is fenced for pid {pid} but also held by a sequence or twice")
            else:
                tables[block] = 1
    for start, at, lo, hi in _slices(blocks.slice, c.num_blocks):
        refs = blocks.ref[at]
        first, end = 8 * (start + lo), 8 * (start + hi)
        if refs[lo:hi].tobytes() != counted[first:end]:   # compared in C; block by block only where one differs
            for i in range(lo, hi):
                if tables[start + i] != refs[i]:
                    out.append(f"block {start + i} has ref count {refs[i]} but {tables[start + i]} "
                               "table reference(s)")
        yield
    for n, (session, seq_id) in enumerate(c.sessions.items(), 1):
        seq = c.seqs.get(seq_id)
        if seq is None or not seq.has_session or seq.session_id != session:
            out.append(f"session {session!r} maps to sequence {seq_id}, which is not its sequence")
        if n % SESSION_SLICE == 0:
            yield
    yield from _swap_rules(c, out)


def _seq_rules(c: StateCopy, seq: SeqCopy) -> list[str]:
    out, name, blocks = [], f"sequence {seq.seq_id}", c.blocks
    assert blocks is not None
    running, swapped = seq.state == "running", seq.state == "swapped"
    owner = seq.owner or None
    if running != (owner is not None):
        out.append(f"{name} is {seq.state} with owner {owner}")
    if running and owner not in c.workers:
        out.append(f"{name} runs on worker {owner}, which holds no lease")
    capacity = (len(seq.slots) if swapped else len(seq.block_ids)) * seq.block_size
    if not 0 <= seq.num_committed <= min(seq.num_tokens, capacity):
        out.append(f"{name} commits {seq.num_committed} of {seq.num_tokens} tokens with {capacity} slots")
    needed = blocks_for(seq.num_committed, seq.block_size)
    held = len(seq.slots) if swapped else len(seq.block_ids)
    if not running and held != needed:
        out.append(f"{name} is {seq.state} with {held} pages for {needed} committed")
    if swapped and seq.block_ids:
        out.append(f"{name} is swapped but still holds device blocks")
    if not swapped and seq.slots:
        out.append(f"{name} is {seq.state} but holds swap slots")
    full = seq.num_committed // seq.block_size
    if seq.num_hashes != full:
        out.append(f"{name} has {seq.num_hashes} block hashes for {full} full blocks")
    if len(set(seq.block_ids)) != len(seq.block_ids):
        out.append(f"{name} lists a block twice")
    for index, block in enumerate(seq.block_ids):
        if not 0 <= block < c.num_blocks:
            out.append(f"{name} references block {block}, outside the pool")
        elif index >= full and blocks.value(blocks.ref, block) > 1:
            out.append(f"{name} shares block {block}, which it may still write")
        elif running and index >= full and blocks.value(blocks.written, block):
            out.append(f"{name} may still write block {block}, which carries a checksum")
    if seq.has_session and c.sessions.get(seq.session_id) != seq.seq_id:
        out.append(f"{name} names session {seq.session_id!r}, which maps elsewhere")
    return out


UNCLAIMED, IN_COPY, FREE_LIST = 0, -1, -2      # a swap slot's owner, when it is not sequence n (n + 1)


def _swap_rules(c: StateCopy, out: list[str]) -> Iterator[None]:
    swap = c.swap
    if swap is None:
        for n, seq in enumerate(c.seqs.values(), 1):
            if seq.slots:
                out.append("a sequence holds swap slots, but swap is disabled")
                return
            if n % SESSION_SLICE == 0:
                yield
        return
    out += [problem for problem in swap.jobs.values() if problem]
    # Per slot, who holds it. Flat, not a dict of a million slots: growing one rehashes it whole.
    owners = memoryview(bytearray(8 * swap.num_slots)).cast("q")
    claimed = 0

    def claim(slot: int, owner: int) -> None:
        nonlocal claimed
        if not 0 <= slot < swap.num_slots:
            out.append(f"swap slot {slot} of {_owner_name(owner)} is outside the swap tier")
        elif owners[slot] != UNCLAIMED:
            out.append(f"swap slot {slot} is held by {_owner_name(owners[slot])} and by {_owner_name(owner)}")
        else:
            owners[slot], claimed = owner, claimed + 1

    for n, seq in enumerate(c.seqs.values(), 1):
        for slot in seq.slots:
            claim(slot, seq.seq_id + 1)
        if n % SESSION_SLICE == 0:
            yield
    for slot in swap.in_copy:
        claim(slot, IN_COPY)
    for n, slot in enumerate(swap.free, 1):
        claim(slot, FREE_LIST)
        if n % SLICE == 0:
            yield
    if claimed != swap.num_slots:
        out.append(f"{swap.num_slots - claimed} swap slot(s) are neither free nor held: leaked")


def _owner_name(owner: int) -> str:
    return {IN_COPY: "a copy in flight", FREE_LIST: "the free list"}.get(owner, f"sequence {owner - 1}")
