"""How much prompt a forward pass takes, and what a new prompt must find free to be admitted."""

from __future__ import annotations

import asyncio

import pytest
from scheduling import assert_clean, collect, greedy, on_step, start_scheduler

import inferd.scheduler
from inferd.prefix_wait import held_blocks
from inferd.scheduler import Request

pytest.importorskip("transformers")

SHARED = [(7 * i + 3) % 400 + 3 for i in range(41)]        # ten full blocks of 4 and one token


def test_held_blocks_counts_what_a_running_request_has_committed_of_the_prompt():
    running = Request(list(range(40)), greedy(4))
    running.seq.tokens, running.seq.committed = list(range(40)), 40
    assert held_blocks(list(range(40)) + [7], [running], 4) == 10
    assert held_blocks(list(range(22)) + [7], [running], 4) == 5      # its last token is never matched
    running.seq.committed = 13                                         # three whole blocks committed so far
    assert held_blocks(list(range(40)) + [7], [running], 4) == 3
    running.num_prompt, running.seq.computed = 40, 26     # this iteration's Step commits its computed prompt
    assert held_blocks(list(range(40)) + [7], [running], 4) == 6
    running.seq.computed = 0
    assert held_blocks([9] + list(range(1, 40)), [running], 4) == 0
    assert held_blocks(list(range(40)), [], 4) == 0


async def test_a_pass_beside_decode_rows_takes_its_share_of_prompt_and_one_of_prompts_alone_the_budget(
        local_memd_factory, checkpoint, judge, monkeypatch):
    passes: list[list[int]] = []
    build = inferd.scheduler.build_batch

    def recorded(rows, *args, **kwargs):
        passes.append([len(take) for take, _, _ in rows])
        return build(rows, *args, **kwargs)

    monkeypatch.setattr(inferd.scheduler, "build_batch", recorded)
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, max_batch_tokens=64,
                                                          prefill_beside_decode=8)
    try:
        # 50 + 50 prompt tokens at once: the first pass, with no row decoding yet, takes 64 of them
        prompts = [[(11 * i + 5 * k) % 400 + 3 for i in range(50)] for k in (1, 2)]
        requests = [Request(p, greedy(12)) for p in prompts]
        for request in requests:
            scheduler.submit(request)
        results = await asyncio.gather(*[collect(r) for r in requests])
        for prompt, (tokens, _, final) in zip(prompts, results, strict=True):
            assert final.finish_reason == "length"
            judge.assert_greedy(prompt, tokens, 12)
        assert passes[0] == [50, 14]
        beside = [p for p in passes if 1 in p and any(n > 1 for n in p)]
        assert beside, passes                                  # the second prompt went on beside the first's decode
        assert all(sum(n for n in p if n > 1) <= 8 for p in beside), passes
        await assert_clean(memd)
    finally:
        task.cancel()
        await client.close()


async def test_a_prompt_is_admitted_beside_the_running_request_that_holds_its_prefix(local_memd_factory,
                                                                                      checkpoint, judge):
    # 28 pages of 4 tokens: the first request holds 15 (41 tokens and 16 of lookahead); the second's 44 tokens
    # and lookahead would be 15 more, but 10 of them are the first's committed prefix, which memd shares
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint, num_blocks=28,
                                                          max_batch_tokens=64)
    most = [0]

    async def count_running(ops):
        most[0] = max(most[0], len(scheduler.running))

    on_step(client, count_running)
    try:
        first, second = Request(SHARED, greedy(24)), Request(SHARED + [5, 6, 7], greedy(16))
        scheduler.submit(first)
        scheduler.submit(second)
        (_, _, one), (tokens, _, two) = await asyncio.gather(collect(first), collect(second))
        assert one.finish_reason == two.finish_reason == "length"
        assert two.usage["cached_tokens"] == 40
        assert most[0] == 2                                  # they ran together
        judge.assert_greedy(SHARED + [5, 6, 7], tokens, 16)
        await assert_clean(memd)
    finally:
        task.cancel()
        await client.close()
