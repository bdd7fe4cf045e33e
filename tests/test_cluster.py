"""The cluster tier on a real Mooncake Store: mooncake_master (from the kvpool[cluster] wheel), memd and inferd.

Skipped where kvpool[cluster] is not installed (`.ci/run` installs it, and the
system libraries its import needs).
"""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest

from memd.cluster import block_keys, session_key
from memd.sequences import prefix_space
from shared.launch import free_port
from tests.store_master import Store
from tests.test_inferd_service import inferctl, memctl
from tests.test_memd_restart import memd_flags, turn

pytest.importorskip("mooncake.store", reason="needs kvpool[cluster] (Mooncake Store's client)")
PROMPT = "Tell me a story about a cat who learned to sail."


async def test_a_parked_session_is_published_once_per_block_and_a_reset_takes_it_back(
        store, memd_factory, inferd_factory, model_dir):
    memd = await memd_factory(*memd_flags(model_dir), *store.flags())
    await memd.log.wait_for("joined the cluster store")
    inferd = await inferd_factory(model_dir, memd.address)
    first = await turn(inferd, "chat", PROMPT, 14)
    published = await memd.log.wait_for("published a session to the cluster store", session="chat")
    history = first["usage"]["prompt_tokens"] + 14
    assert published["tokens"] == history and published["blocks"] == (history - 1) // 16
    assert published["new_blocks"] == published["blocks"] >= 2

    async with memd.admin() as admin:
        model = (await admin.snapshot(blocks=False)).sequences[0].model
    _, record = await asyncio.to_thread(store.look, [], session_key("chat"))
    keys = block_keys(model, record["tokens"], 16, published["blocks"])
    assert record["keys"] == keys and len(record["tokens"]) == history and all(record["checksums"])
    assert (await asyncio.to_thread(store.look, keys))[0] == [True] * len(keys)

    # Another session with the same prompt: its leading blocks are in the store already, stored once.
    await turn(inferd, "other", PROMPT, 14)
    again = await memd.log.wait_for("published a session to the cluster store", session="other")
    assert again["new_blocks"] < again["blocks"]
    rc, out, _ = await memctl(memd.address, "stats")
    assert rc == 0 and "cluster   store reachable; blocks out" in out
    async with memd.admin() as admin:
        stats = await admin.stats()
    counters = stats.counters
    assert stats.cluster == "reachable"
    assert counters["cluster_puts"] == published["blocks"] + again["new_blocks"]
    assert counters["cluster_bytes_out"] > 0 and counters.get("cluster_errors", 0) == 0

    rc, _, err = await inferctl(inferd.address, "reset", "chat")
    assert rc == 0, err
    await memd.log.wait_for("removed a session from the cluster store", session="chat")
    assert (await asyncio.to_thread(store.look, [], session_key("chat")))[1] is None


async def test_memd_refuses_a_store_address_that_is_no_address_in_one_line(memd_factory, model_dir, tmp_path):
    from tests.conftest import start_memd
    with pytest.raises(Exception) as failed:
        await start_memd(tmp_path, *memd_flags(model_dir), "--cluster-master", "127.0.0.1",
                         "--cluster-metadata", f"http://127.0.0.1:{free_port()}/metadata",
                         "--cluster-host", "127.0.0.1")
    assert "--cluster-master '127.0.0.1' is not HOST:PORT" in str(failed.value)


async def test_memd_serves_with_the_store_down_at_start_and_publishes_once_it_comes_up(
        memd_factory, inferd_factory, model_dir, model_judge):
    store = Store()                                  # its ports, with nothing listening on them yet
    memd = await memd_factory(*memd_flags(model_dir), *store.flags())
    down = await memd.log.wait_for("the cluster store is unreachable; memd serves this host's sessions alone and "
                                   "joins it when it answers")
    assert f"no mooncake_master at {store.master}" in down["error"]
    rc, out, _ = await memctl(memd.address, "stats", "--json")
    assert rc == 0 and json.loads(out)["cluster"] == f"unreachable: {down['error']}"
    inferd = await inferd_factory(model_dir, memd.address)
    first = await turn(inferd, "chat", PROMPT, 6)                   # a chat, served with the store down
    model_judge.assert_greedy(model_judge.encode(PROMPT), first["token_ids"], 6, "with the store down at start")
    await memd.log.wait_for("the cluster store did not take a change; the session stays on this host",
                            session="chat")
    try:
        await store.start()
        await memd.log.wait_for("joined the cluster store", timeout=60)      # its retries back off up to 30 s
        await turn(inferd, "chat", "And then?", 6)
        published = await memd.log.wait_for("published a session to the cluster store", session="chat")
        _, record = await asyncio.to_thread(store.look, [], session_key("chat"))
        assert record is not None and len(record["tokens"]) == published["tokens"]
        async with memd.admin() as admin:
            stats = await admin.stats()
        assert stats.cluster == "reachable" and stats.counters["cluster_errors"] >= 1
        assert stats.counters["cluster_puts"] == published["new_blocks"] > 0
        assert memd.log.find("the cluster store is unreachable; memd serves this host's sessions alone and joins "
                             "it when it answers", nth=2, error=down["error"]) is None    # a line per change
    finally:
        await store.kill()


async def test_a_host_lost_after_a_turn_costs_no_recompute_on_another(
        store, memd_factory, inferd_factory, model_dir, model_judge):
    hosts = []
    for name in ("a", "b"):                   # two hosts: a memd each (own pool), both in the one store
        memd = await memd_factory(*memd_flags(model_dir), *store.flags(), name=f"memd-{name}")
        hosts.append((memd, await inferd_factory(model_dir, memd.address, name=f"inferd-{name}")))
    (memd_a, inferd_a), (memd_b, inferd_b) = hosts
    first = await turn(inferd_a, "chat", PROMPT, 14)
    published = await memd_a.log.wait_for("published a session to the cluster store", session="chat")

    await inferd_a.kill()                                     # host a is lost, worker and memd
    await memd_a.kill()
    second = await turn(inferd_b, "chat", "And then?", 10)
    model_judge.assert_greedy(model_judge.encode(PROMPT) + first["token_ids"] + model_judge.encode("And then?"),
                              second["token_ids"], 10, "the turn after its host was lost")
    assert second["usage"]["cached_tokens"] == published["blocks"] * 16      # fetched, not recomputed
    async with memd_b.admin() as admin:
        counters = (await admin.stats()).counters
        assert (await admin.check()).ok
    assert counters["cluster_sessions_fetched"] == 1 and counters["cluster_hits"] == published["blocks"]
    assert counters.get("cluster_misses", 0) == 0 and counters["pages_verified"] >= published["blocks"]


async def test_a_block_gone_from_the_store_is_recomputed_from_there(
        store, memd_factory, inferd_factory, model_dir, model_judge):
    memd_a = await memd_factory(*memd_flags(model_dir), *store.flags(), name="memd-a")
    inferd_a = await inferd_factory(model_dir, memd_a.address, name="inferd-a")
    first = await turn(inferd_a, "chat", PROMPT, 14)
    await memd_a.log.wait_for("published a session to the cluster store", session="chat")
    _, record = await asyncio.to_thread(store.look, [], session_key("chat"))
    await asyncio.to_thread(store.remove, record["keys"][1])            # evicted, say

    memd_b = await memd_factory(*memd_flags(model_dir), *store.flags(), name="memd-b")
    inferd_b = await inferd_factory(model_dir, memd_b.address, name="inferd-b")
    second = await turn(inferd_b, "chat", "And then?", 10)
    model_judge.assert_greedy(model_judge.encode(PROMPT) + first["token_ids"] + model_judge.encode("And then?"),
                              second["token_ids"], 10, "the turn after a block left the store")
    assert second["usage"]["cached_tokens"] == 16                         # the block before the missing one
    async with memd_b.admin() as admin:
        counters = (await admin.stats()).counters
        assert (await admin.check()).ok
    assert counters["cluster_misses"] == 1 and counters["cluster_hits"] == 1
    # said as what it is: a page the store lost, not host memory that changed under a swapped-out page
    assert memd_b.log.count("a page fetched from the cluster store is gone or not what was published: its K/V is "
                            "recomputed") == 1
    assert memd_b.log.count("a swapped-in page is not what was swapped out: its K/V is recomputed") == 0


async def test_a_new_session_fetches_the_prefix_another_host_published(
        store, memd_factory, inferd_factory, model_dir, model_judge):
    memd_a = await memd_factory(*memd_flags(model_dir), *store.flags(), name="memd-a")
    inferd_a = await inferd_factory(model_dir, memd_a.address, name="inferd-a")
    await turn(inferd_a, "chat", PROMPT, 14)
    await memd_a.log.wait_for("published a session to the cluster store", session="chat")

    memd_b = await memd_factory(*memd_flags(model_dir), *store.flags(), name="memd-b")
    inferd_b = await inferd_factory(model_dir, memd_b.address, name="inferd-b")
    other = await turn(inferd_b, "other", PROMPT, 10)                # a new session, the same prompt
    prompt = model_judge.encode(PROMPT)
    model_judge.assert_greedy(prompt, other["token_ids"], 10, "a prompt whose prefix came from another host")
    reused = (len(prompt) - 1) // 16 * 16                             # as the prefix cache: the last token computed
    assert other["usage"]["cached_tokens"] == reused > 0
    async with memd_b.admin() as admin:
        counters = (await admin.stats()).counters
    assert counters["cluster_prefix_blocks"] == counters["cluster_hits"] == reused // 16


async def test_a_salted_prefix_in_the_store_serves_only_its_salt(store, memd_factory, inferd_factory, model_dir):
    """vLLM's cache_salt across hosts: blocks published under a salt are fetched by that salt's prompts only."""
    openai = pytest.importorskip("openai")
    hosts = []
    for name in ("a", "b"):
        memd = await memd_factory(*memd_flags(model_dir), *store.flags(), name=f"memd-{name}")
        inferd = await inferd_factory(model_dir, memd.address, "--http", "127.0.0.1:0", "--served-model-name", "tiny",
                                      name=f"inferd-{name}")
        hosts.append((memd, f"http://{(await inferd.log.wait_for('inferd ready'))['http']}/v1"))

    async def cached(url: str, salt: str, session: str) -> int:
        client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
        reply = await client.completions.create(model="tiny", prompt=PROMPT * 3, max_tokens=2,
                                                extra_body={"cache_salt": salt},
                                                extra_headers={"X-Session-Id": session})
        await client.close()
        return reply.usage.prompt_tokens_details.cached_tokens

    (memd_a, url_a), (memd_b, url_b) = hosts
    assert await cached(url_a, "team-a", "chat") == 0
    await memd_a.log.wait_for("published a session to the cluster store", session="chat")
    assert await cached(url_b, "team-b", "other") == 0                 # the same prompt, another salt
    assert await cached(url_b, "team-a", "third") > 0                  # its own salt: fetched from the store
    async with memd_b.admin() as admin:
        counters = (await admin.stats()).counters
    assert counters["cluster_prefix_blocks"] > 0


def test_a_record_whose_keys_are_not_its_tokens_is_never_trusted():
    from memd.cluster import RECORD_VERSION, parse_record

    tokens = list(range(40))
    record = {"v": RECORD_VERSION, "model": "m", "block_size": 16, "tokens": tokens,
              "keys": block_keys("m", tokens, 16, 2), "checksums": [5, 6]}
    assert parse_record(msgpack.packb(record)) is not None
    for bad in ({"tokens": [9] * 40}, {"model": "other"}, {"checksums": [5, 0]}, {"keys": record["keys"][:1]},
                {"v": RECORD_VERSION + 1}, {"tokens": tokens[:20]}):
        assert parse_record(msgpack.packb({**record, **bad})) is None, bad
    assert parse_record(b"not msgpack \xff") is None
    salted = {**record, "salt": "team-a", "keys": block_keys(prefix_space("m", "team-a"), tokens, 16, 2)}
    assert parse_record(msgpack.packb(salted)).salt == "team-a"
    assert parse_record(msgpack.packb({**salted, "salt": "team-b"})) is None     # keys of another salt
    assert parse_record(msgpack.packb({**record, "salt": "team-a"})) is None     # unsalted keys


async def test_a_store_that_dies_costs_a_turn_at_most_the_lookup_deadline_and_no_error(
        store, memd_factory, inferd_factory, model_dir, model_judge):
    memd = await memd_factory(*memd_flags(model_dir), *store.flags())
    inferd = await inferd_factory(model_dir, memd.address)
    await store.kill()
    while True:                                  # until memd's client noticed (it pings the master every second)
        rc, out, _ = await memctl(memd.address, "stats", "--json")
        assert rc == 0
        if json.loads(out)["cluster"].startswith("unreachable"):
            break
    answer = await turn(inferd, "new", PROMPT, 6)                   # looks "new" up: the store does not answer
    model_judge.assert_greedy(model_judge.encode(PROMPT), answer["token_ids"], 6, "with the store gone")
    await memd.log.wait_for("the cluster store did not answer: sessions and prefixes are computed here for 10 s")


async def test_a_retention_promise_travels_with_its_session_through_the_store(store, memd_factory, tmp_path):
    """A session kept under a promise on one host is kept under it on the host that fetches it, where its
    tenant's guarantee pays; where none does, it is fetched all the same, with no promise and no error."""
    from shared.client import MemdClient
    from shared.ops import Open, Park
    from tests.test_quotas import SMALL, quota_file
    from tests.test_retention import BS, park, retained_until

    keep = quota_file(tmp_path, "[tenants.keep]\nguaranteed_pages = 8\n")
    a, b, c = [await memd_factory(*SMALL, *store.flags(), *(("--quotas", keep) if name != "c" else ()),
                                  name=f"memd-{name}") for name in ("a", "b", "c")]
    async with await MemdClient.attach(a.address, block_size=BS) as client:
        kept = await park(client, "kept", 4, retain_s=600)
        await park(client, "plain", 2, start=500)
    until = await retained_until(a, kept)
    for session in ("kept", "plain"):
        await a.log.wait_for("published a session to the cluster store", session=session)
    for memd, promised in ((b, until), (c, 0.0)):
        async with await MemdClient.attach(memd.address, block_size=BS) as client:
            fetched = []
            for session in ("kept", "plain"):
                opened, = await client.step(Open([7] * 5, session_id=session, continue_session=True, tenant="keep"))
                await client.step(Park(opened.seq_id))
                fetched.append(opened.seq_id)
        assert [await retained_until(memd, seq_id) for seq_id in fetched] == [promised, 0.0]
        async with memd.admin() as admin:
            counters = (await admin.stats()).counters
            assert (await admin.check()).ok                    # the fetched sessions hold what their tables say
        assert counters["cluster_sessions_fetched"] == 2
        assert counters.get("cluster_retention_not_kept", 0) == (1 if memd is c else 0)
