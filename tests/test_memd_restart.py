"""memd dies (kill -9) or restarts: workers stay up, and parked conversations survive with their KV.

Real memd and inferd processes; memd's pool, swap tier and journal live in
its state directory (beside its socket by default), which the next memd on
the same socket reopens.
"""

from __future__ import annotations

import contextlib
import json

import grpc
import msgpack
import pytest

from shared.client import MemdClient, MemdError
from shared.ops import Open
from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc
from tests.test_inferd_service import health, inferctl, memd_state
from tests.test_memd_startup import run_memd

PROMPT = "Tell me a story about a cat who learned to sail."


def memd_flags(model_dir) -> tuple[str, ...]:
    return ("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir), "--block-size", "16")


async def turn(inferd, session: str, prompt: str, max_tokens: int) -> dict:
    rc, out, err = await inferctl(inferd.address, "generate", prompt, "--session", session, "--max-tokens",
                                  str(max_tokens), "--ignore-eos", "--json")
    assert rc == 0, err
    return json.loads(out)


async def attachments(inferd, count: int) -> None:
    await inferd.log.wait_for("attached to memd", nth=count)


async def test_parked_and_swapped_chats_survive_a_memd_kill_and_resume_with_the_same_answer(
        memd_factory, inferd_factory, model_dir, model_judge):
    memd = await memd_factory(*memd_flags(model_dir))
    inferd = await inferd_factory(model_dir, memd.address)
    first = {s: await turn(inferd, s, PROMPT, 14) for s in ("parked", "swapped", "reference")}
    expected = await turn(inferd, "reference", "And then what happened?", 10)   # never interrupted
    async with memd.admin() as admin:
        evicted = await admin.evict(session_id="swapped", mode="swap")
        assert len(evicted.swapped) == 1

    await memd.kill()                                      # kill -9: no goodbye, no flush at exit
    await inferd.log.wait_for("lost memd; reconnecting")
    again = await memd_factory(*memd_flags(model_dir), "--listen", memd.address)
    recovered = await again.log.wait_for("recovered the sequences of the memd before")
    assert recovered["sequences"] == {"parked": 2, "swapped": 1} and recovered["dropped"] == {}
    await attachments(inferd, 2)
    assert await health(inferd) == "SERVING"

    history = first["parked"]["usage"]["prompt_tokens"] + 14
    question, encode = "And then what happened?", model_judge.encode
    for session in ("parked", "swapped"):
        second = await turn(inferd, session, question, 10)
        model_judge.assert_same_chats({session: [
            (encode(PROMPT), first[session]["token_ids"], first["reference"]["token_ids"]),
            (encode(question), second["token_ids"], expected["token_ids"])]})
        assert second["usage"]["cached_tokens"] == history - 1, session     # its KV, not a recompute
    states, _, ok = await memd_state(again)
    assert states == {"running": 0, "parked": 3, "swapped": 0, "dropped": 0} and ok


async def test_a_clean_restart_keeps_sessions_and_another_pool_size_recomputes_them(
        memd_factory, inferd_factory, model_dir, model_judge):
    memd = await memd_factory(*memd_flags(model_dir))
    inferd = await inferd_factory(model_dir, memd.address)
    kept = await turn(inferd, "kept", PROMPT, 8)
    expected = await turn(inferd, "kept", "Go on.", 6)
    first = await turn(inferd, "chat", PROMPT, 8)

    assert await memd.stop() == 0                          # SIGTERM, as systemctl restart sends
    await inferd.log.wait_for("lost memd; reconnecting")
    bigger = ("--device", "cpu", "--pool-bytes", "12MiB", "--model", str(model_dir), "--block-size", "16")
    again = await memd_factory(*bigger, "--listen", memd.address)
    recovered = await again.log.wait_for("recovered the sequences of the memd before")
    assert recovered["sequences"] == {"dropped": 2} and recovered["dropped"] == {"pool not reopened": 2}
    await attachments(inferd, 2)
    second = await turn(inferd, "chat", "Go on.", 6)
    model_judge.assert_same_chats({"chat": [                   # recomputed from the kept token ids
        (model_judge.encode(PROMPT), first["token_ids"], kept["token_ids"]),
        (model_judge.encode("Go on."), second["token_ids"], expected["token_ids"])]})
    assert second["usage"]["cached_tokens"] < second["usage"]["prompt_tokens"] // 2
    states, _, ok = await memd_state(again)
    assert states["parked"] == 1 and states["dropped"] == 1 and ok


async def test_requests_running_when_memd_dies_fail_with_unavailable_and_queued_ones_wait_for_it(
        memd_factory, inferd_factory, model_dir):
    memd = await memd_factory(*memd_flags(model_dir))
    inferd = await inferd_factory(model_dir, memd.address, "--max-num-seqs", "1")
    async with grpc.aio.insecure_channel(inferd.address) as channel:
        stub = pb_grpc.InferdStub(channel)
        running = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=4000, ignore_eos=True))
        assert (await running.read()).token_ids          # admitted: it holds a sequence in memd
        queued = stub.Generate(pb.GenerateRequest(prompt="Hello there", max_tokens=5, ignore_eos=True))
        await queued.initial_metadata()                    # sent once inferd queued it, behind the one seat
        await memd.kill()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            while await running.read() is not grpc.aio.EOF:
                pass
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "memd went away" in failed.value.details()
        await memd_factory(*memd_flags(model_dir), "--listen", memd.address)
        tokens = []
        while (reply := await queued.read()) is not grpc.aio.EOF:
            tokens += reply.token_ids
        assert len(tokens) == 5                            # it never touched memd: it waited and ran


async def test_a_step_after_memd_died_under_an_open_steps_call_fails_as_memd_gone(memd_factory, model_dir):
    """The Steps stream may already be over when the next Step is written: that too is memd gone, never a
    bare InvalidStateError (which a scheduler took for its own bug: INTERNAL to every client)."""
    memd = await memd_factory(*memd_flags(model_dir))
    client = await MemdClient.attach(memd.address, block_size=16, name="w", map_memory=False)
    try:
        await client.step(Open(list(range(20)), reserve=1))          # the Steps call is open
        steps, = client._idle_calls
        await memd.kill()
        assert await steps.code() == grpc.StatusCode.UNAVAILABLE   # the call has ended, as memd's death ends it
        with pytest.raises(MemdError) as failed:
            await client.step(Open(list(range(20)), reserve=1))
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        with contextlib.suppress(Exception):
            await client.close()


async def test_a_freed_sequences_id_is_never_handed_out_again_after_restarts(memd_factory, spawn_worker):
    flags = ("--device", "cpu", "--pool-bytes", "1MiB", "--block-bytes", "64KiB")
    memd = await memd_factory(*flags)
    worker = await spawn_worker(memd.address)
    kept, = await worker.step({"kind": "open", "token_ids": list(range(40)), "session_id": "kept"})
    await worker.step({"kind": "park", "seq_id": kept["seq_id"], "commit_to": 40})
    gone, = await worker.step({"kind": "open", "token_ids": list(range(8))})
    await worker.step({"kind": "free", "seq_id": gone["seq_id"]})      # the highest id handed out, now free

    await memd.kill()
    again = await memd_factory(*flags, "--listen", memd.address)        # journals the live state: "kept" alone
    await again.log.wait_for("recovered the sequences of the memd before")
    assert await again.stop() == 0
    third = await memd_factory(*flags, "--listen", memd.address)        # reads what the second one journaled
    recovered = await third.log.wait_for("recovered the sequences of the memd before")
    assert recovered["sequences"] == {"parked": 1}

    await worker.call("attach", address=third.address, block_size=16)
    new, = await worker.step({"kind": "open", "token_ids": list(range(8))})
    assert new["seq_id"] > gone["seq_id"]
    error = await worker.step_error({"kind": "free", "seq_id": gone["seq_id"]})
    assert error["code"] == "NOT_FOUND"              # whoever still holds the old id reaches nothing by it
    states, _, ok = await memd_state(third)
    assert states == {"running": 1, "parked": 1, "swapped": 0, "dropped": 0} and ok


async def test_files_a_failed_start_made_anew_are_not_reopened_as_the_journal_befores(
        memd_factory, spawn_worker, tmp_path):
    state = tmp_path / "state"
    flags = ("--device", "cpu", "--pool-bytes", "1MiB", "--block-bytes", "64KiB", "--state-dir", str(state))
    memd = await memd_factory(*flags)
    worker = await spawn_worker(memd.address)
    for session in ("parked", "swapped"):
        opened, = await worker.step({"kind": "open", "token_ids": list(range(40)), "session_id": session})
        await worker.step({"kind": "park", "seq_id": opened["seq_id"], "commit_to": 40})
    async with memd.admin() as admin:
        assert len((await admin.evict(session_id="swapped", mode="swap")).swapped) == 1
    assert await memd.stop() == 0
    sizes = {name: (state / name).stat().st_size for name in ("pool", "swap")}
    # A start with blocks twice the size (the same bytes) makes its files anew, zeroed, and fails before its
    # journal replaces the one before (here: it cannot write it). The pages that journal names are gone.
    (state / "journal.new").mkdir()
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "1MiB", "--block-bytes", "128KiB",
                             "--state-dir", str(state), "--listen", f"unix:{tmp_path}/other.sock")
    assert rc == 1 and "cannot write the journal" in err
    assert not (state / "pool").exists() and not (state / "swap").exists()     # it removed what it made
    assert (state / "pool.new").exists() and (state / "journal").exists()
    (state / "journal.new").rmdir()
    # Killed there instead, it would have left its files: zeroed, of the sizes the journal's layout has too.
    for name, size in sizes.items():
        (state / name).write_bytes(bytes(size))

    again = await memd_factory(*flags, "--listen", memd.address)
    recovered = await again.log.wait_for("recovered the sequences of the memd before")
    assert recovered["sequences"] == {"dropped": 2}
    assert recovered["dropped"] == {"pool not reopened": 1, "swap tier not reopened": 1}
    assert await again.stop() == 0
    third = await memd_factory(*flags, "--listen", memd.address)    # the files the second made are its journal's
    recovered = await third.log.wait_for("recovered the sequences of the memd before")
    assert recovered["sequences"] == {"dropped": 2} and recovered["dropped"] == {}
    assert not list(state.glob("*.new"))


async def test_a_state_dir_serves_one_memd_at_a_time(memd_factory, tmp_path):
    state = tmp_path / "state"
    flags = ("--device", "cpu", "--pool-bytes", "1MiB", "--block-bytes", "64KiB", "--state-dir", str(state))
    await memd_factory(*flags)
    rc, err = await run_memd(*flags, "--listen", f"unix:{tmp_path}/other.sock")
    assert rc == 1 and err.strip().startswith(f"memd: the state directory {state} is in use by another memd")


@pytest.mark.processes
async def test_a_state_dir_others_may_write_to_is_refused(tmp_path):
    # /dev/shm is everyone's: a directory another user made there first must not receive the pool.
    state = tmp_path / "shared"
    state.mkdir(mode=0o777)
    state.chmod(0o777)
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "1MiB", "--block-bytes", "64KiB",
                             "--listen", f"unix:{tmp_path}/m.sock", "--state-dir", str(state))
    assert rc == 1 and err.strip() == (f"memd: the state directory {state} may be written by others (mode 777): "
                                       "chmod go-w it, or give memd another --state-dir")
    assert list(state.iterdir()) == []


async def test_a_journal_that_is_not_one_is_discarded_and_memd_starts_empty(memd_factory, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "journal").write_bytes(msgpack.packb(["H", {"format": "something else"}]))
    (state / "pool").write_bytes(b"\1" * 4096)
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "1MiB", "--block-bytes", "64KiB",
                              "--state-dir", str(state))
    discarded = await memd.log.wait_for("discarded the state of an earlier memd")
    assert "not a kvpool journal" in discarded["reason"] and set(discarded["files"]) == {"pool", "journal"}
    states, used, ok = await memd_state(memd)
    assert not any(states.values()) and used == 0 and ok
    assert (state / "pool").stat().st_size == 1 << 20


async def test_state_dir_none_keeps_nothing(memd_factory, spawn_worker, tmp_path):
    flags = ("--device", "cpu", "--pool-bytes", "1MiB", "--block-bytes", "64KiB", "--state-dir", "none")
    memd = await memd_factory(*flags)
    worker = await spawn_worker(memd.address)
    opened, = await worker.step({"kind": "open", "token_ids": list(range(40)), "session_id": "gone"})
    await worker.step({"kind": "park", "seq_id": opened["seq_id"], "commit_to": 40})
    await memd.kill()
    again = await memd_factory(*flags, "--listen", memd.address)
    assert again.log.find("recovered the sequences of the memd before") is None
    states, used, ok = await memd_state(again)
    assert not any(states.values()) and used == 0 and ok
    assert not list(tmp_path.glob("*.state"))
