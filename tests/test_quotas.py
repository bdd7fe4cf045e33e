"""Page quotas per tenant and model, on real memd processes: guaranteed pages, max pages, set at run time."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shared.client import MemdClient, MemdError
from shared.launch import free_port
from shared.ops import Extend, Free, Open, Park, Resume
from tests.clis import run_cli
from tests.test_memd_observability import scrape

BS = 16
SMALL = ("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB", "--lease-timeout", "30",
         "--free-watermark", "0", "--disable-swap")           # 64 pages; an eviction drops


async def park(client: MemdClient, tenant: str, session: str, pages: int, start: int = 0) -> int:
    tokens = list(range(start, start + pages * BS))
    opened, = await client.step(Open(tokens, session_id=session, tenant=tenant))
    await client.step(Extend(opened.seq_id, commit_to=len(tokens)), Park(opened.seq_id))
    return opened.seq_id


async def holders(memd) -> dict[tuple[str, str], dict]:
    async with memd.admin() as admin:
        reply = await admin.quotas()
    return {(h.kind, h.name): {"pages": h.pages, "guaranteed": h.guaranteed_pages, "max": h.max_pages,
                               "evictions": h.evictions, "refusals": h.refusals, "states": dict(h.sequences),
                               "retained_pages": h.retained_pages}
            for h in reply.holders}


async def states(memd) -> dict[int, str]:
    async with memd.admin() as admin:
        return {s.seq_id: s.state for s in (await admin.snapshot(blocks=False)).sequences}


def quota_file(tmp_path, text: str):
    path = tmp_path / "quotas.toml"
    path.write_text(text)
    return str(path)


async def test_others_pressure_never_evicts_a_tenant_below_its_guaranteed_pages(memd_factory, tmp_path):
    memd = await memd_factory(*SMALL, "--quotas", quota_file(tmp_path, "[tenants.quiet]\nguaranteed_pages = 24\n"))
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        quiet = [await park(client, "quiet", f"q{i}", 8, start=1000 * i) for i in range(3)]     # 24 pages
        noisy = [await park(client, "noisy", f"n{i}", 8, start=50_000 + 1000 * i) for i in range(2)]
        # 24 pages free; quiet's sessions are the coldest, but theirs are guaranteed: noisy's own go
        big, = await client.step(Open(list(range(90_000, 90_000 + 40 * BS)), tenant="noisy"))
        seen = await states(memd)
        assert [seen[s] for s in quiet] == ["parked"] * 3
        assert [seen[s] for s in noisy] == ["dropped"] * 2
        # and past that, the Step is refused: no parked page of quiet's is taken for it
        with pytest.raises(MemdError) as refused:
            await client.step(Extend(big.seq_id, reserve=BS))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [(await states(memd))[s] for s in quiet] == ["parked"] * 3
        resumed, = await client.step(Resume(session_id="q0"))
        assert resumed.num_committed == 8 * BS                    # its K/V is still there
        held = await holders(memd)
        assert held[("tenant", "quiet")]["pages"] == 24 and held[("tenant", "quiet")]["evictions"] == 0
        assert held[("tenant", "noisy")]["evictions"] == 2
    async with memd.admin() as admin:
        assert (await admin.check()).ok


async def test_without_a_guarantee_the_same_pressure_evicts_them(memd_factory):
    memd = await memd_factory(*SMALL)
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        quiet = [await park(client, "quiet", f"q{i}", 8, start=1000 * i) for i in range(3)]
        await client.step(Open(list(range(90_000, 90_000 + 60 * BS)), tenant="noisy"))
        assert [(await states(memd))[s] for s in quiet] == ["dropped"] * 3


async def test_a_tenant_at_its_max_loses_its_own_coldest_then_waits_and_no_one_else_pays(memd_factory, tmp_path):
    port = free_port()
    memd = await memd_factory(*SMALL, "--quotas", quota_file(tmp_path, "[tenants.capped]\nmax_pages = 20\n"),
                              "--metrics-port", str(port))
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        other = await park(client, "other", "o", 8, start=70_000)
        old = await park(client, "capped", "old", 8)
        new = await park(client, "capped", "new", 8, start=1000)
        # 16 of its 20 pages are parked: 10 more evict its own coldest (old), never other's, though the pool has room
        opened, = await client.step(Open(list(range(5000, 5000 + 10 * BS)), tenant="capped"))
        seen = await states(memd)
        assert (seen[old], seen[new], seen[other]) == ("dropped", "parked", "parked")
        # 12 more would not fit beside its running 10 even with its last parked one gone: refused, nothing changed
        with pytest.raises(MemdError) as refused:
            await client.step(Open(list(range(9000, 9000 + 12 * BS)), tenant="capped"),
                              Open(list(range(20_000, 20_000 + 8 * BS)), tenant="other"))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.reason == "quota"
        assert refused.value.op_index == 0
        assert (await states(memd))[new] == "parked"
        held = await holders(memd)
        assert held[("tenant", "capped")]["pages"] == 18 and held[("tenant", "capped")]["refusals"] == 1
        # the other tenant's op, sent alone, goes through
        await client.step(Open(list(range(20_000, 20_000 + 8 * BS)), tenant="other"))
        # a sequence bigger than the max could never run: bad input, not a wait
        with pytest.raises(MemdError) as too_big:
            await client.step(Extend(opened.seq_id, reserve=30 * BS))
        assert too_big.value.code is grpc.StatusCode.INVALID_ARGUMENT and "max of 20 pages" in too_big.value.message
        await client.step(Free(opened.seq_id))
    m = await asyncio.to_thread(scrape, port)
    capped = '{kind="tenant",name="capped"}'
    assert m[f"kvpool_memd_holder_pages{capped}"] == 8 and m[f"kvpool_memd_holder_max_pages{capped}"] == 20
    assert m[f"kvpool_memd_holder_evictions_total{capped}"] == 1
    assert m[f"kvpool_memd_holder_quota_refusals_total{capped}"] == 1
    assert m['kvpool_memd_holder_pages{kind="tenant",name="other"}'] == 8      # its parked one; the worker left
    assert m['kvpool_memd_evictions_total{reason="quota"}'] == 1
    async with memd.admin() as admin:
        assert (await admin.check()).ok


async def test_a_model_quota_works_the_same_way(memd_factory, tmp_path):
    memd = await memd_factory(*SMALL, "--quotas", quota_file(tmp_path, "[models.small]\nmax_pages = 10\n"))
    async with await MemdClient.attach(memd.address, block_size=BS, model="small") as client:
        first = await park(client, "", "a", 8)
        await client.step(Open(list(range(1000, 1000 + 8 * BS))))
        assert (await states(memd))[first] == "dropped"
        assert (await holders(memd))[("model", "small")]["pages"] == 8


async def test_quotas_set_at_run_time_take_effect_at_once_and_outlive_a_kill(memd_factory, tmp_path):
    memd = await memd_factory(*SMALL)
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        sessions = [await park(client, "acme", f"s{i}", 6, start=1000 * i) for i in range(4)]     # 24 pages
        rc, out, err = await run_cli("memd.memctl", "--address", memd.address, "quota", "tenant", "acme",
                                     "--max", "12", "--guaranteed", "6")
        assert rc == 0, err
        assert "acme" in out
        # the sweep brings it under its new max: its two coldest sessions go
        await memd.log.wait_for("dropped", seq_ids=sessions[:2])
        seen = await states(memd)
        assert [seen[s] for s in sessions] == ["dropped", "dropped", "parked", "parked"]
    await memd.kill()
    memd = await memd_factory(*SMALL)                           # the same socket and state directory
    acme = (await holders(memd))[("tenant", "acme")]
    assert (acme["pages"], acme["guaranteed"], acme["max"]) == (12, 6, 12)
    assert acme["states"] == {"parked": 2, "dropped": 2}
    rc, out, err = await run_cli("memd.memctl", "--address", memd.address, "tenants", "--json")
    assert rc == 0, err
    assert '"max_pages": 12' in out
    rc, out, err = await run_cli("memd.memctl", "--address", memd.address, "check")
    assert rc == 0, out + err


@pytest.mark.parametrize(("args", "message"), [
    (("tenant", "acme", "--guaranteed", "30", "--max", "10"), "past its max"),
    (("tenant", "acme", "--guaranteed", "65"), "more pages than the pool"),
    (("planet", "x"), "invalid choice"),
    (("tenant",), "needs the tenant's name"),
    (("tenant", "acme", "--clear", "--max", "3"), "give no pages"),
])
async def test_a_bad_quota_is_one_line_and_changes_nothing(memd_factory, args, message):
    memd = await memd_factory(*SMALL)
    rc, _, err = await run_cli("memd.memctl", "--address", memd.address, "quota", *args)
    assert rc in (1, 2) and message in err and "Traceback" not in err
    assert ("tenant", "acme") not in await holders(memd)


async def test_guarantees_past_the_pool_are_refused_at_start(memd_factory, tmp_path):
    path = quota_file(tmp_path, "[tenants.a]\nguaranteed_pages = 40\n[tenants.b]\nguaranteed_pages = 40\n")
    with pytest.raises(AssertionError, match="add up to 80"):
        await memd_factory(*SMALL, "--quotas", path)


async def test_a_guarantee_counts_a_swap_out_in_flight_as_gone(memd_factory, tmp_path):
    flags = [f for f in SMALL if f != "--disable-swap"]                           # 19 swap slots
    memd = await memd_factory(*flags, "--log-level", "debug", "--quotas",
                              quota_file(tmp_path, "[tenants.g]\nguaranteed_pages = 16\n"),
                              env={"SWAP_LATENCY_TEST": "60"})                   # a copy outlasts the test
    async with await MemdClient.attach(memd.address, block_size=BS) as client, memd.admin() as admin:
        first = await park(client, "g", "a1", 8)
        await park(client, "g", "a2", 8, start=1000)
        await park(client, "g", "a3", 8, start=2000)
        evicting = asyncio.create_task(admin.evict(blocks=48))   # 40 free: a1 goes (24 held, 16 guaranteed)
        await memd.log.wait_for("rpc", method="Evict")
        # a1's pages are still held while its copy runs, but they are going: a2 or a3 would take g below 16
        reply = await admin.evict(blocks=56)
        assert list(reply.seq_ids) == []
        stats = await admin.stats()
        assert stats.swap_free_blocks == stats.swap_total_blocks - 8            # a1's slots only
        await client.step(Free(session_id="a1"))                                 # its copy called off
        assert (await evicting).swapped == [] and first not in await states(memd)
        assert (await admin.check()).ok


async def test_a_step_past_its_max_is_refused_as_such_before_others_are_evicted_for_it(memd_factory, tmp_path):
    memd = await memd_factory(*SMALL, "--quotas", quota_file(tmp_path, "[tenants.x]\nmax_pages = 20\n"))
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        other = await park(client, "y", "y", 14)
        running, _ = await client.step(Open(list(range(5000, 5000 + 12 * BS)), tenant="x"),
                                       Open(list(range(7000, 7000 + 4 * BS)), tenant="x"))
        await client.step(Open(list(range(9000, 9000 + 32 * BS)), tenant="z"))         # 2 pages free now
        with pytest.raises(MemdError) as refused:                # 8 more for x: past its max, and the pool short
            await client.step(Extend(running.seq_id, reserve=8 * BS))
        assert refused.value.reason == "quota"
        assert (await states(memd))[other] == "parked"           # y lost nothing for x's Step


async def test_a_models_max_never_takes_a_tenant_below_its_guarantee(memd_factory, tmp_path):
    quotas = "[models.m]\nmax_pages = 24\n[tenants.g]\nguaranteed_pages = 16\n"
    memd = await memd_factory(*SMALL, "--quotas", quota_file(tmp_path, quotas))
    async with await MemdClient.attach(memd.address, block_size=BS, model="m") as client:
        kept = [await park(client, "g", f"g{i}", 8, start=1000 * i) for i in range(2)]
        with pytest.raises(MemdError) as refused:
            await client.step(Open(list(range(9000, 9000 + 16 * BS)), tenant="z"))
        assert refused.value.reason == "model_quota"
        assert [(await states(memd))[s] for s in kept] == ["parked", "parked"]


async def test_memctl_quota_changes_what_it_is_told_and_keeps_the_rest(memd_factory, tmp_path):
    memd = await memd_factory(*SMALL, "--quotas", quota_file(tmp_path, "[tenants.acme]\nguaranteed_pages = 6\n"))
    rc, _, err = await run_cli("memd.memctl", "--address", memd.address, "quota", "tenant", "acme")
    assert rc == 2 and "say what to set" in err
    rc, _, err = await run_cli("memd.memctl", "--address", memd.address, "quota", "tenant", "acme", "--max", "12")
    assert rc == 0, err
    acme = (await holders(memd))[("tenant", "acme")]
    assert (acme["guaranteed"], acme["max"]) == (6, 12)
