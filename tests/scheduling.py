"""Helpers for tests that run the scheduler on a real memd: start it, collect a request, check for leaks.

`memd_factory` is either conftest's (a memd process) or `local_memd_factory` (memd's parts in this process).
"""

from __future__ import annotations

import asyncio
from typing import Any

from inferd.checkpoint import load_tokenizer, load_weights, read_config
from inferd.model import PagedDecoder
from inferd.sampling import SamplingParams
from inferd.scheduler import Request, Scheduler
from shared.client import MemdClient

BS = 4


async def start_scheduler(memd_factory, checkpoint, num_blocks: int = 256, memd_args: tuple[str, ...] = (),
                          name: str = "memd", **kwargs):
    config = read_config(checkpoint)
    page = BS * config.bytes_per_token
    memd = await memd_factory("--device", "cpu", "--pool-bytes", str(num_blocks * page), "--block-bytes", str(page),
                              *memd_args, name=name)
    client = await memd.attach(model="tiny", block_size=BS, bytes_per_token=config.bytes_per_token)
    model = PagedDecoder(config, load_weights(checkpoint, config.dtype), client.pool.view(config.dtype,
                                                                                          config.page_shape(BS)))
    scheduler = Scheduler(client, model, load_tokenizer(checkpoint), **kwargs)
    task = asyncio.create_task(scheduler.run())
    return memd, client, scheduler, task


async def collect(request: Request):
    tokens, text = [], ""
    while True:
        event = await asyncio.wait_for(request.events.get(), 120)
        tokens += event.token_ids
        text += event.text
        if event.finish_reason or event.error:
            return tokens, text, event


async def assert_clean(memd, *, parked: int = 0):
    async with memd.admin() as admin:
        stats = await admin.stats()
        assert stats.sequences["running"] == 0 and stats.sequences["parked"] == parked
        assert (await admin.check()).ok
        return stats


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def on_step(client: MemdClient, hook: Any) -> None:
    """Run `await hook(ops)` before each Step the scheduler sends (to land events mid-flight)."""
    original = client.step

    async def step(*ops: Any, **kwargs: Any) -> Any:
        await hook(ops)
        return await original(*ops, **kwargs)
    client.step = step  # type: ignore[method-assign]
