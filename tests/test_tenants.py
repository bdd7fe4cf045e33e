"""Tenants (inferd --api-keys FILE): each tenant's sessions and cached prefixes are its own, through the `openai`
client against memd + inferd processes; the file is checked, a bad one refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from shared.http_exchange import ApiError
from shared.tenants import Tenants, TenantsError
from tests.test_memctl import memctl
from tests.test_openai_api import SYSTEM

openai = pytest.importorskip("openai")

MODEL = "tiny"
FILE = """
[tenants.acme]
keys = ["sk-acme"]

[tenants.globex]
keys = ["sk-globex-1", "sk-globex-2"]

[tenants.initech]
keys = ["sk-initech"]
shared_prefix = true

[tenants.umbrella]
keys = ["sk-umbrella"]
shared_prefix = true

[tenants.ops]
keys = ["sk-ops"]
admin = true
"""


@pytest.mark.parametrize(("text", "says"), [
    ("[tenants.a]\nkeys = []\n", "keys must be a list of one or more"),
    ("[tenants.a]\nkeys = ['k']\n[tenants.b]\nkeys = ['k']\n", "a key of it is 'a''s too"),
    ("[tenants.a]\nkeys = ['k']\nquota = 3\n", "its fields are admin, guaranteed_pages, keys, max_pages, "),
    ("[tenants.'a/b']\nkeys = ['k']\n", "a name is 1 to 64 letters"),
    ("[other]\nx = 1\n", "expected [tenants.NAME] tables"),
    ("keys = [", "is not TOML"),
    ("[tenants.a]\nkeys = ['k']\nadmin = 'yes'\n", "shared_prefix and admin are true or false"),
])
def test_a_file_users_get_wrong_is_refused_in_one_line(tmp_path, text, says):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(TenantsError) as err:
        Tenants.load(path)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_key_names_its_tenant_and_a_tenant_names_its_spaces(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(FILE)
    tenants = Tenants.load(path)
    globex = tenants.caller("Bearer sk-globex-2")
    assert globex.name == "globex" and tenants.caller("bearer sk-globex-1") is globex
    assert (globex.session("chat"), globex.salt(None), globex.salt("x")) == ("globex/chat", "tenant:globex",
                                                                           "tenant:globex/x")
    shared = tenants.caller("Bearer sk-initech")
    assert (shared.session("chat"), shared.salt(None), shared.salt("x")) == ("initech/chat", None, "x")
    for wrong in ("Bearer sk-nobody", "sk-acme", "Basic sk-acme", ""):
        with pytest.raises(ApiError) as err:
            tenants.caller(wrong)
        assert err.value.status == 401
    single = Tenants.single("k")
    assert single.caller("Bearer k").session("chat") == "chat" and single.caller("Bearer k").admin


@pytest.mark.processes
async def test_tenants_own_their_sessions_and_cached_prefixes(memd_factory, inferd_factory, model_dir, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(FILE)
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                              "--block-size", "16")
    inferd = await inferd_factory(model_dir, memd.address, "--http", "127.0.0.1:0", "--api-keys", str(keys),
                                  "--served-model-name", MODEL)
    url = f"http://{(await inferd.log.wait_for('inferd ready'))['http']}"
    clients = {name: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
               for name, key in (("acme", "sk-acme"), ("globex", "sk-globex-1"), ("initech", "sk-initech"),
                                 ("umbrella", "sk-umbrella"))}
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]

    async def cached(tenant: str, messages: list, session: str | None = None) -> int:
        reply = await clients[tenant].chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2,
            extra_headers={"X-Session-Id": session} if session else {})
        return reply.usage.prompt_tokens_details.cached_tokens

    # Cached prefixes: another tenant's identical prompt finds nothing; one's own, and a sharing tenant's, do.
    assert await cached("acme", prompt) == 0
    assert await cached("globex", prompt) == 0
    assert await cached("acme", prompt) > 0 and await cached("globex", prompt) > 0
    assert await cached("initech", prompt) == 0
    assert await cached("umbrella", prompt) > 0                # both share one space

    # Sessions: the same name is another session for another tenant; naming one not yours is a 404.
    turn2 = [*prompt, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "And then?"}]
    await cached("acme", prompt, session="mine")
    await cached("globex", turn2, session="mine")                     # globex's own "mine", a session of its own
    async with httpx.AsyncClient(timeout=30) as http:
        gone = await http.delete(f"{url}/v1/sessions/only-acme", headers={"Authorization": "Bearer sk-globex-1"})
        assert gone.status_code == 404
        await cached("acme", prompt, session="only-acme")
        refused = await http.delete(f"{url}/v1/sessions/only-acme", headers={"Authorization": "Bearer sk-globex-1"})
        assert refused.status_code == 404                             # acme's: globex cannot even tell
        reset_by_other = await http.post(f"{url}/reset_prefix_cache", headers={"Authorization": "Bearer sk-acme"})
        assert reset_by_other.status_code == 403
    assert await cached("acme", turn2, session="only-acme") > 0       # untouched by globex's attempts
    assert await cached("acme", turn2, session="mine") > 0
    async with httpx.AsyncClient(timeout=30) as http:
        deleted = await http.delete(f"{url}/v1/sessions/mine", headers={"Authorization": "Bearer sk-acme"})
        assert deleted.status_code == 200 and deleted.json()["deleted"]
        wrong = await http.delete(f"{url}/v1/sessions/mine", headers={"Authorization": "Bearer sk-nobody"})
        assert wrong.status_code == 401
    async with memd.admin() as admin:
        sequences = (await admin.snapshot(blocks=False)).sequences
        assert (await admin.check()).ok
    assert {(s.session_id, s.tenant) for s in sequences if s.session_id} == {("acme/only-acme", "acme"),
                                                                           ("globex/mine", "globex")}
    rc, out, err = await memctl("--address", memd.address, "tenants", "--json")
    assert rc == 0, err
    rows = {row["tenant"]: row for row in json.loads(out)}
    assert rows["acme"]["sessions"] == rows["globex"]["sessions"] == 1 and rows["acme"]["parked"] == 1
    held = {s.tenant: set() for s in sequences}
    for s in sequences:
        held[s.tenant].update(s.block_ids)
    assert all(rows[t]["pages"] == len(pages) > 0 for t, pages in held.items() if t)
    # Every row as the snapshot's sequences make it (memd keeps the rows as they change; "" is no tenant's).
    for tenant in held:
        mine = [s for s in sequences if s.tenant == tenant]
        assert {k: rows[tenant][k] for k in ("sequences", "sessions", "parked", "swapped", "dropped", "running",
                                             "swap_slots", "pages")} == {
            "sequences": len(mine), "sessions": sum(bool(s.session_id) for s in mine),
            **{state: sum(s.state == state for s in mine) for state in ("parked", "swapped", "dropped", "running")},
            "swap_slots": sum(s.swapped_blocks for s in mine), "pages": len(held[tenant])}
    for client in clients.values():
        await client.close()


def test_an_api_keys_file_that_cannot_be_read_stops_inferd_in_one_line(tmp_path: Path):
    path = tmp_path / "missing.toml"
    with pytest.raises(TenantsError) as err:
        Tenants.load(path)
    assert str(err.value).startswith(f"cannot read {path}")
