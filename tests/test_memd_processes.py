"""memd as it runs: a real daemon, real worker processes, real shared memory."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest

from shared.client import MemdClient, MemdError
from shared.ops import Extend, Open, Park

BS = 16   # tokens per block in these tests


def seq_rows(snapshot: Any) -> dict[int, Any]:
    return {s.seq_id: s for s in snapshot.sequences}


async def test_two_processes_share_pages_byte_for_byte(memd, spawn_worker):
    writer = await spawn_worker(memd.address)
    reader = await spawn_worker(memd.address)
    opened, = await writer.step({"kind": "open", "token_ids": list(range(40)), "session_id": "chat"})
    written = [await writer.call("write", block=b, seed=100 + i) for i, b in enumerate(opened["block_ids"])]
    await writer.step({"kind": "park", "seq_id": opened["seq_id"], "commit_to": 40})

    resumed, = await reader.step({"kind": "resume", "session_id": "chat"})
    assert resumed["block_ids"] == opened["block_ids"]
    assert resumed["num_committed"] == 40 and resumed["token_ids"] == list(range(40))
    for block, expected in zip(resumed["block_ids"], written, strict=True):
        assert (await reader.call("read", block=block))["digest"] == expected["digest"]


async def test_a_pool_kept_in_several_files_is_one_range_in_every_process(memd_factory, spawn_worker):
    # 600 MiB is kept in three memfds of 200 MiB (shared.pool_files); blocks of 6 MiB, so blocks 33 and 66
    # each lie across two of them.
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "600MiB", "--block-bytes", "6MiB",
                              "--state-dir", "none", "--disable-swap", "--lease-timeout", "30")
    writer = await spawn_worker(memd.address)
    reader = await spawn_worker(memd.address)
    opened, = await writer.step({"kind": "open", "token_ids": list(range(100 * BS)), "session_id": "wide"})
    assert sorted(opened["block_ids"]) == list(range(100))
    # Not the last block: a resume gives its last token a page to be computed again in.
    written = {b: await writer.call("write", block=b, seed=b) for b in (0, 33, 34, 66, 98)}
    await writer.step({"kind": "park", "seq_id": opened["seq_id"], "commit_to": 100 * BS})

    resumed, = await reader.step({"kind": "resume", "session_id": "wide"})
    assert resumed["block_ids"] == opened["block_ids"]
    for block, expected in written.items():
        assert (await reader.call("read", block=block))["digest"] == expected["digest"]
    assert (await reader.call("read", block=50))["zero"]


async def test_a_reallocated_block_reads_as_zeros(memd, spawn_worker):
    first = await spawn_worker(memd.address)
    second = await spawn_worker(memd.address)
    opened, = await first.step({"kind": "open", "token_ids": [1, 2, 3]})
    block = opened["block_ids"][0]
    await first.call("write", block=block, seed=7)
    assert not (await first.call("read", block=block))["zero"]
    await first.step({"kind": "free", "seq_id": opened["seq_id"]})

    reused, = await second.step({"kind": "open", "token_ids": [9, 9, 9]})
    assert reused["block_ids"] == [block]          # uncached free blocks are reused first
    assert (await second.call("read", block=block))["zero"]


async def test_killed_worker_keeps_its_history_and_committed_whole_blocks(memd, spawn_worker):
    worker = await spawn_worker(memd.address)
    chat, scratch = await worker.step(
        {"kind": "open", "token_ids": list(range(40)), "reserve": 30, "session_id": "s1"},
        {"kind": "open", "token_ids": list(range(100, 110)), "reserve": 5})
    await worker.step({"kind": "extend", "seq_id": chat["seq_id"], "append": [7], "commit_to": 40, "reserve": 30})
    worker.proc.send_signal(signal.SIGKILL)         # no goodbye

    # The lease is 30 s: the broken stream, not the lease, tells memd (the reason says which).
    event = await memd.log.wait_for("worker reclaimed", worker=worker.worker_id)
    assert event["reason"] == "stream broken"
    # A broken stream may be a live process: the pages it could write were fenced until it was gone: the
    # chat's partly written third page and 2 reserved ones, the scratch turn's one page.
    lifted = await memd.log.wait_for("fence lifted")
    assert lifted["reason"] in ("its process exited", "its process is gone") and lifted["blocks_freed"] == 4
    async with memd.admin() as admin:
        seqs = seq_rows(await admin.snapshot())
        assert seqs[chat["seq_id"]].state == "parked"
        assert seqs[chat["seq_id"]].num_committed == 32            # its whole blocks; 8 tokens to recompute
        assert seqs[chat["seq_id"]].num_tokens == 41               # the history, and the sampled token
        assert len(seqs[chat["seq_id"]].block_ids) == 2
        assert scratch["seq_id"] not in seqs                       # nothing committed, no session: freed
        stats = await admin.stats()
        assert stats.used_blocks == 2 and stats.workers == 0
        assert (await admin.check()).ok


async def test_a_silent_worker_is_reclaimed_after_the_lease(memd_factory, spawn_worker):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                              "--lease-timeout", "1")
    worker = await spawn_worker(memd.address)
    opened, = await worker.step({"kind": "open", "token_ids": list(range(20)), "session_id": "quiet"})
    await worker.step({"kind": "extend", "seq_id": opened["seq_id"], "commit_to": 20})
    worker.proc.send_signal(signal.SIGSTOP)          # hung: its socket stays open, heartbeats stop
    event = await memd.log.wait_for("worker reclaimed", worker=worker.worker_id)
    assert event["reason"] == "lease expired"
    async with memd.admin() as admin:
        assert seq_rows(await admin.snapshot())[opened["seq_id"]].state == "parked"
        assert (await admin.check()).ok
    worker.proc.send_signal(signal.SIGCONT)          # it wakes: memd has ended its lease stream
    assert (await worker.call("lease_lost"))["lost"]
    error = await worker.step_error({"kind": "extend", "seq_id": opened["seq_id"], "commit_to": 20})
    assert error["code"] == "FAILED_PRECONDITION" and "attach again" in error["message"]


async def test_an_idle_worker_keeps_its_lease(memd_factory):
    lease = 2.0          # a heartbeat every 0.67 s: a busy machine does not starve the client that long
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                              "--lease-timeout", str(lease))
    async with await MemdClient.attach(memd.address, block_size=BS) as client, memd.admin() as admin:
        opened, = await client.step(Open(list(range(5))))
        last_step = (await admin.snapshot(blocks=False)).taken_at

        async def renewed_without_traffic() -> bool:
            worker, = (await admin.snapshot(blocks=False)).workers
            return worker.last_seen - last_step > 2 * lease
        # Two lease periods with no traffic at all: memd saw heartbeats alone renew the lease.
        while not await renewed_without_traffic():
            await asyncio.sleep(0.1)      # memd is another process: poll its view
        assert not client.lease_lost.is_set()
        await client.step(Extend(opened.seq_id, commit_to=5))
    assert memd.log.find("worker reclaimed", reason="lease expired") is None


async def test_a_stalled_memd_does_not_blame_its_workers(memd_factory):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                              "--lease-timeout", "2")
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        opened, = await client.step(Open(list(range(5))))
        memd.proc.send_signal(signal.SIGSTOP)       # memd starved: the worker's heartbeats wait unread
        await asyncio.sleep(4.0)                    # two lease periods of stall (the fault, not a wait)
        memd.proc.send_signal(signal.SIGCONT)
        stalled = await memd.log.wait_for("memd's event loop stalled; lease checks wait a round")
        assert stalled["stalled_s"] >= 1.0
        await client.step(Extend(opened.seq_id, commit_to=5))     # the lease stands: the Step is served
        assert not client.lease_lost.is_set()
    assert memd.log.find("worker reclaimed", reason="lease expired") is None


async def test_a_cleanly_closed_worker_parks_its_sessions(memd):
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        opened, = await client.step(Open(list(range(18)), session_id="bye"))
        await client.step(Extend(opened.seq_id, commit_to=18))
    await memd.log.wait_for("worker reclaimed", reason="goodbye")
    async with memd.admin() as admin:
        assert seq_rows(await admin.snapshot())[opened.seq_id].state == "parked"


async def test_prefix_blocks_are_shared_across_workers(memd, spawn_worker):
    a = await spawn_worker(memd.address, model="tiny")
    b = await spawn_worker(memd.address, model="tiny")
    other_model = await spawn_worker(memd.address, model="other")
    system_prompt = list(range(1000, 1040))              # two full blocks and a bit
    first, = await a.step({"kind": "open", "token_ids": system_prompt + [1]})
    for i, block in enumerate(first["block_ids"]):
        await a.call("write", block=block, seed=i)
    await a.step({"kind": "extend", "seq_id": first["seq_id"], "commit_to": 41})
    await a.step({"kind": "free", "seq_id": first["seq_id"]})

    second, = await b.step({"kind": "open", "token_ids": system_prompt + [2, 3]})
    assert second["num_cached"] == 32 and second["num_committed"] == 32
    assert second["block_ids"][:2] == first["block_ids"][:2]
    assert (await b.call("read", block=second["block_ids"][0]))["digest"] == \
        (await a.call("read", block=first["block_ids"][0]))["digest"]

    foreign, = await other_model.step({"kind": "open", "token_ids": system_prompt + [2, 3]})
    assert foreign["num_cached"] == 0                    # prefix hashes are per model


async def test_fork_shares_full_blocks_and_copies_the_written_tail(memd, spawn_worker):
    worker = await spawn_worker(memd.address)
    parent, = await worker.step({"kind": "open", "token_ids": list(range(20)), "reserve": 4})
    await worker.call("write_bytes", block=parent["block_ids"][1], offset=0, data=[42] * 64)
    await worker.step({"kind": "extend", "seq_id": parent["seq_id"], "commit_to": 20})
    child, = await worker.step({"kind": "fork", "seq_id": parent["seq_id"], "session_id": "sample-2"})

    assert child["block_ids"][0] == parent["block_ids"][0]             # full block: shared
    assert child["block_ids"][1] != parent["block_ids"][1]             # partly written tail: copied
    assert child["token_ids"] == list(range(20)) and child["num_committed"] == 20
    tail = await worker.call("read", block=child["block_ids"][1])
    assert tail["head"] == [42] * 8
    await worker.call("write_bytes", block=child["block_ids"][1], offset=0, data=[7] * 8)
    assert (await worker.call("read", block=parent["block_ids"][1]))["head"] == [42] * 8

    async with memd.admin() as admin:
        refs = {b.block_id: b.ref_count for b in (await admin.snapshot()).blocks}
        assert refs[parent["block_ids"][0]] == 2
        assert (await admin.check()).ok
    await worker.step({"kind": "free", "seq_id": parent["seq_id"]}, {"kind": "free", "seq_id": child["seq_id"]})
    async with memd.admin() as admin:
        stats = await admin.stats()
        assert stats.used_blocks == 0 and (await admin.check()).ok


async def test_a_parked_session_moves_to_another_worker_and_grows(memd):
    async with await MemdClient.attach(memd.address, block_size=BS) as a:
        opened, = await a.step(Open(list(range(30)), reserve=2, session_id="turns"))
        await a.step(Park(opened.seq_id, append=[30], commit_to=30))
    async with await MemdClient.attach(memd.address, block_size=BS) as b:
        from shared.ops import Resume
        resumed, = await b.step(Resume(session_id="turns", reserve=20))
        assert resumed.num_cached == 30 and resumed.token_ids == list(range(31))
        assert resumed.num_blocks == 4                   # 31 known + 20 reserved tokens
        assert resumed.block_ids[:2] == opened.block_ids[:2]


async def test_the_next_turn_of_a_chat_opens_or_continues_its_session(memd):
    from shared.ops import Free, Resume
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        turn1, = await client.step(Open([1, 2, 3, 4, 5], reserve=1, session_id="c", continue_session=True))
        assert turn1.num_cached == 0 and turn1.token_ids == [1, 2, 3, 4, 5]        # a new chat
        await client.step(Park(turn1.seq_id, append=[6], commit_to=5))
        turn2, = await client.step(Open([7, 8], reserve=1, session_id="c", continue_session=True))
        assert turn2.seq_id == turn1.seq_id and turn2.state == "running"
        assert turn2.token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and turn2.num_cached == 5
        await client.step(Park(turn2.seq_id, commit_to=8))
        await client.step(Free(session_id="c"))
        with pytest.raises(MemdError) as err:
            await client.step(Resume(session_id="c"))
        assert err.value.code.name == "NOT_FOUND"
    async with memd.admin() as admin:
        assert (await admin.stats()).used_blocks == 0 and (await admin.check()).ok
