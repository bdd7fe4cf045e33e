"""A worker dies (kill -9) or hangs (SIGSTOP) in the middle of a turn; the client retries it on another.

Real memd and inferd processes. The retried turn must answer exactly what an
uninterrupted one does (greedy), memd must reclaim the dead worker at once
(its lease stream breaks) and the hung one after the lease, and at the end
nothing runs, nothing leaks and memd's invariants hold.
"""

from __future__ import annotations

import signal

import grpc
import pytest

from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc
from tests.test_inferd_service import memd_state, wait_until
from tests.test_memd_restart import attachments, memd_flags, turn

LONG_PROMPT = " ".join(f"word{i}" for i in range(150))      # a few hundred tokens
QUESTION = "What happened next, and why?"


def worker_id(inferd, nth: int = 0) -> int:
    return [e for e in inferd.log.events if e.get("event") == "attached to memd"][nth]["worker"]


async def session_row(memd, session: str):
    async with memd.admin() as admin:
        rows = [s for s in (await admin.snapshot(blocks=False)).sequences if s.session_id == session]
    return rows[0] if rows else None


async def start_turn(channel: grpc.aio.Channel, session: str, prompt: str, max_tokens: int):
    return pb_grpc.InferdStub(channel).Generate(pb.GenerateRequest(
        prompt=prompt, session_id=session, max_tokens=max_tokens, ignore_eos=True))


async def clean(memd) -> None:
    states, _, ok = await memd_state(memd)
    assert states["running"] == 0 and ok
    async with memd.admin() as admin:
        snapshot = await admin.snapshot()
    held = {b for s in snapshot.sequences for b in s.block_ids}
    assert all(row.ref_count == 0 or row.block_id in held for row in snapshot.blocks)     # no orphan page


async def test_a_worker_killed_mid_prefill_loses_nothing_and_the_retry_answers_the_same(
        memd_factory, inferd_factory, model_dir, model_judge):
    # The reference runs on a memd of its own: a prefix cached here would spare the slow worker its prefill.
    alone = await memd_factory(*memd_flags(model_dir), name="memd-reference")
    expected = await turn(await inferd_factory(model_dir, alone.address, name="reference"), "reference",
                          LONG_PROMPT, 8)
    memd = await memd_factory(*memd_flags(model_dir))
    slow = await inferd_factory(model_dir, memd.address, "--max-batch-tokens", "1", name="slow")   # a token a pass
    other = await inferd_factory(model_dir, memd.address, name="other")

    async with grpc.aio.insecure_channel(slow.address) as channel:
        call = await start_turn(channel, "chat", LONG_PROMPT, 8)

        async def prefilling() -> bool:
            row = await session_row(memd, "chat")
            return row is not None and row.state == "running"
        await wait_until(prefilling)
        await slow.kill()
        reclaimed = await memd.log.wait_for("worker reclaimed", worker=worker_id(slow))
        assert reclaimed["reason"] == "stream broken"
        streamed = []
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while (reply := await call.read()) is not grpc.aio.EOF:
                streamed += reply.token_ids
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and streamed == []    # killed before a token
    row = await session_row(memd, "chat")
    assert row.state == "parked"

    retried = await turn(other, "chat", LONG_PROMPT, 8)
    model_judge.assert_same(model_judge.encode(LONG_PROMPT), retried["token_ids"], expected["token_ids"])
    await clean(memd)


async def test_a_worker_killed_mid_decode_the_retry_answers_as_if_nothing_happened(
        memd_factory, inferd_factory, model_dir, model_judge):
    memd = await memd_factory(*memd_flags(model_dir))
    first = await inferd_factory(model_dir, memd.address, name="first")
    second = await inferd_factory(model_dir, memd.address, name="second")
    first_turns = {session: await turn(second, session, LONG_PROMPT, 6) for session in ("chat", "reference")}
    expected = await turn(second, "reference", QUESTION, 300)

    async with grpc.aio.insecure_channel(first.address) as channel:
        call = await start_turn(channel, "chat", QUESTION, 300)
        streamed = []
        while len(streamed) < 100:                          # well into the answer: blocks committed on the way
            streamed += (await call.read()).token_ids
        await first.kill()
    await memd.log.wait_for("worker reclaimed", worker=worker_id(first))
    row = await session_row(memd, "chat")
    assert row.state == "parked" and row.num_committed > expected["usage"]["prompt_tokens"]   # decode committed

    retried = await turn(second, "chat", QUESTION, 300)
    encode = model_judge.encode
    model_judge.assert_same_chats({"chat": [(encode(LONG_PROMPT), first_turns["chat"]["token_ids"],
                                             first_turns["reference"]["token_ids"]),
                                            (encode(QUESTION), retried["token_ids"], expected["token_ids"])]})
    history = encode(LONG_PROMPT) + first_turns["chat"]["token_ids"] + encode(QUESTION)
    model_judge.assert_same(history, streamed, retried["token_ids"][:len(streamed)], "streamed before the kill")
    assert retried["usage"]["cached_tokens"] > expected["usage"]["cached_tokens"]   # the failed turn's prefill kept
    async with memd.admin() as admin:
        assert (await admin.stats()).counters["turns_retried"] == 1
    await clean(memd)


async def test_a_worker_killed_while_memd_swaps_its_preempted_turn_out(memd_factory, inferd_factory, model_dir,
                                                                          model_judge):
    memd = await memd_factory(*memd_flags(model_dir), env={"SWAP_LATENCY_TEST": "1.5"})
    first = await inferd_factory(model_dir, memd.address, name="first")
    second = await inferd_factory(model_dir, memd.address, name="second")
    expected = await turn(second, "reference", LONG_PROMPT, 200)

    async with grpc.aio.insecure_channel(first.address) as channel:
        call = await start_turn(channel, "chat", LONG_PROMPT, 200)
        assert (await call.read()).token_ids
        async with memd.admin() as admin:                   # the operator takes the running turn's pages
            evicted = await admin.evict(session_id="chat", mode="swap")
        assert evicted.revoked

        async def swapping_out() -> bool:                   # the worker preempted it; memd copies it out (1.5 s)
            row = await session_row(memd, "chat")
            return row is not None and row.state == "parked"
        await wait_until(swapping_out)
        await first.kill()
    await memd.log.wait_for("worker reclaimed", worker=worker_id(first))
    await memd.log.wait_for("swapped out")
    assert (await session_row(memd, "chat")).state == "swapped"

    retried = await turn(second, "chat", LONG_PROMPT, 200)
    model_judge.assert_same(model_judge.encode(LONG_PROMPT), retried["token_ids"], expected["token_ids"])
    await clean(memd)


async def test_a_hung_worker_is_reclaimed_after_its_lease_and_attaches_again_when_it_wakes(
        memd_factory, inferd_factory, model_dir, model_judge):
    memd = await memd_factory(*memd_flags(model_dir), "--lease-timeout", "3")
    hung = await inferd_factory(model_dir, memd.address, name="hung")
    idle = await inferd_factory(model_dir, memd.address, name="idle")
    expected = await turn(idle, "reference", LONG_PROMPT, 300)

    async with grpc.aio.insecure_channel(hung.address) as channel:
        call = await start_turn(channel, "chat", LONG_PROMPT, 300)
        assert (await call.read()).token_ids
        hung.proc.send_signal(signal.SIGSTOP)
        reclaimed = await memd.log.wait_for("worker reclaimed", worker=worker_id(hung))
        assert reclaimed["reason"] == "lease expired"
        retried = await turn(idle, "chat", LONG_PROMPT, 300)
        model_judge.assert_same(model_judge.encode(LONG_PROMPT), retried["token_ids"], expected["token_ids"])

        hung.proc.send_signal(signal.SIGCONT)            # it wakes: memd no longer knows its lease
        code = None
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as err:
            code = err.code()
        assert code == grpc.StatusCode.UNAVAILABLE        # its turn is over: the client was answered elsewhere
    await attachments(hung, 2)
    # What its stalled pass might have written was fenced until now: it attached again, so that pass is over.
    assert memd.log.find("fence lifted", reason="it attached again: its last pass is over") is not None
    again = await turn(hung, "after", "Hello again", 5)
    assert len(again["token_ids"]) == 5
    # The idle worker sent nothing for many lease periods: its heartbeats alone kept it.
    assert memd.log.find("worker reclaimed", worker=worker_id(idle)) is None
    await clean(memd)


async def stats(memd):
    async with memd.admin() as admin:
        assert (await admin.check()).ok
        return await admin.stats(), await admin.snapshot()


async def test_pages_a_hung_worker_may_still_write_stay_fenced_until_its_process_exits(memd_factory, spawn_worker):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                              "--lease-timeout", "1")
    worker = await spawn_worker(memd.address)
    chat, scratch = await worker.step(
        {"kind": "open", "token_ids": list(range(20)), "reserve": 30, "session_id": "chat"},   # 4 pages
        {"kind": "open", "token_ids": list(range(20)), "reserve": 40})                         # 4 pages
    await worker.step({"kind": "extend", "seq_id": chat["seq_id"], "commit_to": 20},
                      {"kind": "extend", "seq_id": scratch["seq_id"], "commit_to": 20})
    worker.proc.send_signal(signal.SIGSTOP)          # hung mid-pass, as far as memd can tell
    await memd.log.wait_for("worker reclaimed", worker=worker.worker_id)
    fenced = await memd.log.wait_for("pages fenced until the worker's process exits or attaches again")
    # The chat keeps its 1 whole page; its partly written page and 2 reserved ones, and the scratch turn's
    # partial page and reserve (its one full page is free: nothing writes a full page), may take the hung
    # pass's writes.
    assert fenced["blocks"] == 6
    reply, snapshot = await stats(memd)
    assert reply.used_blocks == 1 + 6
    assert sum(row.state == "fenced" for row in snapshot.blocks) == 6

    await worker.kill()                               # the process is gone: nothing can write them now
    lifted = await memd.log.wait_for("fence lifted")
    assert lifted["blocks_freed"] == 6 and lifted["reason"] == "its process exited"
    reply, _ = await stats(memd)
    assert reply.used_blocks == 1


async def test_the_page_a_hung_worker_was_writing_goes_to_no_one_until_it_exits(memd_factory, spawn_worker):
    # Turn 2 of a chat writes on into the page where turn 1 ended. Kept by the session after the reclaim,
    # that page went to whoever wrote next (the session's retry elsewhere, or a new tenant once the
    # session was evicted or reset), and the hung worker's late pass then wrote into their K/V.
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                              "--lease-timeout", "3")     # long enough that `other` keeps its lease on a busy box
    hung = await spawn_worker(memd.address)
    other = await spawn_worker(memd.address)
    turn1, = await hung.step({"kind": "open", "token_ids": list(range(20)), "session_id": "chat"})
    await hung.step({"kind": "park", "seq_id": turn1["seq_id"], "commit_to": 20})
    turn2, = await hung.step({"kind": "open", "token_ids": list(range(20, 30)), "session_id": "chat",
                              "continue_session": True, "reserve": 4})
    whole, partial = turn2["block_ids"][:2]
    assert turn2["num_committed"] == 20 and partial == turn1["block_ids"][1]
    hung.proc.send_signal(signal.SIGSTOP)             # hung mid-pass, writing turn 2 into `partial`
    await memd.log.wait_for("worker reclaimed", worker=hung.worker_id)
    row = await session_row(memd, "chat")
    assert row.state == "parked" and row.num_committed == 16 and list(row.block_ids) == [whole]

    retried, = await other.step({"kind": "resume", "session_id": "chat", "reserve": 4})
    assert retried["num_committed"] == 16 and retried["token_ids"] == list(range(30))   # 4 tokens to recompute
    assert retried["block_ids"][0] == whole and partial not in retried["block_ids"]
    await other.step({"kind": "free", "seq_id": retried["seq_id"]})                      # the user resets
    taken, = await other.step({"kind": "open", "token_ids": list(range(100, 163))})     # pages freed first
    assert partial not in taken["block_ids"]
    written = [await other.call("write", block=b, seed=i) for i, b in enumerate(taken["block_ids"])]

    hung.proc.send_signal(signal.SIGCONT)
    await hung.call("write_bytes", block=partial, offset=4 * 256, data=[9] * 256)      # its late pass lands
    for block, page in zip(taken["block_ids"], written, strict=True):
        assert (await other.call("read", block=block))["digest"] == page["digest"]
    await hung.kill()
    lifted = await memd.log.wait_for("fence lifted")
    assert lifted["reason"] == "its process exited" and lifted["blocks_freed"] >= 1
    reply, _ = await stats(memd)
    assert reply.used_blocks == len(taken["block_ids"])           # the new tenant's: `whole` is cached, free


async def test_a_restarted_memd_fences_what_the_workers_of_the_one_before_may_still_write(
        memd_factory, spawn_worker):
    flags = ("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB")
    memd = await memd_factory(*flags)
    worker = await spawn_worker(memd.address)
    chat, = await worker.step({"kind": "open", "token_ids": list(range(20)), "reserve": 30, "session_id": "chat"})
    await worker.step({"kind": "extend", "seq_id": chat["seq_id"], "commit_to": 20})
    await memd.kill()                                 # the worker lives on, maybe mid-pass
    again = await memd_factory(*flags, "--listen", memd.address)
    recovered = await again.log.wait_for("recovered the sequences of the memd before")
    # The chat keeps its 1 whole page; its partly written page and 2 reserved ones stay the worker's.
    assert recovered["sequences"] == {"parked": 1} and list(recovered["fenced"].values()) == [3]
    reply, _ = await stats(again)
    assert reply.used_blocks == 1 + 3
    await worker.kill()
    assert (await again.log.wait_for("fence lifted"))["blocks_freed"] == 3
    reply, _ = await stats(again)
    assert reply.used_blocks == 1 and reply.sequences["parked"] == 1
