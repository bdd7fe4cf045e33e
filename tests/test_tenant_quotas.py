"""A noisy tenant floods one pool with long chats: a guaranteed tenant's parked sessions keep their K/V.

Real memd and inferd processes, the `openai` client, the greedy answers judged by `transformers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import pytest

from tests.clis import run_cli

openai = pytest.importorskip("openai")

MODEL = "tiny"
KEYS = """
[tenants.quiet]
keys = ["sk-quiet"]
{guarantee}

[tenants.noisy]
keys = ["sk-noisy"]
"""
# The tiny model's pages are 8 KiB (16 tokens): 96 of them. Quiet's 8 sessions hold 24; noisy's chats want
# far more than the rest.
POOL = ("--device", "cpu", "--pool-bytes", "768KiB", "--block-size", "16", "--disable-swap",
        "--free-watermark", "0")
QUIET_SESSIONS, PROMPT, ANSWER = 8, 40, 8


async def serve(memd_factory, inferd_factory, model_dir, tmp_path, tenants: str, *inferd_flags: str) -> tuple:
    """memd (--quotas) and inferd (--api-keys) on one tenants file: (memd, inferd, the API's URL, memd's flags)."""
    keys = tmp_path / "tenants.toml"
    keys.write_text(tenants)
    flags = (*POOL, "--model", str(model_dir), "--quotas", str(keys))
    memd = await memd_factory(*flags)
    inferd = await inferd_factory(model_dir, memd.address, "--http", "127.0.0.1:0", "--api-keys", str(keys),
                                  "--served-model-name", MODEL, *inferd_flags)
    return memd, inferd, f"http://{(await inferd.log.wait_for('inferd ready'))['http']}/v1", flags


async def complete(client, prompt: list[int], session: str, max_tokens: int = ANSWER, *, header: str | None = None,
                   field: str | None = None) -> tuple[list[int], int]:
    """A greedy turn of a session: (its answer's token ids, the prompt tokens memd had cached). `header`,
    `field`: a retention asked in X-Session-Retention, or in prompt_cache_retention."""
    reply = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                    **({"prompt_cache_retention": field} if field else {})},
        extra_headers={"X-Session-Id": session, **({"X-Session-Retention": header} if header else {})})
    ids = [int(token.removeprefix("token_id:")) for token in reply.choices[0].logprobs.tokens]
    return ids, reply.usage.prompt_tokens_details.cached_tokens


async def flood(client, rng: random.Random) -> None:
    """Long chats, three at a time, two turns each: far more pages than the pool has beside quiet's."""
    async def chat(n: int) -> None:
        history = [rng.randrange(512) for _ in range(400)]
        for _ in range(2):
            answer, _ = await complete(client, history, f"noisy-{n}", 4)
            history += answer + [rng.randrange(512) for _ in range(150)]
    for wave in range(3):
        await asyncio.gather(*(chat(3 * wave + i) for i in range(3)))


@pytest.mark.parametrize("guaranteed", [True, False], ids=["guaranteed", "unguaranteed"])
async def test_a_guaranteed_tenants_parked_sessions_survive_a_noisy_neighbour(
        memd_factory, inferd_factory, model_dir, model_judge, tmp_path, guaranteed):
    memd, _, url, _ = await serve(memd_factory, inferd_factory, model_dir, tmp_path,
                                  KEYS.format(guarantee="guaranteed_pages = 32" if guaranteed else ""))
    quiet = openai.AsyncOpenAI(base_url=url, api_key="sk-quiet", max_retries=0)
    noisy = openai.AsyncOpenAI(base_url=url, api_key="sk-noisy", max_retries=0)
    rng = random.Random(7)

    histories = {}
    for n in range(QUIET_SESSIONS):
        prompt = [rng.randrange(512) for _ in range(PROMPT)]
        answer, _ = await complete(quiet, prompt, f"quiet-{n}", ANSWER)
        model_judge.assert_greedy(prompt, answer, ANSWER, f"quiet-{n}, turn 1")
        histories[n] = prompt + answer

    await flood(noisy, rng)

    kept = []
    for n, history in histories.items():
        prompt = history + [rng.randrange(512) for _ in range(8)]
        answer, cached = await complete(quiet, prompt, f"quiet-{n}", ANSWER)
        model_judge.assert_greedy(prompt, answer, ANSWER, f"quiet-{n}, turn 2")
        kept.append(cached >= len(history) - 1)         # its whole first turn, but the token never fed back
    rc, out, err = await run_cli("memd.memctl", "--address", memd.address, "tenants")
    assert rc == 0, err
    if guaranteed:
        assert all(kept), f"sessions that lost their K/V: {kept}\n{out}"
    else:
        assert not any(kept), f"sessions that kept their K/V without a guarantee: {kept}\n{out}"
    rc, out, err = await run_cli("memd.memctl", "--address", memd.address, "check")
    assert rc == 0, out + err


CAPPED = """
[tenants.capped]
keys = ["sk-capped"]
max_pages = 24

[tenants.other]
keys = ["sk-other"]
"""


class Watch:
    """Reads memd's per-tenant pages while the load runs: the most a tenant was ever seen to hold."""

    def __init__(self, memd) -> None:
        self.memd, self.most = memd, 0
        self._task = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        async with self.memd.admin() as admin:
            while True:
                for h in (await admin.quotas()).holders:
                    if (h.kind, h.name) == ("tenant", "capped"):
                        self.most = max(self.most, h.pages)
                await asyncio.sleep(0.005)                 # sampling, not waiting for anything

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def tenant_pages(memd) -> dict[str, int]:
    async with memd.admin() as admin:
        return {h.name: h.pages for h in (await admin.quotas()).holders if h.kind == "tenant"}


async def test_a_tenants_max_holds_under_load_a_worker_kill_and_a_memd_restart(
        memd_factory, inferd_factory, model_dir, tmp_path):
    memd, inferd, url, flags = await serve(memd_factory, inferd_factory, model_dir, tmp_path, CAPPED)
    capped = openai.AsyncOpenAI(base_url=url, api_key="sk-capped", max_retries=0)
    other = openai.AsyncOpenAI(base_url=url, api_key="sk-other", max_retries=0)
    rng = random.Random(11)

    async def chat(client, name: str) -> int:
        prompt = [rng.randrange(512) for _ in range(60)]
        answer, _ = await complete(client, prompt, name, 16)
        return len(answer)

    watch = Watch(memd)
    # 12 chats of 5 pages each want 60 pages at once; the tenant may hold 24. The other tenant's go beside them.
    done = await asyncio.gather(*(chat(capped, f"c{i}") for i in range(12)), *(chat(other, f"o{i}") for i in range(4)))
    assert done == [16] * 16                       # every one answered in full: at its max a tenant waits
    assert 0 < watch.most <= 24
    assert (await tenant_pages(memd))["capped"] <= 24
    async with memd.admin() as admin:
        held = {(h.kind, h.name): h for h in (await admin.quotas()).holders}
    assert held[("tenant", "capped")].refusals > 0            # it did reach its max, and waited there
    assert held[("tenant", "other")].refusals == 0

    # A worker killed in the middle of a wave: what it ran is parked (its whole blocks), and still within the max.
    wave = [asyncio.ensure_future(chat(capped, f"k{i}")) for i in range(11)]
    stream = await capped.completions.create(
        model=MODEL, prompt=[rng.randrange(512) for _ in range(60)], max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": "k-stream"})
    await anext(aiter(stream))                       # its first token: it runs now, among the others
    await inferd.kill()
    await asyncio.gather(*wave, return_exceptions=True)
    await watch.stop()
    assert watch.most <= 24
    rc, out, err = await run_cli("memd.memctl", "--address", memd.address, "check")
    assert rc == 0, out + err
    before = await tenant_pages(memd)
    assert before["capped"] <= 24

    # memd killed and started again: the journal brings every sequence back, and with them the same counts.
    await memd.kill()
    memd = await memd_factory(*flags)
    assert await tenant_pages(memd) == before
    rc, out, err = await run_cli("memd.memctl", "--address", memd.address, "tenants", "--json")
    assert rc == 0, err
    rows = {row["tenant"]: row for row in json.loads(out)}
    assert rows["capped"]["pages"] == before["capped"] and rows["capped"]["max_pages"] == 24
    rc, out, err = await run_cli("memd.memctl", "--address", memd.address, "check")
    assert rc == 0, out + err


KEEP = """
[tenants.keep]
keys = ["sk-keep"]
guaranteed_pages = 3

[tenants.noisy]
keys = ["sk-noisy"]
"""


async def test_a_retained_session_survives_the_flood_that_drops_an_unretained_one(
        memd_factory, inferd_factory, model_dir, model_judge, tmp_path):
    memd, _, url, _ = await serve(memd_factory, inferd_factory, model_dir, tmp_path, KEEP)
    keep = openai.AsyncOpenAI(base_url=url, api_key="sk-keep", max_retries=0)
    noisy = openai.AsyncOpenAI(base_url=url, api_key="sk-noisy", max_retries=0)
    rng = random.Random(3)
    prompts = {name: [rng.randrange(512) for _ in range(PROMPT)] for name in ("kept", "plain", "more")}

    for bad in ("forever", "25h", "0s"):
        with pytest.raises(openai.BadRequestError, match="retention is in_memory or a duration"):
            await complete(keep, prompts["kept"], "kept", header=bad)
    with pytest.raises(openai.BadRequestError, match="keeps a session"):
        await keep.completions.create(model=MODEL, prompt=[1, 2], max_tokens=1,
                                      extra_headers={"X-Session-Retention": "30m"})
    with pytest.raises(openai.BadRequestError, match="no guaranteed pages"):
        await complete(noisy, prompts["kept"], "n", header="30m")
    answer, _ = await complete(keep, prompts["kept"], "kept", header="30m")            # 3 pages: its guarantee
    with pytest.raises(openai.RateLimitError) as past:
        await complete(keep, prompts["more"], "more", field="24h")
    assert past.value.code == "retention_exceeded"
    plain, _ = await complete(keep, prompts["plain"], "plain", field="in_memory")
    async with memd.admin() as admin:
        held = {(h.kind, h.name): h for h in (await admin.quotas()).holders}
        sessions = {s.session_id for s in (await admin.snapshot(blocks=False)).sequences}
    assert held[("tenant", "keep")].retained_pages == 3
    assert "keep/more" not in sessions                                             # the refusal left nothing

    await flood(noisy, rng)

    history = prompts["kept"] + answer
    prompt = history + [rng.randrange(512) for _ in range(8)]
    again, cached = await complete(keep, prompt, "kept")
    assert cached >= len(history) - 1                                              # all of its K/V, kept
    model_judge.assert_greedy(prompt, again, ANSWER, "the retained session's second turn")
    _, cached = await complete(keep, prompts["plain"] + plain + [7], "plain")
    assert cached < PROMPT                                                         # dropped, recomputed


LIMITS = """
[tenants.keep]
keys = ["sk-keep"]
guaranteed_pages = 4
max_pages = 6

[tenants.small]
keys = ["sk-small"]
max_pages = 4
"""


async def test_a_request_waits_at_its_tenants_max_then_fails_and_an_answer_stops_at_it(
        memd_factory, inferd_factory, model_dir, tmp_path):
    memd, _, url, _ = await serve(memd_factory, inferd_factory, model_dir, tmp_path, LIMITS, "--quota-wait", "1")
    keep = openai.AsyncOpenAI(base_url=url, api_key="sk-keep", max_retries=0)
    small = openai.AsyncOpenAI(base_url=url, api_key="sk-small", max_retries=0)
    rng = random.Random(5)
    # 4 pages promised, kept whatever comes: 3 more would pass keep's max of 6, and nothing of keep's can go
    await complete(keep, [rng.randrange(512) for _ in range(56)], "kept", 8, header="1h")
    with pytest.raises(openai.RateLimitError) as waited:
        await complete(keep, [rng.randrange(512) for _ in range(40)], "more", 4)
    assert waited.value.code == "quota_exceeded"
    async with memd.admin() as admin:
        held = {(h.kind, h.name): h for h in (await admin.quotas()).holders}
    assert held[("tenant", "keep")].pages == 4 and held[("tenant", "keep")].refusals > 0
    # a sequence of small's may never pass 4 pages: its answer stops there, as at max_tokens, and is kept
    prompt = [rng.randrange(512) for _ in range(32)]
    reply = await small.completions.create(model=MODEL, prompt=prompt, max_tokens=100, temperature=0,
                                           extra_body={"ignore_eos": True}, extra_headers={"X-Session-Id": "s"})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens < 100
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= 4 * 16 + 1
    async with memd.admin() as admin:
        kept = {s.session_id: s.state for s in (await admin.snapshot(blocks=False)).sequences}
    assert kept.get("small/s") == "parked"                         # the session stays, as any finished turn's
