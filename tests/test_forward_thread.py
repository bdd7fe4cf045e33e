"""inferd's forward thread: how many CPU threads a pass gets, what it samples, and that close waits for it."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from inferd.checkpoint import load_weights, read_config
from inferd.forward_thread import PARALLEL_MIN_FLOPS, ForwardThread, Sampling
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
