"""memd.state_copy: a copy of one instant taken between Steps, and memd's check of it (no processes).

The slices are made tiny so that Steps (opening, parking, freeing, swapping
sequences out) run between every two of them; what the copy returns must be
the live state at its last instant, exactly, and the check of it clean.
"""

from __future__ import annotations

import asyncio

import pytest

from memd import invariants, state_copy
from memd.state_copy import SeqCopy
from shared.ops import Free, Open, Park


@pytest.fixture
def tiny_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_copy, "SLICE_S", 0.0)         # every place a slice may end, it does
    monkeypatch.setattr(state_copy, "SLICE_BLOCKS", 16)
    monkeypatch.setattr(state_copy, "CHECKED_SLICE_BLOCKS", 16)
    monkeypatch.setattr(state_copy, "SLICE_SEQS", 2)
    monkeypatch.setattr(state_copy, "SETTLE", 8)
    monkeypatch.setattr(invariants, "SLICE", 8)
    monkeypatch.setattr(invariants, "SEQ_SLICE", 2)


async def churning(memd, client, stop: asyncio.Event) -> None:
    """Steps without pause: sessions opened, parked, swapped out, resumed, freed."""
    manager, turn, resumed = memd.parts.manager, 0, []
    async with memd.admin() as admin:
        while not stop.is_set():
            turn += 1
            opened = await client.step(*[Open([turn, i] + list(range(40)), reserve=1, session_id=f"s{turn}-{i}")
                                         for i in range(3)])
            await client.step(Park(opened[0].seq_id, commit_to=32), Park(opened[1].seq_id, commit_to=42),
                              Free(opened[2].seq_id))
            await admin.evict(session_id=f"s{turn}-0", mode="swap")
            if turn % 3 == 0:                                  # resumed: swapped back in
                back, = await client.step(Open([7], reserve=1, session_id=f"s{turn}-0", continue_session=True))
                resumed.append(back.seq_id)
            if turn % 4 == 0:                                  # the pool stays in use, never exhausted
                gone = [s.seq_id for s in list(manager.seqs.values()) if s.state.value != "running"][:5]
                await client.step(*[Free(seq_id) for seq_id in gone + resumed])
                resumed.clear()


async def test_a_copy_taken_in_slices_while_steps_run_is_the_state_of_its_last_instant(local_memd_factory,
                                                                                      tiny_slices):
    memd = await local_memd_factory("--device", "cpu", "--pool-bytes", "2MiB", "--block-bytes", "1KiB",
                                    "--state-dir", "none")
    client = await memd.attach(block_size=16)
    manager, pool, swap = memd.parts.manager, memd.parts.manager.pool, memd.parts.manager.swap
    stop = asyncio.Event()
    task = asyncio.create_task(churning(memd, client, stop))
    try:
        for _ in range(6):
            steps = manager.counters["steps"]
            copy = await state_copy.take(manager, checked=True)
            # Nothing has run since the copy's last instant: it must be the live state, exactly.
            assert copy.blocks is not None
            assert list(copy.blocks.rows()) == [(ref, touched, digest is not None) for ref, touched, digest
                                                in zip(pool.ref, pool.last_access, pool.hash_of, strict=True)]
            nexts, prevs = (list(copy.blocks.next[0].tolist()), list(copy.blocks.prev[0].tolist()))
            for column in copy.blocks.next[1:]:
                nexts += column.tolist()
            for column in copy.blocks.prev[1:]:
                prevs += column.tolist()
            assert nexts == pool.free._next[:-1].tolist() and prevs == pool.free._prev[:-1].tolist()
            assert copy.seqs == {seq_id: SeqCopy.of(seq) for seq_id, seq in manager.seqs.items()}
            assert copy.swap is not None and copy.swap.free == swap.free_slots() and copy.swap.in_copy == swap.in_copy
            assert copy.sessions == manager.sessions and copy.queue_len == len(pool.free)
            assert manager.counters["steps"] > steps                   # and Steps did run while it was taken
    finally:
        stop.set()
        await task
    assert manager.counters["swap_outs"] > 0
    # no reader left behind: the manager's own index (memd.seq_index) is the one that stays
    assert not pool.watches and [id(w) for w in manager.watches] == [id(manager.index.dirty)] and not swap.low_marks


async def test_the_check_taken_between_steps_finds_nothing_wrong_with_a_busy_memd_and_what_is(local_memd_factory,
                                                                                             tiny_slices):
    # No free watermark: the eviction policy's sweep must not swap out the sequence whose leak is planted below
    # while the check awaits its slices (the churn's own evictions are done when it stops).
    memd = await local_memd_factory("--device", "cpu", "--pool-bytes", "2MiB", "--block-bytes", "1KiB",
                                    "--state-dir", "none", "--free-watermark", "0")
    client = await memd.attach(block_size=16)
    manager = memd.parts.manager
    stop = asyncio.Event()
    task = asyncio.create_task(churning(memd, client, stop))
    try:
        for _ in range(4):
            steps = manager.counters["steps"]
            assert await invariants.violations_between_steps(manager) == []
            assert manager.counters["steps"] > steps
    finally:
        stop.set()
        await task
    held = next(s for s in manager.seqs.values() if s.block_ids)
    manager.pool.ref[held.block_ids[0]] += 1                   # a leak the check must name
    assert await invariants.violations_between_steps(manager) == [
        f"block {held.block_ids[0]} has ref count {manager.pool.ref[held.block_ids[0]]} but 1 table reference(s)"]


async def test_the_check_names_a_swap_slot_held_twice_one_outside_the_tier_and_a_leaked_one(local_memd_factory,
                                                                                          tiny_slices):
    memd = await local_memd_factory("--device", "cpu", "--pool-bytes", "2MiB", "--block-bytes", "1KiB",
                                    "--state-dir", "none")
    client = await memd.attach(block_size=16)
    manager = memd.parts.manager
    opened, = await client.step(Open(list(range(40)), reserve=1, session_id="s"))
    await client.step(Park(opened.seq_id, commit_to=32))
    async with memd.admin() as admin:
        await admin.evict(session_id="s", mode="swap")
    seq = manager.seqs[opened.seq_id]
    assert seq.slots and await invariants.violations_between_steps(manager) == []
    swap, held = manager.swap, seq.slots[0]
    swap._free.append(held)                                  # freed while its sequence still holds it
    leaked = swap._free.pop(0)                               # held by nothing
    seq.slots.append(swap.num_slots)                         # outside the tier
    assert sorted(await invariants.violations_between_steps(manager)) == sorted([
        f"sequence {seq.seq_id} is swapped with 3 pages for 2 committed",
        f"swap slot {held} is held by sequence {seq.seq_id} and by the free list",
        f"swap slot {swap.num_slots} of sequence {seq.seq_id} is outside the swap tier",
        "1 swap slot(s) are neither free nor held: leaked",
        # (changed behind memd's back: what it counts per holder, memctl tenants' row, no longer matches)
        *(f"{holder} is counted at 1 swapped; 1 session(s), 2 swap slot(s), but its sequences are 1 swapped; "
          "1 session(s), 3 swap slot(s)" for holder in ("model 'default'", "the sequences of no tenant")),
    ]), leaked
