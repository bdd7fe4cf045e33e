"""The vLLM connector's own parts against a real memd, in kvpool's venv (vLLM itself runs in tests/test_vllm_memd.py).

Two engines' scheduler and worker sides, each with its own attachments, over KV caches laid out as vLLM's CPU
attention lays them ([blocks, heads, block size, 2 x head size] per layer): what one saves the other finds by
a side-effect-free lookup, loads byte for byte, after checking every page; a page changed in memd's pool is
never loaded; tenants never see each other's blocks; a tenant at its max saves nothing and serves; memd gone
costs hits, never an exception.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvpool_vllm.block_copy import BlockCopier, LayoutError
from kvpool_vllm.memd_link import AttachSpec, MemdLink
from kvpool_vllm.scheduler_side import SchedulerSide
from kvpool_vllm.settings import Settings, SettingsError, request_tenant
from kvpool_vllm.worker_side import WorkerSide

BS, HEADS, HEAD = 16, 2, 8
LAYERS, NUM_BLOCKS = 2, 12
PAGE_BYTES = LAYERS * HEADS * BS * 2 * HEAD * 4          # float32: one block of every layer is one 4 KiB page
MODEL = "vllm:test-engine"


@dataclass(eq=False)
class Request:
    """What the scheduler side reads of vLLM's Request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: set[str] = field(default_factory=set)


class BlockTables:
    """What the scheduler side reads of vLLM's KV cache manager: each request's block ids."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.tables[req_id],)


class Engine:
    """One vLLM engine's two connector sides, its block tables and its KV cache."""

    def __init__(self, address: str, name: str, settings: Settings | None = None) -> None:
        spec = AttachSpec(address, MODEL, BS, PAGE_BYTES // BS, f"{name}-scheduler")
        self.tables = BlockTables()
        self.scheduler = SchedulerSide(MemdLink(spec), BS, settings or Settings(address), self.tables)
        self.worker = WorkerSide(MemdLink(AttachSpec(address, MODEL, BS, PAGE_BYTES // BS, f"{name}-worker",
                                                     map_memory=True)))
        generator = torch.Generator().manual_seed(hash(name) % 1000)
        self.caches = {f"layer.{i}": torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD, generator=generator)
                       for i in range(LAYERS)}
        assert self.scheduler.link.wait_up(30) and self.worker.link.wait_up(30)
        self.worker.register(self.caches, NUM_BLOCKS)

    def step(self, scheduled: dict[Request, int], blocks: dict[str, list[int]] | None = None) -> Any:
        """One engine step: the scheduler side's Step, the worker's loads and saves, its report back."""
        self.tables.tables.update(blocks or {})
        plan = self.scheduler.build(SchedulerOutput({r.request_id: n for r, n in scheduled.items()}))
        self.worker.load(plan)
        errors = self.worker.take_errors()
        self.worker.save(plan)
        self.scheduler.reported(self.worker.take_report())
        for request, count in scheduled.items():
            request.num_computed_tokens += count
        return plan, errors

    def admit(self, request: Request, blocks: list[int]) -> int:
        """vLLM's admission of a waiting request: asks memd, allocates, returns the tokens memd supplies."""
        external = self.scheduler.matched(request, 0)
        self.tables.tables[request.request_id] = blocks
        self.scheduler.allocated(request, external)
        request.num_computed_tokens = external
        return external

    def block(self, index: int) -> list[torch.Tensor]:
        return [cache[index].clone() for cache in self.caches.values()]

    def close(self) -> None:
        self.scheduler.close()
        self.worker.link.close()


@pytest.fixture
async def engines(memd_factory):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                              "--lease-timeout", "30")
    made: list[Engine] = []

    def make(name: str, settings: Settings | None = None) -> Engine:
        made.append(Engine(memd.address, name, settings))
        return made[-1]
    yield memd, make
    for engine in made:
        await asyncio.to_thread(engine.close)


async def _used_pages(memd) -> int:
    async with memd.admin() as admin:
        stats = await admin.stats()
    return stats.used_blocks


def _serve(engine: Engine, request: Request, blocks: list[int], decode: int = 0) -> None:
    """A request through `engine`: admitted, its prompt computed in one step, `decode` tokens, finished."""
    engine.admit(request, blocks)
    engine.step({request: len(request.all_token_ids) - request.num_computed_tokens})
    for token in range(decode):
        request.all_token_ids.append(1000 + token)
        engine.step({request: 1})
    engine.scheduler.finished(request.request_id)
    engine.step({})                                        # the next engine step carries its free


async def test_what_one_engine_saves_another_loads_byte_for_byte(engines):
    memd, make = engines
    a, b = await asyncio.to_thread(make, "a"), await asyncio.to_thread(make, "b")
    prompt = list(range(500, 540))                                  # 2 full blocks and 8 tokens
    await asyncio.to_thread(_serve, a, Request("r1", list(prompt)), [3, 5, 7, 9], decode=30)
    saved = {i: a.block(vllm) for i, vllm in enumerate([3, 5, 7, 9])}   # 70 tokens: 4 full blocks
    stored = a.scheduler.take_stored()                    # what vLLM's KV events will announce memd holds
    assert [(r.request_id, start, end) for r, start, end in stored] == [("r1", 0, 2), ("r1", 2, 3), ("r1", 3, 4)]
    assert a.scheduler.take_stored() == [] and a.scheduler._ending == {}

    asked = Request("r2", prompt + [1000 + t for t in range(30)] + [77, 78])
    assert await asyncio.to_thread(b.scheduler.matched, asked, 0) == 4 * BS
    assert await asyncio.to_thread(b.scheduler.matched, asked, 0) == 4 * BS     # asked again: the same
    assert await asyncio.to_thread(b.scheduler.matched, asked, BS) == 3 * BS    # vLLM had one block itself
    assert await asyncio.to_thread(b.admit, asked, [0, 1, 2, 4, 6]) == 4 * BS
    plan, errors = await asyncio.to_thread(b.step, {asked: 2})
    assert errors == set() and [len(load.pages) for load in plan.loads] == [4]
    for i, vllm in enumerate([0, 1, 2, 4]):
        assert all(torch.equal(x, y) for x, y in zip(b.block(vllm), saved[i], strict=True))
    assert b.worker.counters["loaded_blocks"] == 4
    b.scheduler.finished("r2")
    await asyncio.to_thread(b.step, {})
    assert await _used_pages(memd) == 0                  # both requests' sequences freed, their blocks cached
    async with memd.admin() as admin:
        assert (await admin.check()).ok


async def test_a_page_changed_in_memd_is_never_loaded(engines):
    _, make = engines
    a, b = await asyncio.to_thread(make, "a"), await asyncio.to_thread(make, "b")
    prompt = list(range(200, 250))                                  # 3 full blocks and 2 tokens
    await asyncio.to_thread(_serve, a, Request("r1", list(prompt)), [1, 2, 3, 4])
    victim = await asyncio.to_thread(_page_of_block, b, prompt, 1)
    b.worker.link.client.pool.pages[victim, 100] ^= 0x5A            # one byte of the second block, in memd's pool
    before = b.block(1)

    request = Request("r2", prompt + list(range(900, 920)))         # 70 tokens: 4 full blocks after this step
    assert await asyncio.to_thread(b.admit, request, [0, 1, 2, 3, 5]) == 3 * BS
    plan, errors = await asyncio.to_thread(b.step, {request: 70 - 3 * BS})
    assert errors == {1, 2}                              # from the changed block on, vLLM recomputes
    assert all(torch.equal(x, y) for x, y in zip(b.block(0), a.block(1), strict=True))
    assert all(torch.equal(x, y) for x, y in zip(b.block(1), before, strict=True))     # never overwritten
    assert [save.first for save in plan.saves] == [3] and b.worker.counters["bad_pages"] == 1
    assert b.worker.counters["saved_blocks"] == 0        # nothing is saved of a request whose load failed


def _page_of_block(engine: Engine, prompt: list[int], index: int) -> int:
    """The memd page holding block `index` of `prompt`'s cached prefix: an Open shares it, then is freed."""
    from shared.ops import Free, Open

    async def find(client):
        opened, = await client.step(Open(prompt))
        await client.step(Free(opened.seq_id))
        return opened.block_ids[index]
    page, _ = engine.scheduler.link.call(find)
    return page


async def test_tenants_do_not_see_each_other_s_blocks_and_their_pages_count(engines):
    memd, make = engines
    a = await asyncio.to_thread(make, "a")
    prompt = list(range(300, 340))
    acme = Request("r1", list(prompt), kv_transfer_params={"tenant": "acme"})
    await asyncio.to_thread(a.admit, acme, [1, 2, 3])
    await asyncio.to_thread(a.step, {acme: 40})
    async with memd.admin() as admin:
        rows = {(row.kind, row.name): row.pages for row in (await admin.quotas()).holders}
    assert rows[("tenant", "acme")] == 3                    # memctl tenants counts the engine's pages
    a.scheduler.finished("r1")
    await asyncio.to_thread(a.step, {})
    other = Request("r2", list(prompt), kv_transfer_params={"tenant": "other"})
    again = Request("r3", list(prompt), kv_transfer_params={"tenant": "acme"})
    salted = Request("r4", list(prompt), kv_transfer_params={"tenant": "acme"}, cache_salt="s")
    untenanted = Request("r5", list(prompt))
    assert [await asyncio.to_thread(a.scheduler.matched, r, 0) for r in (other, again, salted, untenanted)] == \
        [0, 2 * BS, 0, 0]


async def test_a_tenant_at_its_max_saves_nothing_and_is_served(engines):
    memd, make = engines
    async with memd.admin() as admin:
        await admin.set_quota("tenant", "small", max_pages=1)
    a = await asyncio.to_thread(make, "a")
    request = Request("r1", list(range(400, 460)), kv_transfer_params={"tenant": "small"})
    await asyncio.to_thread(a.admit, request, [1, 2, 3, 4])
    plan, errors = await asyncio.to_thread(a.step, {request: 60})
    assert plan.saves == [] and errors == set() and a.scheduler.planner.counters["saves_refused"] == 1
    plan, _ = await asyncio.to_thread(a.step, {request: 1})
    assert plan.saves == [] and a.scheduler.planner.counters["saves_refused"] == 1    # not asked again


async def test_memd_gone_costs_hits_never_an_exception(engines):
    memd, make = engines
    a = await asyncio.to_thread(make, "a")
    prompt = list(range(600, 640))
    await asyncio.to_thread(_serve, a, Request("r1", list(prompt)), [1, 2, 3])
    await memd.stop()
    request = Request("r2", list(prompt))
    assert await asyncio.to_thread(a.admit, request, [4, 5, 6]) == 0
    plan, errors = await asyncio.to_thread(a.step, {request: 40})
    assert plan.saves == [] and plan.loads == [] and errors == set()


def test_settings_are_checked_whole():
    assert Settings.parse({"memd_address": "unix:/x", "timeout_s": 1, "tenant": "t"}) == Settings("unix:/x", 1.0, "t")
    assert Settings.parse(None) == Settings.parse({}) == Settings()             # every default, none given
    for bad, words in (({"memd": "x"}, "unknown kv_connector_extra_config key 'memd'"),
                       ({"timeout_s": "1"}, "'timeout_s' must be a number"),
                       ({"timeout_s": 0}, "must be above 0"), ({"tenant": 3}, "'tenant' must be a string")):
        with pytest.raises(SettingsError, match=words):
            Settings.parse(bad)
    assert request_tenant({"tenant": "acme"}, "") == "acme" and request_tenant({"tenant": 5}, "d") == "d"
    assert request_tenant(None, "d") == "d"


def test_a_block_larger_than_a_page_is_refused_with_the_size_to_use():
    caches = {"l": torch.zeros(4, 2, 16, 64)}
    with pytest.raises(LayoutError, match="--block-bytes 8192 or more"):
        BlockCopier(caches, 0, torch.zeros(8, 4096, dtype=torch.uint8))
