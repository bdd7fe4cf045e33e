"""inferd as users run it: memd + inferd processes, inferctl and raw gRPC clients."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc
from tests.clis import run_cli, unit_host_env

if TYPE_CHECKING:
    from tests.conftest import Daemon

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def stack(memd_factory, inferd_factory, model_dir):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                              "--block-size", "16")
    inferd = await inferd_factory(model_dir, memd.address)
    return memd, inferd


async def inferctl(address: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "inferd.inferctl", "--address", address, *args, cwd=ROOT, env=dict(os.environ),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def wait_until(check, timeout: float = 30.0) -> None:
    """Poll memd's state (another process: there is no event to await) until `check` holds."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def memd_state(memd) -> tuple[dict[str, int], int, bool]:
    async with memd.admin() as admin:
        stats = await admin.stats()
        return dict(stats.sequences), stats.used_blocks, (await admin.check()).ok


async def test_generate_gives_exactly_max_tokens_with_usage(stack):
    memd, inferd = stack
    rc, out, err = await inferctl(inferd.address, "generate", "Hello! How are you today?", "--max-tokens", "9",
                                  "--ignore-eos", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert len(result["token_ids"]) == 9 and result["finish_reason"] == "length"
    usage = result["usage"]
    assert usage["completion_tokens"] == 9 and usage["prompt_tokens"] > 0 and usage["cached_tokens"] == 0
    assert usage["ttft_ms"] > 0 and usage["tpot_ms"] > 0
    assert isinstance(result["text"], str)
    states, used, ok = await memd_state(memd)
    assert states["running"] == 0 and used == 0 and ok


async def test_a_session_reuses_its_history_on_the_next_turn(stack):
    memd, inferd = stack
    rc, out, _ = await inferctl(inferd.address, "generate", "Tell me a story about a cat.", "--session", "s1",
                                "--max-tokens", "20", "--ignore-eos", "--json")
    first = json.loads(out)
    assert rc == 0 and first["usage"]["cached_tokens"] == 0
    rc, out, _ = await inferctl(inferd.address, "generate", "And then?", "--session", "s1", "--max-tokens", "5",
                                "--ignore-eos", "--json")
    second = json.loads(out)
    history = first["usage"]["prompt_tokens"] + 20
    assert second["usage"]["cached_tokens"] == history - 1
    assert second["usage"]["prompt_tokens"] > history
    states, _, ok = await memd_state(memd)
    assert states == {"running": 0, "parked": 1, "swapped": 0, "dropped": 0} and ok

    rc, out, _ = await inferctl(inferd.address, "reset", "s1")
    assert rc == 0 and "reset" in out
    states, used, ok = await memd_state(memd)
    assert states["parked"] == 0 and used == 0 and ok
    rc, _, err = await inferctl(inferd.address, "reset", "s1")
    assert rc == 1 and err.strip().startswith("inferctl: not found")


@pytest.mark.parametrize("session", [None, "cancelled-chat"])
async def test_a_client_that_goes_away_leaves_nothing_running(stack, session):
    memd, inferd = stack
    async with grpc.aio.insecure_channel(inferd.address) as channel:
        call = pb_grpc.InferdStub(channel).Generate(pb.GenerateRequest(
            prompt="The quick brown fox", max_tokens=2000, ignore_eos=True, session_id=session or ""))
        first = await call.read()
        assert first.token_ids
        call.cancel()

    async def settled() -> bool:
        states, _, _ = await memd_state(memd)
        return states["running"] == 0
    await wait_until(settled)
    states, used, ok = await memd_state(memd)
    assert ok and states["parked"] == (1 if session else 0) and (used > 0) == bool(session)


async def test_a_deadline_ends_the_request_and_parks_nothing_running(stack):
    memd, inferd = stack
    async with grpc.aio.insecure_channel(inferd.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in pb_grpc.InferdStub(channel).Generate(
                    pb.GenerateRequest(prompt="Once upon a time", max_tokens=2000, ignore_eos=True), timeout=1.0):
                pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def settled() -> bool:
        states, used, _ = await memd_state(memd)
        return states["running"] == 0 and used == 0
    await wait_until(settled)
    assert (await memd_state(memd))[2]


async def test_bad_requests_get_invalid_argument(stack):
    _, inferd = stack
    rc, _, err = await inferctl(inferd.address, "generate", "")
    assert rc == 1 and "invalid argument: the prompt is empty" in err
    rc, _, err = await inferctl(inferd.address, "generate", "hi", "--top-p", "1.5")    # inferctl checks it first
    assert rc == 2 and "--top-p" in err.strip().splitlines()[-1] and "Traceback" not in err
    async with grpc.aio.insecure_channel(inferd.address) as channel:
        for bad, words in ((pb.GenerateRequest(prompt_ids=[1, 99999]), "vocabulary"),
                           (pb.GenerateRequest(prompt="hi", top_p=1.5), "top_p")):     # other clients: inferd
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in pb_grpc.InferdStub(channel).Generate(bad):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


async def health(daemon) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    async with grpc.aio.insecure_channel(daemon.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_inferd_survives_a_memd_restart(memd_factory, inferd_factory, model_dir, tmp_path):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                              "--block-size", "16")
    inferd = await inferd_factory(model_dir, memd.address)
    assert len(pool_mappings(inferd)) == 1
    await memd.kill()                                     # kill -9: the pool and the lease are gone
    await inferd.log.wait_for("lost memd; reconnecting")
    rc, _, err = await inferctl(inferd.address, "generate", "hello", "--max-tokens", "3")
    assert rc == 1 and "not attached to memd" in err      # inferd answered: a refusal, not unreachable
    assert await health(inferd) == "NOT_SERVING"          # a load balancer sends its traffic elsewhere

    again = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                               "--block-size", "16", "--listen", memd.address)
    attached = [e for e in inferd.log.events if e.get("event") == "attached to memd"]
    assert len(attached) == 1

    await inferd.log.wait_for("attached to memd", nth=2)
    assert await health(inferd) == "SERVING"
    rc, out, err = await inferctl(inferd.address, "generate", "hello", "--max-tokens", "3", "--ignore-eos", "--json")
    assert rc == 0, err
    assert len(json.loads(out)["token_ids"]) == 3
    states, _, ok = await memd_state(again)
    assert states["running"] == 0 and ok
    assert len(pool_mappings(inferd)) == 1                # the first attachment's mapping went with it


def pool_mappings(inferd: Daemon) -> list[str]:
    """The lines of inferd's memory map that map memd's pool file."""
    with open(f"/proc/{inferd.proc.pid}/maps") as f:
        return [line for line in f if line.rstrip().endswith(".state/pool")]


async def test_inferctl_chat_holds_one_session_across_lines(stack):
    memd, inferd = stack
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "inferd.inferctl", "--address", inferd.address, "chat", "--session", "tty",
        "--max-tokens", "4", "--ignore-eos", cwd=ROOT, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate(b"Hello there!\nHow are you?\n")
    assert proc.returncode == 0, err
    assert out.decode().strip()                           # the replies stream to stdout
    notes = [line for line in err.decode().splitlines() if "tokens cached" in line]
    assert len(notes) == 2
    assert "[4 tokens, 0 of" in notes[0] and "[4 tokens, 0 of" not in notes[1]
    states, _, ok = await memd_state(memd)
    assert states["parked"] == 1 and ok


async def test_the_next_turn_can_run_on_another_worker(memd_factory, inferd_factory, model_dir):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                              "--block-size", "16")
    first = await inferd_factory(model_dir, memd.address, name="inferd-a")
    second = await inferd_factory(model_dir, memd.address, name="inferd-b")
    rc, out, _ = await inferctl(first.address, "generate", "Tell me a story about a cat.", "--session", "roam",
                                "--max-tokens", "12", "--ignore-eos", "--json")
    turn1 = json.loads(out)
    assert rc == 0
    rc, out, _ = await inferctl(second.address, "generate", "And then?", "--session", "roam",
                                "--max-tokens", "4", "--ignore-eos", "--json")
    turn2 = json.loads(out)
    assert rc == 0 and turn2["usage"]["cached_tokens"] == turn1["usage"]["prompt_tokens"] + 12 - 1
    async with memd.admin() as admin:
        snapshot = await admin.snapshot()
        assert len(snapshot.workers) == 2 and (await admin.check()).ok
        assert [s.state for s in snapshot.sequences] == ["parked"]


async def generate(channel: grpc.aio.Channel, prompt: str, max_tokens: int) -> list[int]:
    tokens = []
    async for reply in pb_grpc.InferdStub(channel).Generate(
            pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)):
        tokens += reply.token_ids
    return tokens


async def test_a_pool_too_small_for_the_load_preempts_and_an_operator_evicts_yet_every_answer_is_right(
        memd_factory, inferd_factory, model_dir, model_judge):
    # 32 blocks of 16 tokens; six requests that each grow to 8 blocks.
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--model", str(model_dir),
                              "--block-size", "16")
    inferd = await inferd_factory(model_dir, memd.address)
    prompts = [f"Request number {i} asks for a long answer." for i in range(6)]
    async with grpc.aio.insecure_channel(inferd.address) as channel:
        crowd = [asyncio.create_task(generate(channel, p, 110)) for p in prompts]

        async def running() -> bool:
            states, _, _ = await memd_state(memd)
            return states["running"] > 0 or all(t.done() for t in crowd)
        await wait_until(running)
        async with memd.admin() as admin:
            worker = (await admin.snapshot()).workers[0].worker_id
        rc, _, err = await memctl(memd.address, "evict", "--worker", str(worker), "--drop")
        assert rc == 0, err
        together = await asyncio.gather(*crowd)
        alone = [await generate(channel, p, 110) for p in prompts]     # one at a time: no pressure
    assert all(len(t) == 110 for t in together)
    for prompt, got, expected in zip(prompts, together, alone, strict=True):
        model_judge.assert_same(model_judge.encode(prompt), got, expected, prompt)
    async with memd.admin() as admin:
        stats = await admin.stats()
        assert stats.counters["preemptions"] >= 1
        assert stats.sequences["running"] == 0 and stats.used_blocks == 0 and (await admin.check()).ok


async def memctl(address: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "memd.memctl", "--address", address, *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def test_inferd_metrics_health_and_reflection(memd_factory, inferd_factory, model_dir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from test_memd_observability import free_port, scrape

    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                              "--block-size", "16")
    port = free_port()
    inferd = await inferd_factory(model_dir, memd.address, "--metrics-port", str(port))
    rc, _, err = await inferctl(inferd.address, "generate", "Count to ten.", "--max-tokens", "7", "--ignore-eos")
    assert rc == 0, err
    m = await asyncio.to_thread(scrape, port)
    assert m['kvpool_inferd_requests_total{finish_reason="length"}'] == 1
    assert m["kvpool_inferd_generated_tokens_total"] == 7 and m["kvpool_inferd_prompt_tokens_total"] > 0
    assert m["kvpool_inferd_time_to_first_token_seconds_count"] == 1
    assert m["kvpool_inferd_attached"] == 1 and m["kvpool_inferd_running_requests"] == 0
    assert m["kvpool_inferd_preemptions_total"] == 0
    assert m['kvpool_inferd_passes_run_ahead_total{outcome="taken"}'] >= 1      # decode ran a pass ahead
    passes = 'kvpool_inferd_forward_pass_seconds_count{{kind="{}"}}'.format
    assert m[passes("prefill")] >= 1 and m[passes("decode")] >= 6 and m[passes("mixed")] == 0
    async with grpc.aio.insecure_channel(inferd.address) as channel:
        # A prompt arriving while another request decodes joins its pass.
        running = pb_grpc.InferdStub(channel).Generate(
            pb.GenerateRequest(prompt="Tell me a long story.", max_tokens=4000, ignore_eos=True))
        got = 0
        while got < 2:
            got += len((await running.read()).token_ids)
        assert len(await generate(channel, "Another question arrives.", 3)) == 3
        running.cancel()
    m = await asyncio.to_thread(scrape, port)
    assert m[passes("mixed")] >= 1 and m['kvpool_inferd_forward_pass_seconds_bucket{kind="mixed",le="+Inf"}'] >= 1
    # Python's full collections in inferd since it attached: as many freezes as long ones at most
    assert m["kvpool_inferd_gc_full_collections_total"] >= m["kvpool_inferd_gc_freezes_total"]
    longest = m["kvpool_inferd_gc_longest_full_collection_seconds"]
    assert longest <= m["kvpool_inferd_gc_full_collection_seconds_total"]
    async with grpc.aio.insecure_channel(inferd.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvpool.inferd.v1.Inferd"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        await stream.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in (await stream.read()).list_services_response.service}
        await stream.done_writing()
    assert "kvpool.inferd.v1.Inferd" in names


async def test_a_drain_refuses_new_requests_lets_running_ones_finish_and_undo_ends_it(stack):
    memd, inferd = stack
    async with grpc.aio.insecure_channel(inferd.address) as channel:
        long = pb_grpc.InferdStub(channel).Generate(pb.GenerateRequest(prompt="Tell me everything.", max_tokens=2000,
                                                                       ignore_eos=True))
        tokens = list((await long.read()).token_ids)          # it runs
        rc, out, _ = await memctl(memd.address, "drain", "--wait", "0", "--json")
        assert rc == 1                                        # still running: not drained yet
        report = json.loads(out)
        assert report["running"] == 1 and report["drained"] is False and len(report["draining"]) == 1

        async def not_serving() -> bool:
            return await health(inferd) == "NOT_SERVING"
        await wait_until(not_serving)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(channel, "Someone new.", 4)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        tokens += (await long.read()).token_ids               # the running request goes on
        waiting = asyncio.create_task(memctl(memd.address, "drain", "--wait", "120"))
        while (reply := await long.read()) is not grpc.aio.EOF:
            tokens += reply.token_ids
        assert len(tokens) == 2000
        rc, out, err = await waiting
        assert rc == 0, err
        assert out.startswith("every worker drained: nothing running")
        rc, out, _ = await memctl(memd.address, "workers", "--json")
        assert [w["draining"] for w in json.loads(out)] == [True]
        rc, out, _ = await memctl(memd.address, "drain", "--undo")
        assert rc == 0 and out.strip() == "every worker admits requests again"

        async def serving() -> bool:
            return await health(inferd) == "SERVING"
        await wait_until(serving)
        assert len(await generate(channel, "Someone new.", 4)) == 4
    states, used, ok = await memd_state(memd)               # refused and finished requests left nothing running
    assert states["running"] == 0 and used == 0 and ok
    rc, _, err = await memctl(memd.address, "drain", "--worker", "999")
    assert rc == 1 and err.strip() == "memctl: not found: no worker 999 is attached (memctl workers)"


async def test_inferctl_finds_the_one_worker_unit_and_tells_a_draining_worker_from_an_unreachable_one(
        memd_factory, inferd_factory, model_dir, tmp_path):
    from inferd.scheduler import DRAINING
    run = tmp_path / "run"
    unit = f"unix:{run}/inferd/w1/inferd.sock"             # inferd@w1's socket; the user's own does not exist
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                              "--block-size", "16")
    (run / "inferd" / "w1").mkdir(parents=True)          # RuntimeDirectory=inferd/%i: systemd makes it
    inferd = await inferd_factory(model_dir, memd.address, "--listen", unit)
    env = unit_host_env(tmp_path)

    async def inferctl_on_this_host(*args: str) -> tuple[int, str, str]:
        return await run_cli("inferd.inferctl", *args, env=env, system_run=run)
    rc, out, err = await inferctl_on_this_host("generate", "Hello", "--max-tokens", "3", "--ignore-eos", "--json")
    assert rc == 0 and len(json.loads(out)["token_ids"]) == 3, err
    (run / "inferd" / "w2").mkdir()                        # two workers: picking one would be a guess
    rc, _, err = await inferctl_on_this_host("reset", "s")
    assert rc == 2 and f"{tmp_path}/user-runtime/kvpool/inferd.sock" in err
    (run / "inferd" / "w2").rmdir()
    rc, _, _ = await memctl(memd.address, "drain", "--wait", "0")
    assert rc == 0

    async def not_serving() -> bool:
        return await health(inferd) == "NOT_SERVING"
    await wait_until(not_serving)
    rc, out, err = await inferctl_on_this_host("generate", "Hello", "--max-tokens", "3")
    assert (rc, out, err) == (1, "", f"inferctl: unavailable: {DRAINING}\n")        # it answered: a refusal
    await inferd.kill()                                    # the socket file stays, nobody listens
    rc, out, err = await inferctl_on_this_host("generate", "Hello", "--max-tokens", "3")
    assert (rc, out) == (2, "")
    assert err == (f"inferctl: inferd is not reachable at {unit} (connection refused): give --address or set "
                   "INFERD_ADDRESS\n")


async def test_a_request_carries_its_id_into_the_logs_of_both_daemons(memd_factory, inferd_factory, model_dir):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                              "--block-size", "16", "--log-level", "debug")
    inferd = await inferd_factory(model_dir, memd.address)
    async with grpc.aio.insecure_channel(inferd.address) as channel:
        call = pb_grpc.InferdStub(channel).Generate(
            pb.GenerateRequest(prompt="Where is my request?", max_tokens=3, ignore_eos=True, session_id="s-9"),
            metadata=(("x-request-id", "trace-42"),))
        assert dict(await call.initial_metadata())["x-request-id"] == "trace-42"
        replies = [reply async for reply in call]
        bad = pb_grpc.InferdStub(channel).Generate(pb.GenerateRequest(prompt="x", max_tokens=1),
                                                   metadata=(("x-request-id", "has space"),))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [reply async for reply in bad]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finished = await inferd.log.wait_for("request finished", request="trace-42")
    assert finished["session"] == "s-9" and finished["finish_reason"] == "length"
    assert finished["completion_tokens"] == 3 == sum(len(r.token_ids) for r in replies)
    # memd logs the sequence's state changes (at debug) under the same sequence id.
    opened = await memd.log.wait_for("seq open", seq=finished["seq"])
    parked = await memd.log.wait_for("seq park", seq=finished["seq"])
    assert opened["session"] == "s-9" and parked["state"] == "parked" and opened["worker"] == parked["worker"]
    assert len(opened["pages"]) == opened["blocks"] and parked["pages"] == opened["pages"][:len(parked["pages"])]


async def test_a_worker_that_attaches_during_a_drain_of_all_admits_nothing(memd_factory, inferd_factory, model_dir):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                              "--block-size", "16")
    rc, out, err = await memctl(memd.address, "drain", "--wait", "0")
    assert rc == 0 and out.startswith("every worker drained"), err
    inferd = await inferd_factory(model_dir, memd.address)      # told at once, even while it maps the pool

    async def not_serving() -> bool:
        return await health(inferd) == "NOT_SERVING"
    await wait_until(not_serving)
    async with grpc.aio.insecure_channel(inferd.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(channel, "Anyone?", 3)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
    rc, out, _ = await memctl(memd.address, "workers", "--json")
    assert [w["draining"] for w in json.loads(out)] == [True]


async def test_a_turn_sent_again_under_its_turn_id_is_answered_again_not_appended_twice(stack, model_judge):
    memd, inferd = stack
    p1, p2, p3 = [40, 41, 42, 43, 44], [50, 51, 52], [60, 61]

    async def turn(prompt: list[int], turn_id: str = "") -> tuple[list[int], pb.Usage]:
        tokens, usage = [], None
        async with grpc.aio.insecure_channel(inferd.address) as channel:
            async for reply in pb_grpc.InferdStub(channel).Generate(pb.GenerateRequest(
                    prompt_ids=prompt, session_id="chat", max_tokens=8, ignore_eos=True, turn_id=turn_id)):
                tokens += reply.token_ids
                usage = reply.usage if reply.HasField("usage") else usage
        return tokens, usage
    a1, _ = await turn(p1, "1")
    a2, first = await turn(p2, "2")
    again, second = await turn(p2, "2")          # as a client whose answer was lost sends it
    assert second.prompt_tokens == first.prompt_tokens == len(p1 + a1 + p2)     # the turn is there once
    model_judge.assert_same(p1 + a1 + p2, again, a2, "the turn answered again")
    a3, third = await turn(p3, "3")
    assert third.prompt_tokens == len(p1 + a1 + p2 + again + p3)
    model_judge.assert_greedy(p1 + a1 + p2 + again + p3, a3, 8)
    _, fourth = await turn(p3, "4")              # the same message under another turn id: said twice
    assert fourth.prompt_tokens == third.prompt_tokens + len(a3) + len(p3)
    with pytest.raises(grpc.aio.AioRpcError) as refused:     # memd takes names of 256 characters at most
        await turn(p3, "x" * 257)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "turn id" in refused.value.details()
    async with memd.admin() as admin:
        assert (await admin.stats()).counters["turns_retried"] == 1
    states, _, ok = await memd_state(memd)
    assert states["running"] == 0 and states["parked"] == 1 and ok


async def test_decode_through_flex_attention_answers_as_inferds_own_kernel(memd_factory, inferd_factory, model_dir):
    # --attention flex, as on a GPU (here compiled for the CPU): compiled for every batch size before serving,
    # and the same tokens as the paged kernel's, alone and three at a time.
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                              "--block-size", "16")
    flex = await inferd_factory(model_dir, memd.address, "--attention", "flex", "--max-num-seqs", "3",
                                name="inferd-flex")
    compiled = await flex.log.wait_for("flex decode compiled")
    assert compiled["batch_sizes"] == [1, 2, 4]
    paged = await inferd_factory(model_dir, memd.address, "--attention", "paged", name="inferd-paged")
    prompts = ["Tell me a story about a cat.", "Hello!", "What is a page?"]
    answers = {}
    for inferd in (flex, paged):
        async with grpc.aio.insecure_channel(inferd.address) as channel:
            alone = await generate(channel, prompts[0], 12)
            together = await asyncio.gather(*(generate(channel, p, 12) for p in prompts))
        answers[inferd] = (alone, together)
    assert answers[flex] == answers[paged] and answers[flex][0] == answers[flex][1][0]
    states, used, ok = await memd_state(memd)             # every request's blocks given back
    assert states["running"] == 0 and used == 0 and ok
