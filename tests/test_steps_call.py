"""A worker's Steps on one Steps call: answered as Step answers, refusals included, the call kept (real memd)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from shared.client import MemdClient, MemdError
from shared.ops import Extend, Fork, Free, Open, Park, Resume
from shared.protobuf_codec import op_to_proto
from shared.rpc import memd_pb2 as pb

BS = 16


async def rpcs(memd) -> dict[str, int]:
    async with memd.admin() as admin:
        return dict((await admin.stats()).rpcs)


async def test_steps_ride_one_call_and_a_refusal_is_answered_as_step_answers_it(memd):
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        opened, = await client.step(Open(list(range(20)), reserve=1))
        call = client._steps
        bad = [Extend(opened.seq_id, commit_to=20), Extend(opened.seq_id + 1000, commit_to=1)]
        with pytest.raises(MemdError) as streamed:
            await client.step(*bad)
        with pytest.raises(grpc.aio.AioRpcError) as unary:            # the same Step as a call of its own
            await client._stub.Step(pb.StepRequest(worker_id=client.worker_id, lease=client._lease,
                                                   ops=[op_to_proto(op) for op in bad]), metadata=client._metadata)
        expected = MemdError.from_rpc(unary.value)
        assert (streamed.value.code, streamed.value.message, streamed.value.op_index, streamed.value.free_blocks) \
            == (expected.code, expected.message, 1, expected.free_blocks) and expected.code.name == "NOT_FOUND"
        assert client.free_blocks == expected.free_blocks
        extended, = await client.step(Extend(opened.seq_id, commit_to=20, append=[7], reserve=1))
        assert extended.num_committed == 20 and client._steps is call              # the refusal kept the call
        await client.step(Free(opened.seq_id))
    calls = await rpcs(memd)
    assert calls["Steps"] == 1 and calls["Step"] == 1                             # the one sent on its own


async def test_a_refusal_s_reason_comes_with_it_on_the_call_and_on_its_own(memd):
    """A client tells a busy session from other refusals by the reason memd sends beside the message."""
    async with await MemdClient.attach(memd.address, block_size=BS) as one, \
            await MemdClient.attach(memd.address, block_size=BS) as other:
        await one.step(Open(list(range(20)), reserve=1, session_id="busy"))      # running on `one`
        again = [Open([5, 6], reserve=1, session_id="busy", continue_session=True)]
        with pytest.raises(MemdError) as streamed:
            await other.step(*again)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await other._stub.Step(pb.StepRequest(worker_id=other.worker_id, lease=other._lease,
                                                  ops=[op_to_proto(op) for op in again]), metadata=other._metadata)
        assert streamed.value.reason == MemdError.from_rpc(unary.value).reason == "session_busy"
        with pytest.raises(MemdError) as taken:                        # a new sequence under its name
            await other.step(Open([5, 6], reserve=1, session_id="busy"))
        assert taken.value.code.name == "ALREADY_EXISTS" and taken.value.reason == "session_busy"
        with pytest.raises(MemdError) as unknown:
            await other.step(Free(session_id="nobody"))
        assert unknown.value.code.name == "NOT_FOUND" and unknown.value.reason == ""
        await one.step(Free(session_id="busy"))


async def test_a_step_sent_while_another_is_on_the_call_takes_a_call_of_its_own(memd):
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        first, second = await asyncio.gather(client.step(Open([1, 2, 3], reserve=1)),
                                             client.step(Open([4, 5], reserve=1)))
        assert first[0].seq_id != second[0].seq_id and first[0].num_committed == second[0].num_committed == 0
    calls = await rpcs(memd)
    assert calls["Steps"] == 1 and calls["Step"] == 1


async def test_a_step_cancelled_in_flight_never_answers_the_next(memd):
    """Cancelled after a varying number of turns of the loop: whatever it reached, the next Step gets its own
    answer (the call it was on is ended, so a reply still on its way is never read as the next one's)."""
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        for turns in range(12):
            task = asyncio.create_task(client.step(Open(list(range(100, 100 + turns + 1)), reserve=1)))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task                                  # (or it was answered before the cancel: as well)
            mine, = await client.step(Open(list(range(5 * BS + turns)), reserve=1))
            assert mine.num_blocks == 6 and len(mine.block_ids) == 6              # 5 whole blocks and a partial
            await client.step(Free(mine.seq_id))
    # The worker gone, whatever the cancelled Steps opened is reclaimed: no page is left held, nothing broken.
    await memd.log.wait_for("worker reclaimed")
    async with memd.admin() as admin:
        stats, check = await admin.stats(), await admin.check()
    assert check.ok, check.violations
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks


async def test_a_client_that_sends_protobuf_ops_gets_the_answers_a_packing_one_gets(memd):
    """memd reads a Step's ops packed (what its clients send) and as protobuf (an older client's, grpcurl's):
    the same Steps, refusals included, get the same answers either way."""
    answers = []
    for packed, base in ((True, 1000), (False, 2000)):
        async with await MemdClient.attach(memd.address, block_size=BS) as client:
            assert client.packed_steps
            client.packed_steps = packed
            seen = []
            opened, = await client.step(Open(list(range(base, base + 40)), reserve=1, session_id=f"s{base}"))
            seen.append(opened)
            seen += await client.step(Extend(opened.seq_id, append=[base + 40], commit_to=40, reserve=1,
                                             sums_from=0, page_sums=[11, 12]),
                                      Open([base + 1, base + 2], session_id=f"t{base}"))
            seen += await client.step(Park(opened.seq_id, commit_to=41))
            seen += await client.step(Resume(session_id=f"s{base}", reserve=1))
            seen += await client.step(Fork(opened.seq_id))
            with pytest.raises(MemdError) as err:
                await client.step(Free(session_id=f"t{base}"), Extend(opened.seq_id + 10_000, commit_to=1))
            seen.append((err.value.code, err.value.op_index))
            seen += await client.step(Free(session_id=f"t{base}"), Free(opened.seq_id, commit_to=41))
            answers.append([(r.state, len(r.block_ids), r.num_blocks, r.num_committed, r.num_cached,
                             None if r.token_ids is None else [t - base for t in r.token_ids])
                            if not isinstance(r, tuple) else r for r in seen])
    assert answers[0] == answers[1]
    assert answers[0][4][5] == list(range(41))          # the resumed history
    async with memd.admin() as admin:                   # what the clients left (forks parked at goodbye) is whole
        check = await admin.check()
    assert check.ok, check.violations
