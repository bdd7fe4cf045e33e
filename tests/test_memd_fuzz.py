"""memd under random and malformed requests from several clients: it answers each with a clear status, never
crashes, and `memctl check` stays clean (the bad-input half of fault isolation)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator

import grpc
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import tokens
from shared.launch import spawn_ready
from shared.ops import Extend, Fork, Free, Open, Park, Resume
from shared.packed_steps import pack_ops, unpack_results
from shared.rpc import memd_pb2 as pb
from shared.rpc import memd_pb2_grpc as pb_grpc

# What a bad request may get: each names the problem. Never UNKNOWN, INTERNAL or a dead memd.
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
         grpc.StatusCode.OUT_OF_RANGE}
U32, U64 = 2**32 - 1, 2**64 - 1

seq_ids = st.one_of(st.integers(0, 24), st.sampled_from([U64, 2**63]))
token_lists = st.lists(st.one_of(st.integers(0, 64), st.just(U32)), max_size=48)
counts = st.one_of(st.integers(0, 80), st.sampled_from([U32, 2**31]))
names = st.one_of(st.sampled_from(["", "s1", "s2"]), st.text(max_size=300))
maybe_names = names.map(lambda n: n or None)
# Well-typed operations with random values, as a client builds them.
ops = st.one_of(
    st.builds(lambda s, t, r, c: Open(t, r, s, c), maybe_names, token_lists, counts, st.booleans()),
    st.builds(lambda i, a, c, r: Extend(i, a, c, r), seq_ids, token_lists, counts, counts),
    st.builds(lambda i, a, c, p: Park(i, a, c, p), seq_ids, token_lists, counts, st.booleans()),
    st.builds(lambda i, r: Resume(seq_id=i, reserve=r), seq_ids, counts),
    st.builds(lambda s, r: Resume(session_id=s, reserve=r), maybe_names, counts),
    st.builds(lambda i: Free(seq_id=i), seq_ids),
    st.builds(lambda s: Free(session_id=s), maybe_names),
    st.builds(lambda i, s: Fork(i, s), seq_ids, maybe_names),
)
# A packed Step's ops (shared.packed_steps): [kind, [fields]] of any kind and any msgpack values, some near what
# memd reads (small ids and counts, token lists), some anything at all.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, U64), st.floats(), st.text(max_size=8),
                    st.binary(max_size=8))
near = st.one_of(st.integers(0, 24), st.sampled_from([U32, U32 + 1, U64]), st.booleans(), st.none(),
                 st.sampled_from(["", "s1", "s2"]), st.lists(st.integers(0, 64), max_size=8))
packed_op = st.tuples(st.integers(0, 7), st.lists(st.one_of(near, scalars), max_size=8)).map(list)
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6), max_leaves=24)
as_packed = st.lists(ops, min_size=1, max_size=4).map(pack_ops)                # as a client packs them


def one_field_changed(packed: bytes, op: int, field: int, value: object) -> bytes:
    """A client's packed ops with one field of one op replaced: each check on its own."""
    items = msgpack.unpackb(packed)
    fields = items[op % len(items)][1]
    fields[field % len(fields)] = value
    return msgpack.packb(items)


packed_steps = st.one_of(
    st.lists(packed_op, max_size=5).map(msgpack.packb), anything.map(msgpack.packb), as_packed,
    st.builds(one_field_changed, as_packed, st.integers(0, 3), st.integers(0, 6),
              st.one_of(scalars, st.lists(scalars, max_size=3))))

calls = st.one_of(
    st.tuples(st.just("packed"), st.integers(0, 2), packed_steps, counts),
    st.tuples(st.just("packed"), st.integers(0, 2), st.lists(ops, max_size=6).map(pack_ops), counts),
    st.tuples(st.just("foreign"), st.integers(0, 2), st.lists(ops, max_size=3).map(pack_ops)),  # another's id
    st.tuples(st.just("garbage"), st.just("Steps"), st.binary(max_size=64)),
    st.tuples(st.just("garbage"), st.sampled_from(["Attach", "Evict", "Drain"]), st.binary(max_size=64)),
    st.tuples(st.just("evict"), st.one_of(
        st.builds(lambda i: pb.EvictRequest(seq_id=i), seq_ids),
        st.builds(lambda s: pb.EvictRequest(session_id=s), names),
        st.builds(lambda n: pb.EvictRequest(blocks=n), st.integers(0, U64)),
        st.builds(lambda s: pb.EvictRequest(idle_s=s), st.floats(allow_nan=True, allow_infinity=True)),
        st.builds(lambda w: pb.EvictRequest(worker_id=w), seq_ids),
        st.builds(lambda m: pb.EvictRequest(seq_id=1, mode=m), st.text(max_size=8)))),
    st.tuples(st.just("attach"), st.integers(0, 2**32), st.text(max_size=300)),
)


@pytest.fixture(scope="module")
def memd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    workdir = tmp_path_factory.mktemp("fuzz")
    address = f"unix:{workdir}/memd.sock"
    proc = spawn_ready(["memd", "--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                        "--listen", address, "--lease-timeout", "30"], workdir, stderr=subprocess.DEVNULL)
    yield proc, address
    proc.terminate()
    proc.wait(30)


async def drive(address: str, plan: list[tuple]) -> None:
    admin_md = tokens.metadata(tokens.find_token(address, admin=True))
    worker_md = tokens.metadata(tokens.find_token(address))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.MemdStub(channel)
        workers = []
        for i, model in enumerate(("m", "m", "other")):
            reply = await stub.Attach(pb.AttachRequest(name=f"fuzz-{i}", model=model, block_size=4),
                                      metadata=worker_md)
            workers.append((reply.worker_id, reply.lease))
        streams: dict[int, grpc.aio.StreamStreamCall] = {}
        for call in plan:
            try:
                if call[0] in ("packed", "foreign"):    # refusals come as answers, and the call goes on
                    worker_id, lease = workers[call[1]]
                    if call[0] == "foreign":
                        lease, stream = b"", stub.Steps(metadata=worker_md)         # no lease: refused
                    else:
                        stream = streams.setdefault(call[1], stub.Steps(metadata=worker_md))
                    await stream.write(pb.StepRequest(worker_id=worker_id, lease=lease, packed_ops=call[2],
                                                      wanted_blocks=call[3] % (U32 + 1) if len(call) > 3 else 0))
                    reply = await stream.read()
                    if reply.HasField("refused"):
                        assert getattr(grpc.StatusCode, reply.refused.code) in CLEAR, (call, reply.refused)
                        assert reply.refused.message and "\n" not in reply.refused.message.strip(), call
                    else:
                        assert len(unpack_results(reply.packed_results)) == len(msgpack.unpackb(call[2])), call
                    if call[0] == "foreign":
                        assert reply.HasField("refused"), call
                        stream.cancel()
                elif call[0] == "garbage" and call[1] == "Steps":
                    raw_stream = channel.stream_stream("/kvpool.memd.v1.Memd/Steps")(metadata=worker_md)
                    await raw_stream.write(call[2])
                    reply = pb.StepReply.FromString(await raw_stream.read())   # bytes that parse: an unread Step
                    assert reply.HasField("refused"), (call, reply)
                    raw_stream.cancel()
                elif call[0] == "garbage":
                    raw = channel.unary_unary(f"/kvpool.memd.v1.Memd/{call[1]}")
                    await raw(call[2], metadata=admin_md)
                elif call[0] == "evict":
                    await stub.Evict(call[1], metadata=admin_md)
                elif call[0] == "attach":
                    await stub.Attach(pb.AttachRequest(name=call[2], block_size=call[1] % (U32 + 1)),
                                      metadata=worker_md)
            except grpc.aio.AioRpcError as err:
                if call[0] == "packed":
                    streams.pop(call[1], None)          # the call ended with that status: a new one next time
                assert err.code() in CLEAR, (call, err.code(), err.details())
                assert err.details() and "\n" not in err.details().strip(), (call, err.details())
        check = await stub.Check(pb.CheckRequest(), metadata=admin_md)
        assert check.ok, check.violations


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(plan=st.lists(calls, min_size=1, max_size=12))
def test_memd_answers_random_and_malformed_requests_clearly_and_stays_consistent(memd, plan):
    proc, address = memd
    asyncio.run(drive(address, plan))
    assert proc.poll() is None, "memd died"


def test_an_oversized_request_is_refused_and_memd_goes_on(memd):
    proc, address = memd

    async def huge() -> grpc.StatusCode:
        md = tokens.metadata(tokens.find_token(address))
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 128 << 20)]) as ch:
            stub = pb_grpc.MemdStub(ch)
            call = stub.Steps(metadata=md)
            await call.write(pb.StepRequest(worker_id=1, packed_ops=bytes(100 << 20)))     # past 64 MiB
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert (await stub.Check(pb.CheckRequest(), metadata=tokens.metadata(
                tokens.find_token(address, admin=True)))).ok
            return err.value.code()

    assert asyncio.run(huge()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert proc.poll() is None
