"""inferd's forward thread: how many CPU threads a pass gets, what it samples, and that close waits for it."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from inferd.checkpoint import load_weights, read_config
from inferd.forward_thread import PARALLEL_MIN_FLOPS, Ahead, ForwardThread, Sampling
from inferd.model import PagedDecoder, build_batch
from inferd.sampling import SamplingParams
from inferd.tiny import make_tiny_model

BS = 4


@pytest.fixture
def model(tmp_path) -> PagedDecoder:
    checkpoint = make_tiny_model(tmp_path / "model", seed=1)
    config = read_config(checkpoint)
    return PagedDecoder(config, load_weights(checkpoint, config.dtype), torch.zeros(64, *config.page_shape(BS)))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


async def test_a_small_pass_runs_on_one_thread_a_big_one_on_all(model, two_threads):
    worker = ForwardThread(model)
    assert worker.threads == 2
    big = int(PARALLEL_MIN_FLOPS // worker.flops_per_token) + 1
    try:
        assert await worker.run(torch.get_num_threads, tokens=1) == 1
        assert await worker.run(torch.get_num_threads, tokens=big) == 2
        assert await worker.run(torch.get_num_threads, tokens=big - 1) == 1
        assert await worker.run(threading.current_thread, tokens=1) is await worker.run(threading.current_thread,
                                                                                           tokens=big)
    finally:
        await worker.close()


async def test_the_step_samples_only_the_rows_whose_history_is_in(model):
    worker = ForwardThread(model)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    tables = [[0, 1], [2]]
    batch = build_batch([(p, 0, t) for p, t in zip(prompts, tables, strict=True)], BS)
    expected = model.forward(build_batch([(p, 0, t) for p, t in zip(prompts, tables, strict=True)], BS))
    greedy = SamplingParams(logprobs=2)
    try:
        sampled = await worker.step(batch, Sampling([1], [greedy], [0], [None], model.config.eos_token_ids))
        assert sampled is not None
        assert sampled.tokens == [int(expected[1].argmax())]
        torch.testing.assert_close(sampled.raw, expected[[1]])
        assert sampled.logprobs[0] is not None and sampled.logprobs[0].token_id == sampled.tokens[0]
        assert await worker.step(batch, Sampling([], [], [], [], model.config.eos_token_ids)) is None
    finally:
        await worker.close()


async def test_close_waits_for_a_pass_whose_caller_was_cancelled(model):
    worker = ForwardThread(model)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        release.wait()
        finished.set()

    caller = asyncio.create_task(worker.run(slow, tokens=1))
    await asyncio.to_thread(started.wait)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    closing = asyncio.create_task(worker.close())
    await asyncio.sleep(0)
    assert not closing.done() and not finished.is_set()
    release.set()
    await closing
    assert finished.is_set()


def _decode_rows(model: PagedDecoder, prompts: list[list[int]], tables: list[list[int]]):
    """Prefill `prompts` (each in its own pages), then return (greedy next tokens, positions)."""
    logits = model.forward(build_batch([(p, 0, t) for p, t in zip(prompts, tables, strict=True)], BS))
    return logits.argmax(-1).tolist(), [len(p) for p in prompts]


class HeldAfterFirst:
    """The model, but every pass after the first waits until the test lets it run."""

    def __init__(self, model: PagedDecoder) -> None:
        self.model, self.calls, self.go = model, 0, threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def forward(self, batch):
        self.calls += 1
        if self.calls > 1:
            self.go.wait()
        return self.model.forward(batch)


async def test_a_pass_run_ahead_is_the_pass_the_scheduler_would_run(model):
    held = HeldAfterFirst(model)
    worker = ForwardThread(held)
    owners = [object(), object()]
    prompts, tables = [[5, 6, 7, 8, 9], [11, 12, 13]], [[0, 1, 2], [3, 4]]
    greedy = SamplingParams(max_tokens=8)
    first, positions = _decode_rows(model, prompts, tables)
    batch = build_batch([([t], p, table) for t, p, table in zip(first, positions, tables, strict=True)], BS)
    ahead = Ahead(owners, [p + 1 for p in positions], tables, BS, model.config.max_position)
    try:
        sampled = await worker.step(batch, Sampling([0, 1], [greedy] * 2, [1, 1], [None] * 2,
                                                    model.config.eos_token_ids), ahead)
        assert sampled is not None
        # Another batch, or other tokens, is not the pass run ahead.
        assert not worker.take_ahead(owners[::-1], ahead.positions[::-1], sampled.tokens[::-1])
        assert not worker.take_ahead(owners, ahead.positions, [t + 1 for t in sampled.tokens])
        assert worker.take_ahead(owners, ahead.positions, sampled.tokens)
        held.go.set()                                   # taken before it finished: it goes on to the next
        ran_ahead = await worker.taken()
        # The same pass, run by the scheduler itself, on pages the pass run ahead wrote already.
        again = model.forward(build_batch([([t], p, table) for t, p, table in
                                           zip(sampled.tokens, ahead.positions, tables, strict=True)], BS))
        assert ran_ahead is not None and ran_ahead.tokens == again.argmax(-1).tolist()
        torch.testing.assert_close(ran_ahead.raw, again)
        nxt = [p + 1 for p in ahead.positions]
        assert worker.take_ahead(owners, nxt, ran_ahead.tokens)
        assert (await worker.taken()) is not None
        assert worker.ahead_taken == 2
    finally:
        await worker.close()


async def test_a_pass_run_ahead_that_finished_before_it_was_taken_queues_the_next_when_taken(model):
    """Streaming a step's tokens can take longer than a pass (a small model, many streams): the thread
    must not idle while they are streamed, or the next token comes a whole pass later than the one after it."""
    worker = ForwardThread(model)
    owners = [object()]
    table, position, batch = _one_decode(model)
    ahead = Ahead(owners, [position], [table], BS, model.config.max_position)
    greedy = SamplingParams(max_tokens=8)
    try:
        sampled = await worker.step(batch, Sampling([0], [greedy], [1], [None], model.config.eos_token_ids), ahead)
        assert sampled is not None
        worker._ahead.future.result(timeout=60)          # the pass run ahead is done before anyone takes it
        assert worker.take_ahead(owners, [position], sampled.tokens)
        second = await worker.taken()
        assert second is not None
        assert worker.take_ahead(owners, [position + 1], second.tokens)      # the third was queued on taking
        assert (await worker.taken()) is not None
        assert worker.ahead_taken == 2
    finally:
        await worker.close()


def _one_decode(model: PagedDecoder):
    """One sequence's prompt in its pages, and the batch of its first decode step."""
    table = [0, 1, 2]
    first, positions = _decode_rows(model, [[5, 6, 7]], [table])
    return table, positions[0] + 1, build_batch([([first[0]], positions[0], table)], BS)


async def test_nothing_runs_ahead_past_a_row_that_ends(model):
    worker = ForwardThread(model)
    owner = [object()]
    table, next_position, batch = _one_decode(model)
    eos = model.config.eos_token_ids
    try:
        for params, pages in ((SamplingParams(max_tokens=2), table),                  # its last token
                              (SamplingParams(max_tokens=8), table[:next_position // BS])):   # no page for it
            ahead = Ahead(owner, [next_position], [pages], BS, model.config.max_position)
            sampled = await worker.step(batch, Sampling([0], [params], [1], [None], eos), ahead)
            assert sampled is not None
            assert not worker.take_ahead(owner, ahead.positions, sampled.tokens)
        await worker.drop_ahead()
        assert worker.ahead_taken == 0 and worker.ahead_dropped == 0            # nothing was run ahead
    finally:
        await worker.close()


async def test_a_dropped_pass_is_waited_for_and_never_taken(model):
    worker = ForwardThread(model)
    owner = [object()]
    table, next_position, batch = _one_decode(model)
    ahead = Ahead(owner, [next_position], [table], BS, model.config.max_position)
    try:
        sampled = await worker.step(batch, Sampling([0], [SamplingParams(max_tokens=8)], [1], [None],
                                                    model.config.eos_token_ids), ahead)
        assert sampled is not None
        await worker.drop_ahead()
        assert worker.ahead_dropped == 1
        assert not worker.take_ahead(owner, ahead.positions, sampled.tokens)
    finally:
        await worker.close()
