"""Retention promises on real memd processes: swapped perhaps, never dropped, paid from guaranteed pages."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from shared.client import MemdClient, MemdError
from shared.ops import Extend, Free, Open, Park, Resume
from tests.test_quotas import SMALL, holders, quota_file, states

BS = 16
QUOTAS = "[tenants.keep]\nguaranteed_pages = 8\n"


async def park(client: MemdClient, session: str, pages: int, start: int = 0, retain_s: float = 0.0,
               tenant: str = "keep") -> int:
    tokens = list(range(start, start + pages * BS))
    opened, = await client.step(Open(tokens, session_id=session, tenant=tenant, retain_s=retain_s))
    await client.step(Extend(opened.seq_id, commit_to=len(tokens)), Park(opened.seq_id))
    return opened.seq_id


async def retained_until(memd, seq_id: int) -> float:
    async with memd.admin() as admin:
        return next(s.retain_until for s in (await admin.snapshot(blocks=False)).sequences if s.seq_id == seq_id)


async def test_pressure_drops_the_unretained_session_and_never_the_retained_one(memd_factory, tmp_path):
    memd = await memd_factory(*SMALL, "--quotas", quota_file(tmp_path, QUOTAS))
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        kept = await park(client, "kept", 8, retain_s=3600)          # the coldest: heat alone would take it
        other = await park(client, "other", 8, start=1000)
        # 48 free; 56 wanted: 8 must go. The guarantee lets either go (16 held, 8 guaranteed); the promise picks.
        big, = await client.step(Open(list(range(90_000, 90_000 + 56 * BS)), tenant="noisy"))
        seen = await states(memd)
        assert (seen[kept], seen[other]) == ("parked", "dropped")
        assert await retained_until(memd, kept) > time.time() + 3000
        # and past that nothing can go: refused rather than break the promise
        with pytest.raises(MemdError) as refused:
            await client.step(Extend(big.seq_id, reserve=BS))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        resumed, = await client.step(Resume(session_id="kept"))
        assert resumed.num_committed == 8 * BS
        await client.step(Park(resumed.seq_id), Free(big.seq_id))
        held = await holders(memd)
        assert held[("tenant", "keep")]["retained_pages"] == 8
    async with memd.admin() as admin:
        assert (await admin.check()).ok


async def test_with_a_swap_tier_a_retained_session_is_swapped_and_a_full_tier_never_drops_it(memd_factory,
                                                                                              tmp_path):
    flags = [f for f in SMALL if f != "--disable-swap"] + ["--swap-ratio", "0.15"]        # 9 swap slots
    memd = await memd_factory(*flags, "--quotas", quota_file(tmp_path, QUOTAS))
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        kept = await park(client, "kept", 8, retain_s=3600)
        async with memd.admin() as admin:
            await admin.evict(session_id="kept")                     # swapped, as any session may be
        assert (await states(memd))[kept] == "swapped"
        hot = await park(client, "hot", 8, start=1000, tenant="other")
        for _ in range(3):                                           # hotter than kept
            resumed, = await client.step(Resume(session_id="hot"))
            await client.step(Park(resumed.seq_id))
        async with memd.admin() as admin:
            await admin.evict(session_id="hot")                      # the tier is full of kept's: hot cannot go
        seen = await states(memd)
        assert (seen[kept], seen[hot]) == ("swapped", "dropped")     # not kept, colder, dropped for room
        resumed, = await client.step(Resume(session_id="kept"))
        assert resumed.num_committed == 8 * BS and resumed.token_ids == list(range(8 * BS))


async def test_a_promise_past_the_guarantee_or_without_one_is_refused_and_changes_nothing(memd_factory, tmp_path):
    memd = await memd_factory(*SMALL, "--quotas", quota_file(tmp_path, QUOTAS))
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        await park(client, "first", 6, retain_s=60)
        with pytest.raises(MemdError) as past:
            await park(client, "second", 3, start=1000, retain_s=60)          # 6 + 3 > 8
        assert past.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and past.value.reason == "retention"
        assert "6 pages of sessions already" in past.value.message
        with pytest.raises(MemdError) as none:
            await park(client, "x", 1, start=2000, retain_s=60, tenant="plain")
        assert none.value.code is grpc.StatusCode.INVALID_ARGUMENT and "no guaranteed pages" in none.value.message
        with pytest.raises(MemdError) as sessionless:
            await client.step(Open([1, 2, 3], tenant="keep", retain_s=60))
        assert sessionless.value.code is grpc.StatusCode.INVALID_ARGUMENT
        async with memd.admin() as admin:
            sessions = {s.session_id for s in (await admin.snapshot(blocks=False)).sequences}
        assert sessions == {"first"}                                  # the refused Steps left nothing
        assert (await holders(memd))[("tenant", "keep")]["retained_pages"] == 6


async def test_a_promise_outlives_a_memd_kill_and_its_end_makes_the_session_evictable(memd_factory, tmp_path):
    memd = await memd_factory(*SMALL, "--quotas", quota_file(tmp_path, QUOTAS))
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        kept = await park(client, "kept", 8, retain_s=8)          # long enough for a restart on a busy machine
    until = await retained_until(memd, kept)
    await memd.kill()
    memd = await memd_factory(*SMALL, "--quotas", quota_file(tmp_path, QUOTAS))
    assert await retained_until(memd, kept) == until                 # journaled, wall-clock
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        await park(client, "other", 8, start=1000)
        big, = await client.step(Open(list(range(90_000, 90_000 + 56 * BS)), tenant="noisy"))
        assert (await states(memd))[kept] == "parked"                # still promised: the other one went
        await client.step(Free(big.seq_id))
        await asyncio.sleep(max(0.0, until - time.time()))            # no event marks a promise's end: its time does
        again = await park(client, "again", 8, start=3000)
        await client.step(Open(list(range(90_000, 90_000 + 56 * BS)), tenant="noisy"))
        seen = await states(memd)
        assert (seen[kept], seen[again]) == ("dropped", "parked")    # heat eviction again: the colder one goes
