"""Chatting long on a small pool: preemption, swap and recompute change no output and leak nothing."""

from __future__ import annotations

import asyncio

import pytest
from scheduling import assert_clean, collect, greedy, greedy_reference, start_scheduler

from inferd.scheduler import Request
from shared.ops import Extend

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


async def test_sixteen_long_chats_on_a_pool_for_four_match_an_unconstrained_run(memd_factory, checkpoint):
    # A whole chat is about 3 x (8 + 24) tokens: 24 blocks of 4. The small pool holds 4 such chats.
    _, big_client, big_scheduler, big_task = await start_scheduler(
        memd_factory, checkpoint, num_blocks=2048, name="big", max_num_seqs=SESSIONS)
    small, client, scheduler, task = await start_scheduler(
        memd_factory, checkpoint, num_blocks=96, name="small", max_num_seqs=SESSIONS)
    try:
        expected = await chat(big_scheduler)
        got = await chat(scheduler)
        assert got == expected
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
async def test_an_operator_evicting_a_running_sequence_delays_it_and_changes_nothing(memd_factory, checkpoint,
                                                                                     reference, mode, how):
    memd, client, scheduler, task = await start_scheduler(memd_factory, checkpoint, num_blocks=64)
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
        assert final.error is None and tokens == greedy_reference(reference, request.prompt_ids, 40)
        assert fired[0].revoked == [request.seq_id] and request.preemptions == 1
        stats = await assert_clean(memd)
        assert stats.used_blocks == 0
        assert stats.counters["preemptions"] == 1 and stats.counters["evictions_forced"] == 1
        assert stats.counters[how] >= 1
    finally:
        task.cancel()
        await client.close()
