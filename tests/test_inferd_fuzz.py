"""inferd's Generate and Reset under random and malformed requests: a clear status or a normal answer, never a
crash, and nothing left running in memd afterwards."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import tokens
from shared.launch import spawn_ready
from shared.rpc import inferd_pb2 as ipb
from shared.rpc import inferd_pb2_grpc as ipb_grpc
from shared.rpc import memd_pb2 as mpb
from shared.rpc import memd_pb2_grpc as mpb_grpc

CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}
U32 = 2**32 - 1
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
requests = st.builds(
    ipb.GenerateRequest,
    prompt=st.one_of(st.just(""), st.text(max_size=40)),
    prompt_ids=st.lists(st.one_of(st.integers(0, 600), st.just(U32)), max_size=12),
    session_id=st.sampled_from(["", "", "s1", "s2", "x" * 300]),
    max_tokens=st.sampled_from([0, 1, 3, 8, 5000, U32]),
    temperature=st.one_of(st.just(0.0), floats),
    top_p=st.one_of(st.just(0.0), floats),
    top_k=st.one_of(st.just(0), st.integers(0, U32)),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop=st.lists(st.text(max_size=6), max_size=3),
    ignore_eos=st.booleans(),
    n=st.sampled_from([0, 1, 2, 3, 1000, U32]),
)
calls = st.one_of(
    st.tuples(st.just("generate"), requests),
    st.tuples(st.just("reset"), st.sampled_from(["", "s1", "s2", "nope", "x" * 300])),
    st.tuples(st.just("garbage"), st.sampled_from(["Generate", "Reset"]), st.binary(max_size=48)),
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[subprocess.Popen[bytes]], str, str]]:
    from inferd.tiny import make_tiny_model
    workdir = tmp_path_factory.mktemp("inferd-fuzz")
    model = make_tiny_model(workdir / "model", arch="llama", seed=3)
    memd_address, inferd_address = f"unix:{workdir}/memd.sock", f"unix:{workdir}/inferd.sock"
    procs = [spawn_ready(["memd", "--device", "cpu", "--pool-bytes", "2MiB", "--model", str(model),
                          "--block-size", "16", "--listen", memd_address], workdir, stderr=subprocess.DEVNULL)]
    procs.append(spawn_ready(["inferd", "serve", "--model", str(model), "--memd", memd_address, "--listen",
                              inferd_address, "--threads", "1"], workdir, stderr=subprocess.DEVNULL))
    yield procs, memd_address, inferd_address
    for proc in reversed(procs):
        proc.terminate()
        proc.wait(30)


async def drive(memd_address: str, inferd_address: str, plan: list[tuple]) -> None:
    async with grpc.aio.insecure_channel(inferd_address) as channel:
        stub = ipb_grpc.InferdStub(channel)
        for call in plan:
            try:
                if call[0] == "generate":
                    async for _ in stub.Generate(call[1], timeout=60):
                        pass
                elif call[0] == "reset":
                    await stub.Reset(ipb.ResetRequest(session_id=call[1]), timeout=60)
                else:
                    raw = channel.unary_stream(f"/kvpool.inferd.v1.Inferd/{call[1]}") if call[1] == "Generate" \
                        else channel.unary_unary(f"/kvpool.inferd.v1.Inferd/{call[1]}")
                    reply = raw(call[2], timeout=60)
                    if call[1] == "Generate":
                        async for _ in reply:
                            pass
                    else:
                        await reply
            except grpc.aio.AioRpcError as err:
                assert err.code() in CLEAR, (call, err.code(), err.details())
                assert err.details() and "\n" not in err.details().strip(), (call, err.details())
    async with grpc.aio.insecure_channel(memd_address) as channel:
        md = tokens.metadata(tokens.find_token(memd_address, admin=True))
        stub = mpb_grpc.MemdStub(channel)
        stats = await stub.Stats(mpb.StatsRequest(), metadata=md)
        assert stats.sequences["running"] == 0
        check = await stub.Check(mpb.CheckRequest(), metadata=md)
        assert check.ok, check.violations


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(plan=st.lists(calls, min_size=1, max_size=4))
def test_inferd_answers_random_and_malformed_requests_clearly(stack, plan):
    procs, memd_address, inferd_address = stack
    asyncio.run(drive(memd_address, inferd_address, plan))
    assert all(proc.poll() is None for proc in procs), "a daemon died"
