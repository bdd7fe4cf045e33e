"""memd under memory pressure, on real processes: who is evicted, how, and what survives."""

from __future__ import annotations

import asyncio

import pytest

from shared.client import MemdClient
from shared.ops import Extend, Free, Open, Park, Resume

BS = 16
SMALL = ("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB", "--lease-timeout", "30",
         "--free-watermark", "0")                   # 64 pages; the tests decide when pressure comes


async def park(client: MemdClient, session: str, tokens: int = 40, start: int = 0) -> int:
    opened, = await client.step(Open(list(range(start, start + tokens)), session_id=session))
    await client.step(Extend(opened.seq_id, commit_to=tokens), Park(opened.seq_id))
    return opened.seq_id


async def heat_up(client: MemdClient, session: str, turns: int) -> None:
    for _ in range(turns):
        resumed, = await client.step(Resume(session_id=session))
        await client.step(Park(resumed.seq_id))


async def states(memd) -> dict[int, str]:
    async with memd.admin() as admin:
        return {s.seq_id: s.state for s in (await admin.snapshot()).sequences}


async def counters(memd) -> dict[str, int]:
    async with memd.admin() as admin:
        return dict((await admin.stats()).counters)


async def test_a_step_short_of_pages_evicts_the_coldest_parked_sequence_not_the_oldest(memd_factory):
    memd = await memd_factory(*SMALL)
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        frequent = await park(client, "frequent")
        await heat_up(client, "frequent", 5)
        rare = await park(client, "rare", start=100)          # touched last, but only once
        big, = await client.step(Open([], reserve=61 * BS))   # 58 pages free: 3 must go
        assert len(big.block_ids) == 61
        assert await states(memd) == {frequent: "parked", rare: "swapped", big.seq_id: "running"}
        c = await counters(memd)
        assert c["evictions_pressure"] == 1 and c["swap_outs"] == 1
        await client.step(Free(big.seq_id))
        resumed, = await client.step(Resume(session_id="rare"))
        assert resumed.num_committed == 40 and resumed.token_ids == list(range(100, 140))
    async with memd.admin() as admin:
        assert (await admin.check()).ok


async def test_a_parked_sequence_idle_past_the_ttl_is_dropped_and_a_running_one_is_not(memd_factory):
    memd = await memd_factory(*SMALL, "--idle-ttl", "0.5")
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        idle = await park(client, "idle")
        running, = await client.step(Open(list(range(30)), session_id="busy"))
        await memd.log.wait_for("dropped", seq_ids=[idle])
        assert await states(memd) == {idle: "dropped", running.seq_id: "running"}
        assert (await counters(memd))["evictions_idle"] == 1
        resumed, = await client.step(Resume(session_id="idle"))       # the history survives the drop
        assert resumed.token_ids == list(range(40))


async def test_evict_blocks_takes_the_coldest_parked_sequences_until_enough_is_free(memd_factory):
    memd = await memd_factory(*SMALL)
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        hot = await park(client, "hot")
        await heat_up(client, "hot", 4)
        warm = await park(client, "warm", start=100)
        await heat_up(client, "warm", 2)
        cold = await park(client, "cold", start=200)
        big, = await client.step(Open([], reserve=52 * BS))        # 3 pages each parked: 3 of 64 left free
        async with memd.admin() as admin:
            reply = await admin.evict(blocks=3, mode="swap")      # already free: nothing goes
            assert list(reply.seq_ids) == [] and reply.free_blocks == 3
            reply = await admin.evict(blocks=8, mode="swap")      # 5 more: two sequences go
            assert sorted(reply.swapped) == sorted([cold, warm]) and reply.blocks_freed == 6
            assert reply.free_blocks == 9
            reply = await admin.evict(blocks=10, mode="drop")
            assert reply.dropped == [hot] and reply.blocks_freed == 3 and reply.free_blocks == 12
            reply = await admin.evict(blocks=64, mode="drop")     # the rest runs: nothing to take
            assert list(reply.seq_ids) == [] and reply.free_blocks == 12
            assert (await admin.check()).ok
        await client.step(Free(big.seq_id))
    assert await states(memd) == {hot: "dropped", warm: "swapped", cold: "swapped"}


async def test_a_full_swap_tier_drops_the_colder_sequence(memd_factory):
    memd = await memd_factory(*SMALL, "--swap-ratio", "0.05")     # 3 swap slots: one sequence of 3 pages
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        first = await park(client, "first")
        hotter = await park(client, "hotter", start=100)
        await heat_up(client, "hotter", 3)
        coldest = await park(client, "coldest", start=200)
    async with memd.admin() as admin:
        assert (await admin.evict(session_id="first")).swapped == [first]
        reply = await admin.evict(session_id="hotter")             # room is made by dropping the colder "first"
        assert reply.swapped == [hotter] and reply.dropped == [first]
        reply = await admin.evict(session_id="coldest")            # colder than what swap holds: dropped itself
        assert reply.swapped == [] and reply.dropped == [coldest]
        stats = await admin.stats()
        assert stats.swap_total_blocks == 3 and stats.swapped_blocks == 3 and stats.swap_free_blocks == 0
        assert (await admin.check()).ok
    assert await states(memd) == {first: "dropped", hotter: "swapped", coldest: "dropped"}


async def test_with_swap_disabled_every_eviction_drops(memd_factory):
    memd = await memd_factory(*SMALL, "--disable-swap")
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        seq = await park(client, "chat")
        big, = await client.step(Open([], reserve=62 * BS))     # pressure
        assert len(big.block_ids) == 62
    async with memd.admin() as admin:
        stats = await admin.stats()
        assert stats.swap_total_blocks == 0 and stats.sequences["dropped"] == 1
        assert stats.counters["drops"] == 1 and "swap_outs" not in stats.counters
    assert (await states(memd))[seq] == "dropped"


async def test_swapped_pages_come_back_byte_identical_in_another_process(memd_factory, spawn_worker):
    memd = await memd_factory(*SMALL)
    writer = await spawn_worker(memd.address)
    opened, = await writer.step({"kind": "open", "token_ids": list(range(40)), "session_id": "chat"})
    digests = [(await writer.call("write", block=b, seed=b + 7))["digest"] for b in opened["block_ids"]]
    await writer.step({"kind": "extend", "seq_id": opened["seq_id"], "commit_to": 40},
                      {"kind": "park", "seq_id": opened["seq_id"]})
    async with memd.admin() as admin:
        assert (await admin.evict(session_id="chat")).swapped == [opened["seq_id"]]
    # Another worker takes every free page, scribbles on it, and frees it: the old pages are overwritten.
    reader = await spawn_worker(memd.address)
    hog, = await reader.step({"kind": "open", "token_ids": [], "reserve": 64 * BS})
    for block in hog["block_ids"]:
        await reader.call("write", block=block, seed=999)
    await reader.step({"kind": "free", "seq_id": hog["seq_id"]})
    resumed, = await reader.step({"kind": "resume", "session_id": "chat"})
    assert resumed["num_committed"] == 40
    assert [(await reader.call("read", block=b))["digest"] for b in resumed["block_ids"]] == digests


async def test_evicting_a_workers_running_sequences_revokes_them_through_its_stream(memd_factory, spawn_worker):
    memd = await memd_factory(*SMALL)
    worker = await spawn_worker(memd.address)
    opened, = await worker.step({"kind": "open", "token_ids": list(range(20)), "reserve": 1})
    await worker.step({"kind": "extend", "seq_id": opened["seq_id"], "commit_to": 20})
    async with memd.admin() as admin:
        reply = await admin.evict(worker_id=worker.worker_id)
        assert reply.revoked == [opened["seq_id"]] and reply.blocks_freed == 0
    revoked = await worker.call("revoked")
    assert revoked["seq_id"] == opened["seq_id"] and "memctl evict" in revoked["reason"]
    parked, = await worker.step({"kind": "park", "seq_id": opened["seq_id"], "preempt": True})
    assert parked["state"] == "swapped"
    c = await counters(memd)
    assert c["preemptions"] == 1 and c["evictions_forced"] == 1 and c["swap_outs"] == 1
    resumed, = await worker.step({"kind": "resume", "seq_id": opened["seq_id"]})
    assert resumed["num_committed"] == 20


async def test_the_loop_answers_while_a_slow_swap_copies(memd_factory):
    memd = await memd_factory(*SMALL, "--log-level", "debug", env={"SWAP_LATENCY_TEST": "1.0"})
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        seq = await park(client, "chat")
    async with memd.admin() as admin:
        evicting = asyncio.create_task(admin.evict(session_id="chat"))
        await memd.log.wait_for("rpc", method="Evict")        # the copy is under way (debug log)
        stats = await admin.stats()                           # answered during the one-second copy
        assert not evicting.done()
        assert stats.used_blocks == 3 and stats.swap_free_blocks == stats.swap_total_blocks - 3   # both held
        assert (await evicting).swapped == [seq]
        stats = await admin.stats()
        assert stats.used_blocks == 0 and stats.swapped_blocks == 3


# Each swap copy waits this long first (SWAP_LATENCY_TEST): a copy that is not called off outlasts the test.
SLOW_COPY = {"SWAP_LATENCY_TEST": "60"}


async def test_a_reset_during_a_swap_out_answers_with_every_slot_back(memd_factory):
    memd = await memd_factory(*SMALL, "--log-level", "debug", env=SLOW_COPY)
    async with await MemdClient.attach(memd.address, block_size=BS) as client, memd.admin() as admin:
        await park(client, "first")
        await park(client, "second", start=100)
        evicting = asyncio.create_task(admin.evict(idle_s=0))     # both: the second copy queues behind the first
        await memd.log.wait_for("rpc", method="Evict")
        await client.step(Free(session_id="second"))              # its copy never began: its slots are back
        stats = await admin.stats()
        assert stats.used_blocks == 3 and stats.swap_free_blocks == stats.swap_total_blocks - 3
        assert not evicting.done()
        await client.step(Free(session_id="first"))               # its copy is under way: called off, it stops
        stats = await admin.stats()
        assert stats.used_blocks == 0 and stats.swap_free_blocks == stats.swap_total_blocks
        assert (await evicting).swapped == [] and sum(stats.sequences.values()) == 0
        assert (await admin.check()).ok


@pytest.mark.parametrize("by", ["resume", "drop"])
async def test_a_resume_or_drop_during_a_swap_out_answers_with_every_slot_back(memd_factory, by):
    memd = await memd_factory(*SMALL, "--log-level", "debug", env=SLOW_COPY)
    async with await MemdClient.attach(memd.address, block_size=BS) as client, memd.admin() as admin:
        seq = await park(client, "chat")
        evicting = asyncio.create_task(admin.evict(session_id="chat"))
        await memd.log.wait_for("rpc", method="Evict")
        if by == "resume":
            resumed, = await client.step(Resume(session_id="chat"))
            assert resumed.num_committed == 40 and resumed.state == "running"
        else:
            assert (await admin.evict(session_id="chat", mode="drop")).seq_ids == [seq]
        stats = await admin.stats()
        assert stats.swap_free_blocks == stats.swap_total_blocks and stats.used_blocks == (3 if by == "resume" else 0)
        assert (await evicting).swapped == []
        assert (await admin.check()).ok


async def wait_running(memd, seq_id: int) -> None:
    """Until memd shows the sequence running: the Step is committed, its swap-in copy under way."""
    while (await states(memd)).get(seq_id) != "running":
        await asyncio.sleep(0.01)       # memd is another process: poll its snapshot


async def test_a_block_being_swapped_in_is_no_prefix_hit_until_its_bytes_are_there(memd_factory, spawn_worker):
    memd = await memd_factory(*SMALL, env={"SWAP_LATENCY_TEST": "1.0"})
    owner = await spawn_worker(memd.address)
    opened, = await owner.step({"kind": "open", "token_ids": list(range(40)), "session_id": "chat"})
    digests = [(await owner.call("write", block=b, seed=b + 7))["digest"] for b in opened["block_ids"][:2]]
    await owner.step({"kind": "extend", "seq_id": opened["seq_id"], "commit_to": 40},
                     {"kind": "park", "seq_id": opened["seq_id"]})
    async with memd.admin() as admin:
        await admin.evict(session_id="chat")
    other = await spawn_worker(memd.address)
    hog, = await other.step({"kind": "open", "token_ids": [], "reserve": 64 * BS})   # reuse every cached page
    await other.step({"kind": "free", "seq_id": hog["seq_id"]})
    resuming = asyncio.create_task(owner.step({"kind": "resume", "session_id": "chat"}))
    await asyncio.wait_for(wait_running(memd, opened["seq_id"]), 30)
    early, = await other.step({"kind": "open", "token_ids": list(range(33))})
    assert early["num_cached"] == 0                          # the copy has not landed: no hit on empty pages
    await resuming
    late, = await other.step({"kind": "open", "token_ids": list(range(33))})
    assert late["num_cached"] == 32
    assert [(await other.call("read", block=b))["digest"] for b in late["block_ids"][:2]] == digests


async def test_a_step_cancelled_during_its_swap_in_leaks_no_swap_slot(memd_factory):
    memd = await memd_factory(*SMALL, env={"SWAP_LATENCY_TEST": "1.0"})
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        seq = await park(client, "chat")
        async with memd.admin() as admin:
            await admin.evict(session_id="chat")
            total = (await admin.stats()).swap_total_blocks
            resuming = asyncio.create_task(client.step(Resume(session_id="chat")))
            await asyncio.wait_for(wait_running(memd, seq), 30)
            resuming.cancel()                                # the worker gives up waiting
            while (await admin.stats()).swap_free_blocks != total:
                await asyncio.sleep(0.05)                    # the copy finishes, then the slots return
            assert (await admin.check()).ok
