"""Verified reuse: a page whose bytes are not what its worker committed is never read as K/V again.

The worker sends each page's checksum with the op that commits it; memd
checks pages against them on swap-out, swap-in, after a restart and in a
scrub. The pages are corrupted here in place (in memd's own pool and swap
tier, or in its state directory's files), as a bad DIMM, a stray write or a
disk would. Each time the next turn must still equal `transformers` on the
whole conversation, with the K/V before the rotten page reused and the rest
recomputed.
"""

from __future__ import annotations

import json

import pytest
from scheduling import BS, assert_clean, collect, greedy, start_scheduler

from inferd.scheduler import Request
from memd.eviction import Evicted
from memd.manager import KvManager
from memd.page_effects import SwapIn
from memd.sequences import token_bytes
from shared.geometry import PoolGeometry
from shared.ops import Extend, Fork, Free, Open, Park, Resume
from tests.test_inferd_service import memctl
from tests.test_memd_restart import turn

PROMPT = [5 + i for i in range(30)]


async def chat(local_memd_factory, checkpoint, session: str | None = "chat", *, memd_args=("--swap-ratio", "0.5")):
    """A scheduler on an in-process memd, and one finished turn of 30 + 6 tokens."""
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=64,
                                                          memd_args=memd_args)
    first = Request(PROMPT, greedy(6), session_id=session)
    scheduler.submit(first)
    answer, _, _ = await collect(first)
    return memd, client, scheduler, task, answer


def rot(view, index: int, block_bytes: int) -> None:
    """Flip bytes in the middle of page (or slot) `index` of a pool or swap tier's memory."""
    middle = index * block_bytes + block_bytes // 2
    view[middle:middle + 32] = bytes(255 - b for b in view[middle:middle + 32])
    view.release()


async def next_turn(scheduler, judge, answer, *, session: str | None = "chat"):
    """The session's next turn, judged on the whole conversation; returns its final event."""
    second = Request([7, 8, 9], greedy(6), session_id=session)
    scheduler.submit(second)
    got, _, final = await collect(second)
    judge.assert_greedy(PROMPT + answer + [7, 8, 9], got, 6, "the turn after the rotten page")
    return final


async def counters(memd) -> dict[str, int]:
    async with memd.admin() as admin:
        return dict((await admin.stats()).counters)


async def test_the_worker_sends_a_checksum_for_every_page_it_commits(local_memd_factory, checkpoint):
    memd, client, _, task, answer = await chat(local_memd_factory, checkpoint)
    seq = memd.manager.seqs[memd.manager.sessions["chat"]]
    # 35 tokens committed (the last sampled one has no K/V yet): 8 full pages and the parked partial one.
    assert seq.num_committed == len(PROMPT) + len(answer) - 1 and len(seq.block_ids) == 9
    pool = memd.manager.pool
    assert [pool.checksum[b] for b in seq.block_ids] == memd.memory.checksums(seq.block_ids)
    task.cancel()
    await client.close()


async def test_a_scrub_finds_a_parked_page_that_rotted_and_the_next_turn_recomputes_from_it(
        local_memd_factory, checkpoint, judge):
    memd, client, scheduler, task, answer = await chat(local_memd_factory, checkpoint)
    seq = memd.manager.seqs[memd.manager.sessions["chat"]]
    block = seq.block_ids[3]
    rot(memd.memory.view(), block, memd.manager.geometry.block_bytes)
    async with memd.admin() as admin:
        found = await admin.scrub()
        assert [(f.where, f.index, list(f.seq_ids), list(f.sessions)) for f in found.failures] == \
            [("page", block, [seq.seq_id], ["chat"])]
        assert found.pages >= 9 and not (await admin.scrub()).failures          # dropped: clean now
    assert seq.num_committed == 3 * BS and len(seq.block_ids) == 3
    got = await counters(memd)
    assert got["integrity_failures"] == 1 and got["integrity_failures_scrub"] == 1
    final = await next_turn(scheduler, judge, answer)
    assert final.usage["cached_tokens"] == 3 * BS                       # the pages before it, no more
    await assert_clean(memd, parked=1)
    task.cancel()
    await client.close()


async def test_a_scrub_finds_a_swapped_page_that_rotted_in_its_slot(local_memd_factory, checkpoint, judge):
    memd, client, scheduler, task, answer = await chat(local_memd_factory, checkpoint)
    async with memd.admin() as admin:
        await admin.evict(session_id="chat", mode="swap")
    seq = memd.manager.seqs[memd.manager.sessions["chat"]]
    assert seq.state.value == "swapped"
    slot = seq.slots[5]
    rot(memd.swap.view(), slot, memd.manager.geometry.block_bytes)
    async with memd.admin() as admin:
        found = await admin.scrub()
        assert [(f.where, f.index, list(f.sessions)) for f in found.failures] == [("slot", slot, ["chat"])]
        assert found.slots == 9 and not (await admin.scrub()).failures
    assert seq.num_committed == 5 * BS and len(seq.slots) == 5
    final = await next_turn(scheduler, judge, answer)
    assert final.usage["cached_tokens"] == 5 * BS
    assert (await counters(memd))["integrity_failures_scrub"] == 1
    await assert_clean(memd, parked=1)
    task.cancel()
    await client.close()


async def test_a_swap_out_finds_a_parked_page_that_rotted_before_it(local_memd_factory, checkpoint, judge):
    memd, client, scheduler, task, answer = await chat(local_memd_factory, checkpoint)
    seq = memd.manager.seqs[memd.manager.sessions["chat"]]
    rot(memd.memory.view(), seq.block_ids[2], memd.manager.geometry.block_bytes)
    async with memd.admin() as admin:
        await admin.evict(session_id="chat", mode="swap")
    assert seq.state.value == "swapped" and len(seq.slots) == 2          # the rot did not go to the swap tier
    assert (await counters(memd))["integrity_failures_swap_out"] == 1
    final = await next_turn(scheduler, judge, answer)
    assert final.usage["cached_tokens"] == 2 * BS
    await assert_clean(memd, parked=1)
    task.cancel()
    await client.close()


async def test_a_cached_page_that_rotted_leaves_the_prefix_cache(local_memd_factory, checkpoint, judge):
    memd, client, scheduler, task, _ = await chat(local_memd_factory, checkpoint, session=None)
    pool = memd.manager.pool
    cached = [b for b in range(pool.num_blocks) if pool.hash_of[b] is not None and pool.ref[b] == 0]
    assert len(cached) == 8                              # the request's full pages stay cached once freed
    second = next(b for b in cached if pool.tokens_of[b] == token_bytes(PROMPT[BS:2 * BS]))
    rot(memd.memory.view(), second, memd.manager.geometry.block_bytes)
    async with memd.admin() as admin:
        found = await admin.scrub()
    assert [(f.where, f.index, list(f.seq_ids)) for f in found.failures] == [("page", second, [])]
    assert pool.hash_of[second] is None
    again = Request(PROMPT, greedy(6))
    scheduler.submit(again)
    got, _, final = await collect(again)
    judge.assert_greedy(PROMPT, got, 6, "the same prompt after a cached page rotted")
    assert final.usage["cached_tokens"] == BS          # the first page; the chain breaks at the rotten one
    await assert_clean(memd)
    task.cancel()
    await client.close()


async def test_verify_reuse_recomputes_prefix_hits_and_drops_cached_kv_that_differs(
        local_memd_factory, checkpoint, judge):
    """K/V that is wrong but whose checksum matches (a bad kernel's, not a rotten page): only a recompute sees it."""
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=64,
                                                          verify_reuse=1.0)

    async def ask() -> dict:
        request = Request(PROMPT, greedy(6))
        scheduler.submit(request)
        got, _, final = await collect(request)
        judge.assert_greedy(PROMPT, got, 6, "a prompt whose prefix was cached")
        return final.usage

    await ask()
    assert (await ask())["cached_tokens"] == 7 * BS                      # a clean hit: checked, and kept
    check = scheduler.reuse_check
    assert (check.checks, check.mismatches) == (1, 0)
    pool = memd.manager.pool
    third = next(b for b in range(pool.num_blocks) if pool.tokens_of[b] == token_bytes(PROMPT[2 * BS:3 * BS]))
    scheduler.model.kv[third] += 0.5
    pool.checksum[third] = memd.memory.checksums([third])[0]
    assert (await ask())["cached_tokens"] == 2 * BS                      # started over without the bad block
    assert check.mismatches == 1 and pool.hash_of[third] is None
    got = await counters(memd)
    assert got["integrity_failures"] == 1 and got["integrity_failures_spot_check"] == 1
    await assert_clean(memd)
    task.cancel()
    await client.close()


def test_a_rotten_page_shared_by_two_sequences_swapping_out_together_cuts_both_cleanly():
    m = KvManager(PoolGeometry(32, 4096, 4), hash_key=b"k" * 32, swap_slots=16)
    worker = m.attach("w", 1000, "m", 4, 0).worker_id
    a = m.step(worker, [Open(list(range(1, 14)), reserve=1, session_id="a")]).results[0].seq_id
    m.step(worker, [Extend(a, commit_to=12, sums_from=0, page_sums=[11, 12, 13])])
    b = m.step(worker, [Fork(a, session_id="b")]).results[0].seq_id
    m.step(worker, [Park(a, commit_to=12), Park(b)])
    jobs = [m.evictions.begin_swap_out(m.seqs[s], None, Evicted()) for s in (a, b)]
    for job in jobs:
        job.checksums = [11, 99, 13]                  # what the copies found: the shared second page rotted
    assert m.evictions.finish_swap_out(jobs[0])
    assert not m.evictions.finish_swap_out(jobs[1])   # cut while it copied: it no longer counts
    assert (m.seqs[a].state.value, len(m.seqs[a].slots), m.seqs[b].num_committed) == ("swapped", 1, 4)
    assert m.counters["integrity_failures_swap_out"] == 1 and m.violations() == []


def test_a_failed_swap_in_gives_back_the_shared_pages_after_it_rather_than_let_the_worker_write_them():
    m = KvManager(PoolGeometry(12, 4096, 4), hash_key=b"k" * 32, swap_slots=16)
    worker = m.attach("w", 1000, "m", 4, 0).worker_id
    x = m.step(worker, [Open(list(range(1, 18)), session_id="x")]).results[0].seq_id
    m.step(worker, [Park(x, commit_to=16, sums_from=0, page_sums=[10, 11, 12, 13])])
    seq = m.seqs[x]
    job = m.evictions.begin_swap_out(seq, None, Evicted())
    job.checksums = [10, 11, 12, 13]
    m.evictions.finish_swap_out(job)
    # Another request takes the pages that held x's first two blocks: those come back by copy, the rest
    # are still cached in the pool and are shared.
    uncached = sum(1 for block in m.pool.free if m.pool.hash_of[block] is None)
    y = m.step(worker, [Open([99] * ((uncached + 2) * 4))]).results[0].seq_id
    out = m.step(worker, [Free(y), Resume(session_id="x", reserve=1)])
    copied = [page for e in out.effects if isinstance(e, SwapIn) for page in e.pages]
    assert len(copied) == 2 and len(seq.block_ids) == 5
    m.effects_landed(out, [copied[1]])                # the second page came back rotten
    result, = [r for r in out.results if r.seq_id == x]
    assert seq.num_committed == result.num_committed == 4 and result.block_ids == seq.block_ids
    assert len(seq.block_ids) == 1 and m.violations() == []


# ---- real memd and inferd processes ---------------------------------------------------------------

TEXT, OTHER, QUESTION = "Tell me a story about a cat who learned to sail.", "Name three rivers.", "And then?"


def memd_flags(model_dir, state) -> tuple[str, ...]:
    return ("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir), "--block-size", "16",
            "--state-dir", str(state))


def rot_file(path, index: int, block_bytes: int) -> None:
    """Flip bytes in the middle of page (or slot) `index` of a pool or swap file."""
    with open(path, "r+b") as f:
        f.seek(index * block_bytes + block_bytes // 2)
        data = f.read(32)
        f.seek(index * block_bytes + block_bytes // 2)
        f.write(bytes(255 - b for b in data))


async def session_row(memd, session: str):
    async with memd.admin() as admin:
        rows = (await admin.snapshot(blocks=False)).sequences
        return next(r for r in rows if r.session_id == session), (await admin.stats()).block_bytes


def assert_next_turn(judge, prompt: str, first: dict, second: dict, what: str) -> None:
    history = judge.encode(prompt) + first["token_ids"] + judge.encode(QUESTION)
    judge.assert_greedy(history, second["token_ids"], 10, what)


async def test_a_page_that_rotted_in_the_state_directory_while_memd_was_down_is_recomputed(
        memd_factory, inferd_factory, model_dir, model_judge, tmp_path):
    state = tmp_path / "state"
    memd = await memd_factory(*memd_flags(model_dir, state))
    inferd = await inferd_factory(model_dir, memd.address)
    first = await turn(inferd, "chat", TEXT, 14)
    row, block_bytes = await session_row(memd, "chat")
    index = len(row.block_ids) // 2
    assert index >= 1

    assert await memd.stop() == 0
    await inferd.log.wait_for("lost memd; reconnecting")
    rot_file(state / "pool", row.block_ids[index], block_bytes)
    again = await memd_factory(*memd_flags(model_dir, state), "--listen", memd.address)
    checked = await again.log.wait_for("checked the reopened pages")
    assert checked["pages"] == len(row.block_ids) and checked["failed"] == 1
    await inferd.log.wait_for("attached to memd", nth=2)

    second = await turn(inferd, "chat", QUESTION, 10)
    assert_next_turn(model_judge, TEXT, first, second, "the turn after a page rotted while memd was down")
    assert second["usage"]["cached_tokens"] == index * 16          # the pages before the rotten one, no more
    async with again.admin() as admin:
        counters = (await admin.stats()).counters
        assert (await admin.check()).ok
    assert counters["integrity_failures"] == 1 and counters["integrity_failures_restart"] == 1


async def test_memctl_scrub_exits_1_on_rotten_pages_then_0_and_the_next_turns_are_right(
        memd_factory, inferd_factory, model_dir, model_judge, tmp_path):
    state = tmp_path / "state"
    memd = await memd_factory(*memd_flags(model_dir, state))
    inferd = await inferd_factory(model_dir, memd.address)
    prompts = {"parked": TEXT, "swapped": OTHER}
    first = {session: await turn(inferd, session, prompt, 14) for session, prompt in prompts.items()}
    rc, out, err = await memctl(memd.address, "evict", "--session", "swapped", "--swap")
    assert rc == 0, err
    parked, block_bytes = await session_row(memd, "parked")
    page = parked.block_ids[1]
    rot_file(state / "pool", page, block_bytes)
    swap = (state / "swap").read_bytes()
    slots = [i for i in range(len(swap) // block_bytes) if any(swap[i * block_bytes:(i + 1) * block_bytes])]
    rot_file(state / "swap", slots[1], block_bytes)                 # what the swap-out wrote, in place

    rc, out, err = await memctl(memd.address, "scrub")
    assert rc == 1, err
    assert f"block {page}: seq {parked.seq_id}, session 'parked'" in out
    assert f"swap slot {slots[1]}:" in out and "session 'swapped'" in out and "2 corrupted" in out
    rc, out, err = await memctl(memd.address, "scrub", "--rate", "50", "--json")
    assert rc == 0, err
    assert json.loads(out)["failures"] == [] and json.loads(out)["slots"] == 1     # cut before the rot
    rc, out, _ = await memctl(memd.address, "stats", "--json")
    counters = json.loads(out)["counters"]
    assert counters["integrity_failures"] == 2 and counters["integrity_failures_scrub"] == 2

    for session, prompt in prompts.items():
        second = await turn(inferd, session, QUESTION, 10)
        assert_next_turn(model_judge, prompt, first[session], second, f"{session}, after its page rotted")
        assert second["usage"]["cached_tokens"] == 16, session      # one page kept before the rotten one


def test_bad_verification_flags_are_refused_in_one_line(capsys):
    from inferd.__main__ import build_parser as inferd_parser
    from memd.__main__ import build_parser as memd_parser
    from memd.memctl import build_parser as memctl_parser

    serve = ["serve", "--model", "m", "--verify-reuse", "1.5"]
    for parser, argv, flag in ((inferd_parser()[0], serve, "--verify-reuse"),
                               (memctl_parser(), ["scrub", "--rate", "-1"], "--rate"),
                               (memctl_parser(), ["scrub", "--rate", "nan"], "--rate"),
                               (memd_parser(), ["--scrub-interval", "-1"], "--scrub-interval")):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and flag in err.splitlines()[-1], err


async def test_a_turn_a_stop_string_ends_while_a_pass_ran_ahead_parks_pages_whose_sums_hold(local_memd_factory,
                                                                                            checkpoint):
    """The forward thread runs the next pass while a turn's tokens stream; the stop string that ends the turn
    is found only then, so that pass may be writing the last page as the turn parks: its sum must be taken
    after it, or memd would find its own parked page rotten."""
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=64)
    probe = Request(PROMPT, greedy(16))
    scheduler.submit(probe)
    _, text, _ = await collect(probe)
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text.find(text[i:i + 2]) == i)
    ended = Request(PROMPT, greedy(16, stop=(stop,)), session_id="chat")
    scheduler.submit(ended)
    _, shown, final = await collect(ended)
    assert final.finish_reason == "stop" and shown == text[:text.find(stop)]
    assert scheduler.forward_thread.ahead_taken > 0
    seq = memd.manager.seqs[memd.manager.sessions["chat"]]
    pool = memd.manager.pool
    assert [pool.checksum[b] for b in seq.block_ids] == memd.memory.checksums(seq.block_ids)
    async with memd.admin() as admin:
        assert not (await admin.scrub()).failures
    await assert_clean(memd, parked=1)                  # the turn parked, the pass run ahead left nothing held
    task.cancel()
    await client.close()
