"""Chatting long on a small pool: preemption, swap and recompute change no output and leak nothing."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from scheduling import BS, assert_clean, collect, greedy, on_step, start_scheduler

from inferd.sampling import SamplingParams
from inferd.scheduler import Request
from shared.ops import Extend, Fork, Free, Open, Park, Resume

SESSIONS, TURNS, MAX_TOKENS = 16, 3, 24


def message(session: int, turn: int) -> list[int]:
    return [3 + (session * 37 + turn * 11 + i * 5) % 480 for i in range(6 + (session + turn) % 4)]


async def chat(scheduler) -> dict[tuple[int, int], list[int]]:
    """16 sessions, 3 turns each; every turn of every session is in flight at once."""
    outputs = {}
    for turn in range(TURNS):
        requests = {s: Request(message(s, turn), greedy(MAX_TOKENS), session_id=f"chat-{s}") for s in range(SESSIONS)}
        for request in requests.values():
            scheduler.submit(request)
        results = await asyncio.gather(*(collect(r) for r in requests.values()))
        for s, (tokens, _, final) in zip(requests, results, strict=True):
            assert final.error is None, final.error
            assert final.finish_reason == "length"
            outputs[s, turn] = tokens
    return outputs


async def test_sixteen_long_chats_on_a_pool_for_four_match_an_unconstrained_run(local_memd_factory, checkpoint, judge):
    # A whole chat is about 3 x (8 + 24) tokens: 24 blocks of 4. The small pool holds 4 such chats.
    _, big_client, big_scheduler, big_task = await start_scheduler(
        local_memd_factory, checkpoint, num_blocks=2048, name="big", max_num_seqs=SESSIONS)
    small, client, scheduler, task = await start_scheduler(
        local_memd_factory, checkpoint, num_blocks=96, name="small", max_num_seqs=SESSIONS)
    try:
        expected = await chat(big_scheduler)
        got = await chat(scheduler)
        judge.assert_same_chats({s: [(message(s, t), got[s, t], expected[s, t]) for t in range(TURNS)]
                                 for s in range(SESSIONS)})
        async with small.admin() as admin:
            counters = (await admin.stats()).counters
        assert counters["preemptions"] > 0
        assert counters["swap_outs"] > 0 and counters["swap_ins"] > 0
        async with small.admin() as admin:
            stats = await admin.stats()
            assert stats.sequences["running"] == 0
            assert stats.sequences["parked"] + stats.sequences["swapped"] + stats.sequences["dropped"] == SESSIONS
            assert (await admin.check()).ok
            for s in range(SESSIONS):
                await scheduler.reset(f"chat-{s}")
            stats = await admin.stats()
            assert stats.used_blocks == 0 and stats.swap_free_blocks == stats.swap_total_blocks     # nothing leaked
            assert sum(stats.sequences.values()) == 0 and (await admin.check()).ok
    finally:
        for t in (task, big_task):
            t.cancel()
        await client.close()
        await big_client.close()


@pytest.mark.parametrize("mode, how", [("swap", "swap_ins"), ("drop", "drops")])
async def test_an_operator_evicting_a_running_sequence_delays_it_and_changes_nothing(local_memd_factory, checkpoint,
                                                                                     judge, mode, how):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=64)
    revoked = asyncio.Event()
    deliver = client.on_revoke

    def on_revoke(seq_id: int, reason: str) -> None:
        deliver(seq_id, reason)
        revoked.set()
    client.on_revoke = on_revoke
    original, fired = client.step, []

    async def step(*ops, **kwargs):
        # At the first growth the sequence surely runs: evict it, and go on once the worker heard of it.
        if not fired and any(isinstance(op, Extend) for op in ops):
            async with memd.admin() as admin:
                fired.append(await admin.evict(seq_id=ops[0].seq_id, mode=mode))
            await revoked.wait()
        return await original(*ops, **kwargs)
    client.step = step
    try:
        request = Request([21, 22, 23, 24, 25], greedy(40))
        scheduler.submit(request)
        tokens, _, final = await collect(request)
        assert final.error is None
        judge.assert_greedy(request.prompt_ids, tokens, 40)
        assert fired[0].revoked == [request.seq.id] and request.preemptions == 1
        stats = await assert_clean(memd)
        assert stats.used_blocks == 0
        assert stats.counters["preemptions"] == 1 and stats.counters["evictions_forced"] == 1
        assert stats.counters[how] >= 1
    finally:
        task.cancel()
        await client.close()


async def revoke(memd, client, seq_id: int, mode: str = "swap") -> None:
    """An operator evicts a running sequence; returns once the worker has heard of it."""
    heard, deliver = asyncio.Event(), client.on_revoke

    def on_revoke(seq: int, reason: str) -> None:
        deliver(seq, reason)
        heard.set()
    client.on_revoke = on_revoke
    async with memd.admin() as admin:
        await admin.evict(seq_id=seq_id, mode=mode)
    await heard.wait()
    client.on_revoke = deliver


async def test_a_request_that_preempted_itself_resumes_when_another_worker_frees_pages(local_memd_factory, checkpoint,
                                                                                     judge):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=16)
    hog = await memd.attach(model="tiny", block_size=BS)
    try:
        held, = await hog.step(Open([1] * 36))              # 9 of 16 pages, running on another worker
        await client.step()
        preempted = asyncio.Event()

        async def hook(ops):
            if any(isinstance(op, Park) and op.preempt for op in ops):
                preempted.set()
        on_step(client, hook)
        request = Request([5, 6, 7, 8, 9], greedy(40))      # runs out of pages at its 8th block
        scheduler.submit(request)
        await asyncio.wait_for(preempted.wait(), 60)
        await hog.step(Free(held.seq_id))                    # the pages come back: it must go on by itself
        tokens, _, final = await collect(request)
        assert final.error is None
        judge.assert_greedy(request.prompt_ids, tokens, 40)
        assert request.preemptions >= 1
        await assert_clean(memd)
    finally:
        task.cancel()
        await hog.close()
        await client.close()


async def test_a_reset_while_preemptions_are_swapped_out_ends_the_turns_and_forgets_the_session(
        local_memd_factory, checkpoint):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=256,
                                                          memd_args=("--swap-ratio", "0.5"))
    try:
        first = Request([10, 11, 12, 13, 14], greedy(3), session_id="s")
        scheduler.submit(first)
        await collect(first)
        turn = Request([21, 22, 23, 24, 25], greedy(60), session_id="s")
        stage, resets = [], []

        async def hook(ops):
            if not stage and any(isinstance(op, Extend) and op.seq_id == turn.seq.id for op in ops):
                stage.append("revoked")
                await revoke(memd, client, turn.seq.id)
            elif stage == ["revoked"] and any(isinstance(op, Park) and op.preempt for op in ops):
                stage.append("reset")                        # lands while memd swaps the turn out
                resets.append(asyncio.create_task(scheduler.reset("s")))
                await asyncio.sleep(0)                       # let reset() mark the turn before the Step goes
        on_step(client, hook)
        scheduler.submit(turn)
        _, _, final = await collect(turn)
        await resets[0]
        assert final.finish_reason == "reset" and final.error is None
        async with memd.admin() as admin:
            stats = await admin.stats()
            assert sum(stats.sequences.values()) == 0 and stats.used_blocks == 0
            assert stats.swap_free_blocks == stats.swap_total_blocks and (await admin.check()).ok
    finally:
        task.cancel()
        await client.close()


async def test_forks_wait_for_a_page_instead_of_failing(local_memd_factory, checkpoint):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=16)
    hog = await memd.attach(model="tiny", block_size=BS)
    try:
        held, = await hog.step(Open([1] * 48))              # 12 of 16 pages, running on another worker
        await client.step()
        forks = []

        async def hook(ops):
            if any(isinstance(op, Fork) for op in ops):
                forks.append(ops)
                if len(forks) == 2:                          # refused once: now the pages come back
                    await hog.step(Free(held.seq_id))
        on_step(client, hook)
        request = Request([5, 6, 7, 8, 9], replace(greedy(8), n=3))
        scheduler.submit(request)
        finals = {}
        while len(finals) < 3:
            event = await asyncio.wait_for(request.events.get(), 60)
            if event.finish_reason or event.error:
                finals[event.index] = event
        assert all(e.error is None and e.finish_reason == "length" for e in finals.values())
        assert len(forks) >= 2
        await assert_clean(memd)
    finally:
        task.cancel()
        await hog.close()
        await client.close()


async def test_a_preempted_request_comes_back_without_its_lookahead(local_memd_factory, checkpoint):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=16)
    try:
        request = Request([5, 6, 7, 8, 9], greedy(100))     # grows to the end of the 64-token pool
        scheduler.submit(request)
        for _ in range(48):
            await request.events.get()
        await revoke(memd, client, request.seq.id)           # 53 tokens + a 16-token lookahead would not fit
        other = Request([40, 41, 42], greedy(3))
        scheduler.submit(other)
        tokens, _, final = await collect(other)
        assert final.error is None and len(tokens) == 3      # not stuck behind it
        _, _, final = await collect(request)
        assert request.preemptions == 1
        assert final.error is not None and final.error.code.name == "INVALID_ARGUMENT"     # the pool's end, as before
        await assert_clean(memd)
    finally:
        task.cancel()
        await client.close()


async def mixed_load(scheduler) -> list[dict[int, list[int]]]:
    """Greedy requests and seeded n=2 samplings of different lengths, all at once."""
    requests = []
    for i in range(10):
        prompt = [3 + (i * 31 + k * 7) % 400 for k in range(5 + i % 7)]
        if i % 3 == 0:
            params = SamplingParams(max_tokens=20 + i, temperature=0.8, seed=100 + i, ignore_eos=True, n=2)
        else:
            params = greedy(20 + 2 * i)
        requests.append(Request(prompt, params))
        scheduler.submit(requests[-1])
    outputs = []
    for request in requests:
        got, finished = {k: [] for k in range(request.params.n)}, 0
        while finished < request.params.n:
            event = await asyncio.wait_for(request.events.get(), 60)
            assert event.error is None, event.error
            got[event.index] += event.token_ids
            finished += event.finish_reason is not None
        outputs.append(got)
    return outputs


@pytest.mark.parametrize("memd_args", [("--swap-ratio", "0.5"), ("--disable-swap",)], ids=["swap", "no-swap"])
async def test_sampling_and_forks_on_a_small_pool_match_a_big_one(local_memd_factory, checkpoint, memd_args):
    _, big_client, big, big_task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=1024, name="big")
    memd, client, small, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=40, name="small",
                                                      memd_args=memd_args)
    try:
        assert await mixed_load(small) == await mixed_load(big)
        await assert_clean(memd)
    finally:
        for t in (task, big_task):
            t.cancel()
        await client.close()
        await big_client.close()


async def test_a_preempted_turn_whose_resume_memd_refuses_waits_and_resumes_later(local_memd_factory, checkpoint,
                                                                                  judge):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=64,
                                                          memd_args=("--swap-ratio", "0.5"))
    hog = await memd.attach(model="tiny", block_size=BS)
    try:
        first = Request([10, 11, 12, 13, 14], greedy(3), session_id="chat")
        scheduler.submit(first)
        out1, _, _ = await collect(first)
        turn = Request([21, 22, 23, 24, 25], greedy(40), session_id="chat")
        stage, held = [], []

        async def hook(ops):
            if not stage and any(isinstance(op, Extend) and op.seq_id == turn.seq.id for op in ops):
                stage.append("revoked")                      # preempted: swapped out, waiting to resume
                await revoke(memd, client, turn.seq.id)
            elif stage == ["revoked"] and any(isinstance(op, Resume) for op in ops):
                stage.append("refused")                      # another worker takes every free page first
                async with memd.admin() as admin:
                    free = (await admin.stats()).free_blocks
                held.append((await hog.step(Open([1] * (free * BS))))[0])
            elif stage == ["revoked", "refused"]:
                stage.append("freed")                        # the next Step after the refusal: pages come back
                await hog.step(Free(held[0].seq_id))
        on_step(client, hook)
        scheduler.submit(turn)
        out2, _, final = await collect(turn)
        assert stage == ["revoked", "refused", "freed"]
        assert final.error is None and final.finish_reason == "length" and turn.preemptions == 1
        judge.assert_same_chats({"chat": [([10, 11, 12, 13, 14], out1, judge.greedy([10, 11, 12, 13, 14], 3)),
                                          ([21, 22, 23, 24, 25], out2,
                                           judge.greedy([10, 11, 12, 13, 14] + out1 + [21, 22, 23, 24, 25], 40))]})
        await assert_clean(memd, parked=1)
    finally:
        task.cancel()
        await hog.close()
        await client.close()


async def test_a_swapped_page_that_rotted_is_recomputed_not_reused(local_memd_factory, checkpoint, judge):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=64,
                                                          memd_args=("--swap-ratio", "0.5"))
    prompt = [5 + i for i in range(30)]
    first = Request(prompt, greedy(6), session_id="chat")
    scheduler.submit(first)
    answer1, _, _ = await collect(first)
    async with memd.admin() as admin:
        await admin.evict(session_id="chat", mode="swap")
    seq = memd.manager.seqs[memd.manager.sessions["chat"]]
    assert seq.state.value == "swapped"
    # Its full blocks are still cached in the pool and come back from there; the partly written last one
    # can only come from its slot, which rots in place.
    page, last, kept = memd.manager.geometry.block_bytes, seq.slots[-1], len(seq.slots) - 1
    swap = memd.swap.view()
    swap[last * page:last * page + 64] = b"\xff" * 64
    swap.release()
    second = Request([7, 8, 9], greedy(6), session_id="chat")
    scheduler.submit(second)
    answer2, _, final = await collect(second)
    judge.assert_greedy(prompt + answer1 + [7, 8, 9], answer2, 6, "after the rotten page")
    assert final.usage["cached_tokens"] == kept * BS                          # the blocks before it, no more
    async with memd.admin() as admin:
        counters = (await admin.stats()).counters
    assert counters["integrity_failures"] == 1 and counters["pages_verified"] == 1
    await assert_clean(memd, parked=1)
    task.cancel()
    await client.close()
