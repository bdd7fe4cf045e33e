"""Prompts that share leading blocks with one being computed wait for it instead of computing them again."""

from __future__ import annotations

import asyncio

import pytest
from scheduling import assert_clean, collect, greedy, on_step, start_scheduler

from inferd.prefix_wait import shared_blocks, waits_for
from inferd.scheduler import Request
from shared.ops import Open

pytest.importorskip("transformers")

SHARED = [(7 * i + 3) % 400 + 3 for i in range(41)]        # ten full blocks and one token


def test_shared_blocks_counts_whole_blocks_only_and_stops_at_the_limit():
    a = list(range(40))
    assert shared_blocks(a, a, 4, 100) == 10
    assert shared_blocks(a, a[:21], 4, 100) == 5            # the 21st token is in no full block
    b = a[:13] + [999] + a[14:]
    assert shared_blocks(a, b, 4, 100) == 3                 # blocks 0-2 agree, block 3 holds the difference
    assert shared_blocks(a, a, 4, 6) == 6
    assert shared_blocks(a, [1] + a[1:], 4, 100) == 0


def test_a_prompt_waits_only_for_blocks_a_leader_has_not_committed():
    leader = list(range(40))
    assert waits_for(leader[:30] + [7, 8], [(leader, 0)], 4)
    assert not waits_for(leader[:30] + [7, 8], [(leader, 28)], 4)     # the seven shared blocks are committed
    assert waits_for(leader[:30] + [7, 8], [(leader, 24)], 4)         # the seventh is not yet
    assert not waits_for([9] + leader[1:30], [(leader, 0)], 4)        # nothing shared
    assert not waits_for(leader[:4], [(leader, 0)], 4)                # its one block holds its last token


async def test_prompts_sharing_a_prefix_in_flight_compute_it_once_and_answer_as_alone(local_memd_factory,
                                                                                       checkpoint, judge):
    # 16 tokens a pass: the leader's shared prompt takes three passes, during which the others arrive
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, max_batch_tokens=16)
    opened: list[int] = []          # per Step that opens any: how many

    async def count_opens(ops):
        if opens := sum(isinstance(op, Open) for op in ops):
            opened.append(opens)

    on_step(client, count_opens)
    try:
        prompts = [SHARED + [100 + i, 200 + i, 300 + i] for i in range(5)]
        requests = [Request(p, greedy(6)) for p in prompts]
        for request in requests:
            scheduler.submit(request)
        results = await asyncio.gather(*[collect(r) for r in requests])
        cached = sorted(final.usage["cached_tokens"] for _, _, final in results)
        assert cached[0] == 0 and all(c == 40 for c in cached[1:])      # one computed it, four took its blocks
        # The four are opened together once the leader's shared blocks are committed, not one a Step (each
        # waiting on the one before it, as if it had to compute what the prefix cache hands it).
        assert opened == [1, 4]
        for prompt, (tokens, _, final) in zip(prompts, results, strict=True):
            assert final.finish_reason == "length"
            judge.assert_greedy(prompt, tokens, 6)
        stats = await assert_clean(memd)
        assert stats.used_blocks == 0
    finally:
        task.cancel()
        await client.close()


async def test_a_follower_is_not_held_by_a_leader_that_is_cancelled(local_memd_factory, checkpoint, judge):
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, max_batch_tokens=8)
    leader, follower = Request(SHARED + [1, 2], greedy(4)), Request(SHARED + [5, 6], greedy(4))
    started = asyncio.Event()

    async def cancel_once_computing(ops):
        if leader.seq.computed and not started.is_set():     # the leader's first chunk is in: the follower waits
            started.set()
            scheduler.cancel(leader)

    on_step(client, cancel_once_computing)
    try:
        scheduler.submit(leader)
        scheduler.submit(follower)
        (_, _, lead), (tokens, _, final) = await asyncio.gather(collect(leader), collect(follower))
        assert started.is_set() and lead.finish_reason == "cancelled"
        assert final.finish_reason == "length"
        judge.assert_greedy(SHARED + [5, 6], tokens, 4)
        await assert_clean(memd)
    finally:
        task.cancel()
        await client.close()
