"""Continuous batching on a real memd: outputs, sessions and every way a request ends."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest
from scheduling import BS, assert_clean, collect, greedy, on_step, start_scheduler

from inferd.sampling import SamplingParams
from inferd.scheduler import GenerationError, Request
from shared.ops import Extend, Free, Open

transformers = pytest.importorskip("transformers")


async def test_concurrent_requests_match_transformers_and_leave_nothing(served, judge):
    memd, scheduler = served
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 3, 4, 7, 9, 16, 21, 30)]
    requests = [Request(p, greedy(12)) for p in prompts]
    for request in requests:
        scheduler.submit(request)
    results = await asyncio.gather(*[collect(r) for r in requests])
    for prompt, (tokens, _, final) in zip(prompts, results, strict=True):
        assert final.finish_reason == "length" and len(tokens) == 12
        judge.assert_greedy(prompt, tokens, 12)
        assert final.usage["completion_tokens"] == 12 and final.usage["prompt_tokens"] == len(prompt)
    assert scheduler.forward_thread.ahead_taken > 0      # most passes were run ahead, and the tokens are right
    stats = await assert_clean(memd)
    assert stats.used_blocks == 0


async def test_a_second_turn_reuses_the_first_and_matches_a_full_recompute(served, judge):
    memd, scheduler = served
    turn1 = Request([10, 20, 30, 40, 50, 60, 70], greedy(6), session_id="chat")
    scheduler.submit(turn1)
    out1, _, final1 = await collect(turn1)
    assert final1.usage["cached_tokens"] == 0
    await assert_clean(memd, parked=1)

    turn2 = Request([80, 90, 100], greedy(6), session_id="chat")
    scheduler.submit(turn2)
    out2, _, final2 = await collect(turn2)
    history = [10, 20, 30, 40, 50, 60, 70] + out1
    assert final2.usage["cached_tokens"] == len(history) - 1       # the last sampled token was never computed
    assert final2.usage["prompt_tokens"] == len(history) + 3
    judge.assert_greedy(history + [80, 90, 100], out2, 6)
    await assert_clean(memd, parked=1)


async def test_a_cancelled_request_frees_its_pages(served):
    memd, scheduler = served
    request = Request(list(range(5, 25)), greedy(1000))
    scheduler.submit(request)
    first = await asyncio.wait_for(request.events.get(), 60)
    assert first.token_ids
    scheduler.cancel(request)
    _, _, final = await collect(request)
    assert final.finish_reason == "cancelled"
    stats = await assert_clean(memd)
    assert stats.used_blocks == 0


async def test_a_cancelled_turn_parks_what_it_computed(served):
    memd, scheduler = served
    request = Request(list(range(5, 25)), greedy(1000), session_id="s")
    scheduler.submit(request)
    await asyncio.wait_for(request.events.get(), 60)
    scheduler.cancel(request)
    _, _, final = await collect(request)
    assert final.finish_reason == "cancelled"
    await assert_clean(memd, parked=1)


async def test_a_stop_string_ends_the_request_without_showing_it(served):
    memd, scheduler = served
    probe = Request([1, 2, 3], greedy(8))
    scheduler.submit(probe)
    _, text, _ = await collect(probe)
    stop = text[3:5]                                    # two characters the model will produce
    assert stop
    request = Request([1, 2, 3], greedy(8, stop=(stop,)))
    scheduler.submit(request)
    _, shown, final = await collect(request)
    assert final.finish_reason == "stop" and shown == text[:text.find(stop)]
    await assert_clean(memd)


async def test_reset_forgets_a_session_and_refuses_an_unknown_one(served):
    memd, scheduler = served
    request = Request([7, 8, 9, 10, 11], greedy(3), session_id="forget-me")
    scheduler.submit(request)
    await collect(request)
    await assert_clean(memd, parked=1)
    await scheduler.reset("forget-me")
    stats = await assert_clean(memd, parked=0)
    assert stats.used_blocks == 0
    with pytest.raises(GenerationError) as err:
        await scheduler.reset("forget-me")
    assert err.value.code.name == "NOT_FOUND"


async def test_reset_during_a_turn_ends_it_and_frees_the_session(served):
    memd, scheduler = served
    request = Request(list(range(30, 50)), greedy(1000), session_id="busy")
    scheduler.submit(request)
    await asyncio.wait_for(request.events.get(), 60)
    await scheduler.reset("busy")
    _, _, final = await collect(request)
    assert final.finish_reason == "reset"
    stats = await assert_clean(memd, parked=0)
    assert stats.used_blocks == 0


async def test_bad_requests_are_refused_before_they_queue(served):
    _, scheduler = served
    with pytest.raises(GenerationError, match="empty"):
        scheduler.submit(Request([], greedy(3)))
    with pytest.raises(GenerationError, match="exceeds the model's 4096 positions"):
        scheduler.submit(Request([1] * 4000, greedy(200)))
    with pytest.raises(ValueError, match="top_p"):
        scheduler.submit(Request([1], SamplingParams(top_p=0.0)))
    assert not scheduler.waiting


async def test_admission_waits_for_pages_and_everyone_finishes(local_memd_factory, checkpoint, judge):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=24)
    try:
        prompts = [[i + 3] * 9 for i in range(6)]        # 6 x (9 + 10 tokens) needs ~30 blocks; the pool has 24
        requests = [Request(p, greedy(10)) for p in prompts]
        for request in requests:
            scheduler.submit(request)
        results = await asyncio.gather(*[collect(r) for r in requests])
        for prompt, (tokens, _, final) in zip(prompts, results, strict=True):
            assert final.error is None, final.error
            judge.assert_greedy(prompt, tokens, 10)
        await assert_clean(memd)
    finally:
        task.cancel()
        await client.close()


async def test_seeded_sampling_repeats(served):
    _, scheduler = served
    outs = []
    for _ in range(2):
        request = Request([4, 5, 6], SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=11,
                                                    ignore_eos=True))
        scheduler.submit(request)
        outs.append((await collect(request))[0])
    assert outs[0] == outs[1] and len(outs[0]) == 8


async def collect_n(request: Request, n: int) -> dict[int, list[int]]:
    outputs: dict[int, list[int]] = {i: [] for i in range(n)}
    finished = 0
    while finished < n:
        event = await asyncio.wait_for(request.events.get(), 120)
        assert event.error is None, event.error
        outputs[event.index] += event.token_ids
        finished += event.finish_reason is not None
    return outputs


async def test_n_completions_fork_the_prompt_and_match_single_runs(served):
    memd, scheduler = served
    prompt = list(range(40, 58))                          # four full blocks and a partial one to copy
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=100, ignore_eos=True)
    request = Request(prompt, replace_n(params, 3))
    scheduler.submit(request)
    outputs = await collect_n(request, 3)
    async with memd.admin() as admin:
        counters = (await admin.stats()).counters
    assert counters["forks"] == 2
    for index in range(3):                                # child i samples as a lone request seeded seed + i
        alone = Request(prompt, replace_n(params, 1, seed=100 + index))
        scheduler.submit(alone)
        tokens, _, _ = await collect(alone)
        assert outputs[index] == tokens and len(tokens) == 10
    assert len({tuple(v) for v in outputs.values()}) == 3
    stats = await assert_clean(memd)
    assert stats.used_blocks == 0


def replace_n(params: SamplingParams, n: int, **changes) -> SamplingParams:
    return replace(params, n=n, **changes)


async def test_n_with_a_session_is_refused(served):
    _, scheduler = served
    with pytest.raises(GenerationError, match="n > 1 cannot continue a session"):
        scheduler.submit(Request([1, 2], replace_n(greedy(3), 2), session_id="s"))


@pytest.mark.parametrize("memd_args, how", [(("--swap-ratio", "0.9"), "swap_outs"),
                                             (("--disable-swap",), "drops")], ids=["swapped", "recomputed"])
async def test_when_two_cannot_both_grow_the_newest_is_preempted_and_both_finish(local_memd_factory, checkpoint,
                                                                                 judge, memd_args, how):
    # 12 pages of 4 tokens; two requests that each grow to 9 pages cannot run side by side.
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=12,
                                                          memd_args=memd_args)
    try:
        older, newer = Request([3, 4, 5, 6], greedy(30)), Request([7, 8, 9, 10], greedy(30))
        scheduler.submit(older)
        scheduler.submit(newer)
        (old_tokens, _, old_final), (new_tokens, _, new_final) = await asyncio.gather(collect(older), collect(newer))
        assert old_final.error is None and new_final.error is None
        judge.assert_greedy(older.prompt_ids, old_tokens, 30)
        judge.assert_greedy(newer.prompt_ids, new_tokens, 30)
        assert newer.preemptions >= 1 and older.preemptions == 0      # the latest arrival gives way
        stats = await assert_clean(memd)
        assert stats.used_blocks == 0 and stats.counters["preemptions"] >= 1 and stats.counters[how] >= 1
    finally:
        task.cancel()
        await client.close()


async def test_requests_wait_for_pages_another_worker_holds(local_memd_factory, checkpoint):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=16)
    try:
        with pytest.raises(GenerationError, match="does not fit the KV pool"):
            scheduler.submit(Request(list(range(3, 80)), greedy(2)))
        hog = await memd.attach(model="tiny", block_size=BS)
        held, = await hog.step(Open([1] * 60))                   # 15 of the 16 pages
        await client.step()                                       # the scheduler learns how few are free
        request = Request([5, 6, 7, 8, 9], greedy(4))
        scheduler.submit(request)
        await asyncio.sleep(0.3)       # a stretch of time in which it must wait (not a synchronisation)
        assert request.events.empty() and not scheduler.running
        await hog.step(Free(held.seq_id))
        tokens, _, final = await collect(request)
        assert final.error is None and len(tokens) == 4
        await hog.close()
        await assert_clean(memd)
    finally:
        task.cancel()
        await client.close()


async def test_a_reset_during_the_admission_step_still_ends_the_turn(served, judge):
    memd, scheduler = served
    fired = []

    async def reset_once(ops):
        if any(isinstance(op, Open) for op in ops) and not fired:
            fired.append(asyncio.create_task(scheduler.reset("racy")))
    on_step(scheduler.client, reset_once)
    request = Request([11, 12, 13, 14, 15, 16], greedy(50), session_id="racy")
    scheduler.submit(request)
    _, _, final = await collect(request)
    await fired[0]
    assert final.finish_reason == "reset"
    stats = await assert_clean(memd)
    assert stats.used_blocks == 0
    after = Request([11, 12, 13, 14, 15, 16, 17, 18, 19], greedy(6))     # its pages were not written by a ghost
    scheduler.submit(after)
    judge.assert_greedy(after.prompt_ids, (await collect(after))[0], 6)


async def test_a_reset_whose_caller_left_does_not_break_the_scheduler(served):
    memd, scheduler = served
    first = Request([1, 2, 3], greedy(2), session_id="gone")
    scheduler.submit(first)
    await collect(first)
    caller = asyncio.create_task(scheduler.reset("gone"))
    await asyncio.sleep(0)                 # let it queue its Free, then leave (a client deadline)
    caller.cancel()
    request = Request([4, 5, 6], greedy(3))
    scheduler.submit(request)
    tokens, _, final = await collect(request)
    assert final.error is None and len(tokens) == 3
    await assert_clean(memd)


async def test_memd_failing_mid_step_fails_the_requests_in_it(served):
    from shared.client import MemdError
    _, scheduler = served
    import grpc

    async def fail_opens(ops):
        if any(isinstance(op, Open) for op in ops):
            raise MemdError(grpc.StatusCode.UNAVAILABLE, "memd is gone")
    on_step(scheduler.client, fail_opens)
    request = Request([7, 8, 9], greedy(3))
    scheduler.submit(request)
    _, _, final = await collect(request)
    assert final.error is not None and final.error.code.name == "UNAVAILABLE"


async def test_a_session_that_outgrew_the_model_is_refused_and_kept(served):
    memd, scheduler = served
    limit = scheduler.model.config.max_position
    from dataclasses import replace
    scheduler.model.config = replace(scheduler.model.config, max_position=40)
    try:
        first = Request(list(range(3, 33)), greedy(5), session_id="long")
        scheduler.submit(first)
        await collect(first)                                   # 35 tokens of history
        second = Request(list(range(40, 46)), greedy(2), session_id="long")
        scheduler.submit(second)
        _, _, final = await collect(second)
        assert final.error is not None and final.error.code.name == "INVALID_ARGUMENT"
        assert "reset the session" in final.error.message
        await assert_clean(memd, parked=1)                     # the history is still there to reset
    finally:
        scheduler.model.config = replace(scheduler.model.config, max_position=limit)


async def test_a_turn_whose_table_memd_disagrees_with_fails_instead_of_answering(served):
    memd, scheduler = served
    client, original, tampered = scheduler.client, scheduler.client.step, []

    async def step(*ops, **kwargs):
        results = await original(*ops, **kwargs)
        if not tampered and any(isinstance(op, Extend) for op in ops):     # as if memd had lost a commit
            index = next(i for i, op in enumerate(ops) if isinstance(op, Extend))
            results[index] = replace(results[index], num_committed=results[index].num_committed - 1)
            tampered.append(ops[index].seq_id)
        return results
    client.step = step
    request = Request(list(range(3, 10)), greedy(40))       # grows past its first pages
    scheduler.submit(request)
    tokens, _, final = await collect(request)
    assert tampered and final.error is not None and final.error.code.name == "INTERNAL"
    assert "committed length differs" in final.error.message and len(tokens) < 40
    client.step = original
    stats = await assert_clean(memd)
    assert stats.used_blocks == 0                            # failed, and freed


async def test_the_kv_audit_fails_a_turn_whose_pages_someone_else_wrote(local_memd_factory, checkpoint, judge):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, audit_kv=True)
    intruder = await memd.attach(model="tiny", block_size=BS)     # maps the same pool
    try:
        clean = Request(list(range(3, 20)), greedy(30))           # audited, untouched: answers as ever
        scheduler.submit(clean)
        tokens, _, final = await collect(clean)
        assert final.error is None
        judge.assert_greedy(clean.prompt_ids, tokens, 30)

        victim, struck = Request(list(range(30, 47)), greedy(30)), []

        async def strike(ops):
            if not struck and any(isinstance(op, Extend) and op.seq_id == victim.seq.id for op in ops):
                struck.append(victim.seq.table[1])                    # a full page the victim wrote and reads
                intruder.pool.pages[victim.seq.table[1]] = 7
        on_step(client, strike)
        scheduler.submit(victim)
        tokens, _, final = await collect(victim)
        assert struck and final.error is not None and final.error.code.name == "INTERNAL"
        assert f"(page {struck[0]}, slot 0) changed under it" in final.error.message and len(tokens) < 30
        stats = await assert_clean(memd)
        assert stats.used_blocks == 0
    finally:
        task.cancel()
        await intruder.close()
        await client.close()
