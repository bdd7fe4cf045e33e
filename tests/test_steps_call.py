"""A worker's Steps on its Steps call, the one way a Step travels: refusals answered in-band with the call kept,
concurrent Steps on calls of their own, a cancelled Step never answering the next (real memd)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import msgpack
import pytest

from shared.client import MemdClient, MemdError
from shared.ops import Extend, Free, Open
from shared.packed_steps import pack_ops
from shared.rpc import memd_pb2 as pb

BS = 16


async def rpcs(memd) -> dict[str, int]:
    async with memd.admin() as admin:
        return dict((await admin.stats()).rpcs)


async def test_steps_ride_one_call_and_a_refusal_is_an_answer_that_keeps_it(memd):
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        opened, = await client.step(Open(list(range(20)), reserve=1))
        call, = client._idle_calls
        with pytest.raises(MemdError) as refused:
            await client.step(Extend(opened.seq_id, commit_to=20), Extend(opened.seq_id + 1000, commit_to=1))
        async with memd.admin() as admin:
            free = (await admin.stats()).free_blocks
        assert (refused.value.code, refused.value.op_index, refused.value.free_blocks) == \
            (grpc.StatusCode.NOT_FOUND, 1, free)
        assert str(opened.seq_id + 1000) in refused.value.message and client.free_blocks == free
        extended, = await client.step(Extend(opened.seq_id, commit_to=20, append=[7], reserve=1))
        assert extended.num_committed == 20 and client._idle_calls == [call]      # the refusal kept the call
        await client.step(Free(opened.seq_id))
    assert (await rpcs(memd))["Steps"] == 1


async def test_a_refusal_s_reason_comes_with_it(memd):
    """A client tells a busy session from other refusals by the reason memd sends beside the message."""
    async with await MemdClient.attach(memd.address, block_size=BS) as one, \
            await MemdClient.attach(memd.address, block_size=BS) as other:
        await one.step(Open(list(range(20)), reserve=1, session_id="busy"))      # running on `one`
        with pytest.raises(MemdError) as busy:
            await other.step(Open([5, 6], reserve=1, session_id="busy", continue_session=True))
        assert busy.value.code.name == "PERMISSION_DENIED" and busy.value.reason == "session_busy"
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
        assert len(client._idle_calls) == 2                       # both kept for the Steps to come
        for _ in range(3):
            await client.step(Extend(first[0].seq_id, append=[9], reserve=1))
    assert (await rpcs(memd))["Steps"] == 2


async def test_a_step_of_any_other_shape_is_refused_in_band(memd):
    """Protobuf ops (an older client's form) and histories as ints are gone from the wire: a request in the
    form memd no longer reads is refused with a clear status, and the call goes on."""
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        call = client._stub.Steps(metadata=client._metadata)
        base = {"worker_id": client.worker_id, "lease": client._lease}
        await call.write(pb.StepRequest(**base))                                  # no packed_ops at all
        reply = await call.read()
        assert reply.refused.code == "INVALID_ARGUMENT" and "not msgpack" in reply.refused.message
        await call.write(pb.StepRequest(**base, packed_ops=msgpack.packb({"open": [1, 2]})))
        reply = await call.read()
        assert reply.refused.code == "INVALID_ARGUMENT" and "array of ops" in reply.refused.message
        await call.write(pb.StepRequest(**base, packed_ops=pack_ops([Open([1, 2, 3], reserve=1)])))
        reply = await call.read()
        assert not reply.HasField("refused") and reply.packed_results
        call.cancel()


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
