"""Every refusal from a real client gets the right gRPC status and changes nothing."""

from __future__ import annotations

from typing import Any

import grpc
import msgpack
import pytest

from shared.client import MemdClient, MemdError
from shared.ops import Extend, Free, Open, Park, Resume
from shared.packed_steps import pack_ops
from shared.rpc import memd_pb2 as pb
from shared.rpc import memd_pb2_grpc as pb_grpc

BS = 16


async def refusal(stub: pb_grpc.MemdStub, metadata: Any, request: pb.StepRequest) -> pb.StepRefusal:
    """A Step sent as any client could send it, on a Steps call of its own: the refusal it is answered with."""
    call = stub.Steps(metadata=metadata)
    await call.write(request)
    reply = await call.read()
    call.cancel()
    assert reply.HasField("refused"), reply
    return reply.refused


async def fingerprint(memd: Any) -> tuple:
    """Everything a refused Step could have touched, as memd reports it."""
    async with memd.admin() as admin:
        snap = await admin.snapshot()
        stats = await admin.stats()
    blocks = [(b.block_id, b.ref_count, tuple(b.seq_ids), b.state, b.last_access) for b in snap.blocks]
    seqs = sorted((s.seq_id, s.session_id, s.state, s.owner, s.num_committed, s.num_tokens, tuple(s.block_ids))
                  for s in snap.sequences)
    return blocks, seqs, stats.free_blocks, stats.cached_blocks, dict(stats.sequences)


@pytest.fixture
async def scene(memd):
    """Worker a runs session "a" (20 committed) and parked session "p"; b is idle; c serves another model."""
    a = await MemdClient.attach(memd.address, block_size=BS, name="a")
    b = await MemdClient.attach(memd.address, block_size=BS, name="b")
    c = await MemdClient.attach(memd.address, block_size=BS, name="c", model="another")
    running, parked = await a.step(Open(list(range(20)), reserve=1, session_id="a"),
                                   Open(list(range(50, 90)), session_id="p"))
    await a.step(Extend(running.seq_id, commit_to=20, reserve=1), Park(parked.seq_id, commit_to=40))
    yield {"a": a, "b": b, "c": c, "running": running.seq_id, "parked": parked.seq_id}
    for client in (a, b, c):
        await client.close()


CASES = {
    "commit past the history": ("a", lambda s: [Extend(s["running"], commit_to=99)], "INVALID_ARGUMENT"),
    "commit going backwards": ("a", lambda s: [Extend(s["running"], commit_to=3)], "INVALID_ARGUMENT"),
    "more tokens than the whole pool": ("a", lambda s: [Open([1, 2], reserve=64 * BS)], "INVALID_ARGUMENT"),
    "resume naming nothing": ("b", lambda s: [Resume()], "INVALID_ARGUMENT"),
    "unknown sequence": ("a", lambda s: [Extend(987654, commit_to=1)], "NOT_FOUND"),
    "unknown session": ("b", lambda s: [Resume(session_id="nobody")], "NOT_FOUND"),
    "pool full even after eviction": ("b", lambda s: [Open([1], reserve=62 * BS)], "RESOURCE_EXHAUSTED"),
    "extend another worker's sequence": ("b", lambda s: [Extend(s["running"], append=[5])], "PERMISSION_DENIED"),
    "free another worker's sequence": ("b", lambda s: [Free(s["running"])], "PERMISSION_DENIED"),
    "resume another worker's sequence": ("b", lambda s: [Resume(session_id="a")], "PERMISSION_DENIED"),
    "session id too long": ("b", lambda s: [Open([1], session_id="x" * 300)], "INVALID_ARGUMENT"),
    "free another model's sequence": ("c", lambda s: [Free(s["parked"])], "FAILED_PRECONDITION"),
    "open a taken session": ("b", lambda s: [Open([1, 2, 3], session_id="p")], "ALREADY_EXISTS"),
    "extend a parked sequence": ("b", lambda s: [Extend(s["parked"], commit_to=40)], "FAILED_PRECONDITION"),
    "resume own running sequence": ("a", lambda s: [Resume(session_id="a")], "FAILED_PRECONDITION"),
}


@pytest.mark.parametrize("case", CASES)
async def test_refused_step_gets_its_status_and_changes_nothing(memd, scene, case):
    who, build, code = CASES[case]
    before = await fingerprint(memd)
    with pytest.raises(MemdError) as err:
        await scene[who].step(*build(scene))
    assert err.value.code.name == code
    assert err.value.op_index == 0 and not err.value.message.startswith("op ")   # the index is metadata
    assert await fingerprint(memd) == before
    async with memd.admin() as admin:
        assert (await admin.check()).ok


async def test_a_step_is_all_or_nothing(memd, scene):
    before = await fingerprint(memd)
    with pytest.raises(MemdError) as err:
        await scene["a"].step(
            Open(list(range(300, 340)), reserve=4, session_id="new"),   # fine on its own
            Extend(scene["running"], append=[1, 2], commit_to=21, reserve=8),
            Free(scene["parked"]),
            Extend(424242, commit_to=1))                                  # fails last
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert err.value.op_index == 3
    assert await fingerprint(memd) == before
    with pytest.raises(MemdError):    # the session of the rolled-back Open does not exist
        await scene["b"].step(Resume(session_id="new"))


async def test_a_step_from_a_worker_without_lease_is_refused(memd, scene):
    before = await fingerprint(memd)
    async with memd.admin() as admin:
        stub = pb_grpc.MemdStub(admin._channel)
        refused = await refusal(stub, admin.metadata, pb.StepRequest(
            worker_id=777, packed_ops=pack_ops([Free(scene["parked"])])))
    assert refused.code == "FAILED_PRECONDITION"
    assert "attach again" in refused.message
    assert await fingerprint(memd) == before


async def test_a_step_with_a_wrong_lease_secret_is_refused(memd, scene):
    before = await fingerprint(memd)
    async with memd.admin() as admin:
        stub = pb_grpc.MemdStub(admin._channel)
        refused = await refusal(stub, admin.metadata, pb.StepRequest(     # a's id is no secret; its lease is
            worker_id=scene["a"].worker_id, lease=b"0" * 16, packed_ops=pack_ops([Free(scene["running"])])))
    assert refused.code == "PERMISSION_DENIED"
    assert await fingerprint(memd) == before


async def test_an_empty_operation_is_invalid(memd, scene):
    before = await fingerprint(memd)
    async with memd.admin() as admin:
        refused = (await admin.stats()).counters["steps_refused"]
        stub = pb_grpc.MemdStub(admin._channel)
        answer = await refusal(stub, admin.metadata, pb.StepRequest(
            worker_id=scene["b"].worker_id, lease=scene["b"]._lease, packed_ops=msgpack.packb([[0, []]])))
    assert answer.code == "INVALID_ARGUMENT"
    assert "unknown op kind 0" in answer.message
    assert await fingerprint(memd) == before
    async with memd.admin() as admin:
        assert (await admin.stats()).counters["steps_refused"] == refused + 1     # counted like any refusal


async def test_a_packed_step_that_cannot_be_read_is_refused_naming_its_op_and_changes_nothing(memd, scene):
    before = await fingerprint(memd)
    b = scene["b"]
    good = [1, [[1, 2, 3], 1, None, False, None, False, None, None, 0]]    # an Open, fine on its own
    cases = [(msgpack.packb([good, [2, [scene["running"], ["x"], 1, 1, 0, []]]]), 1, "append"),
             (b"\xc1", -1, "not msgpack"),
             (msgpack.packb([good, [1, [[1, 2], 1, None, False, None, False, None, None]]]), 1,
              "open has 9 fields, not 8")]
    async with memd.admin() as admin:
        refused = (await admin.stats()).counters["steps_refused"]
        for packed, index, words in cases:
            answer = await refusal(b._stub, b._metadata, pb.StepRequest(worker_id=b.worker_id, lease=b._lease,
                                                                        packed_ops=packed))
            assert answer.code == "INVALID_ARGUMENT" and words in answer.message, answer
            assert answer.op_index == index
        assert (await admin.stats()).counters["steps_refused"] == refused + len(cases)
        assert (await admin.check()).ok
    assert await fingerprint(memd) == before


async def test_attach_refuses_a_block_that_does_not_fit_a_page(memd):
    with pytest.raises(MemdError) as err:
        await MemdClient.attach(memd.address, block_size=BS, bytes_per_token=4096)   # 64 KiB > 4 KiB page
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not fit" in err.value.message
    with pytest.raises(MemdError) as err:
        await MemdClient.attach(memd.address)        # memd sized by bytes: the worker must say its block size
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_evict_without_a_target_or_with_a_bad_mode_is_refused(memd, scene):
    before = await fingerprint(memd)
    async with memd.admin() as admin:
        with pytest.raises(MemdError) as err:
            await admin.evict()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(MemdError) as err:
            await admin.evict(session_id="p", mode="shred")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(MemdError) as err:
            await admin.evict(worker_id=999)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert await fingerprint(memd) == before
