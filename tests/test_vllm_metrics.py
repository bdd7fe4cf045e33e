"""inferd's /metrics speaks vLLM's names: each vllm:* family it exports has the type, label names and histogram
buckets vLLM's own server gives it (read from the vLLM wheel at test time, by tests/vllm_probe.py), the ones
gateways and autoscalers read are all there, and their counts follow the requests served (memd + inferd
processes, the `openai` client)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_openai_api import KEY, MODEL, start_stack

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "vllm_probe.py"
# What the Gateway API Inference Extension, llm-d's scheduler, autoscalers and load tools read.
READ_BY_THE_FLEET = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:cache_config_info",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:request_success", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:num_preemptions", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"}


def vllm_python() -> Path:
    """The interpreter of the vLLM venv bench/peer_engines.py keeps (made on first use, from the registry)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import peer_engines
    import torch

    return peer_engines.vllm_python(gpu=torch.cuda.is_available())


@pytest.fixture(scope="module")
def vllm_families() -> dict[str, dict]:
    done = subprocess.run([str(vllm_python()), str(PROBE), "metrics"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["families"]


def exported(text: str) -> dict[str, dict]:
    """inferd's vllm:* families as a scraper reads them: type, label names, buckets, and the samples."""
    families = {}
    for family in text_string_to_metric_families(text):
        # (A counter's *_created sample reads as a family of its own in the text format; vLLM's carry one too.)
        if family.name.startswith("vllm:") and not family.name.endswith("_created"):
            buckets = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
            families[family.name] = {
                "type": family.type, "buckets": [b for b in buckets if b != float("inf")],
                "labels": sorted({k for s in family.samples for k in s.labels if k != "le"}),
                "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}}
    return families


def value(families: dict[str, dict], family: str, sample: str, **labels: str) -> float:
    found = {dict(key[1]).get("finished_reason"): v for key, v in families[family]["samples"].items()
             if key[0] == sample and all(dict(key[1]).get(k) == want for k, want in labels.items())}
    assert len(found) == 1, (family, sample, labels, families[family]["samples"])
    return next(iter(found.values()))


async def test_the_vllm_families_inferd_exports_are_vllms_and_count_what_was_served(
        vllm_families, memd_factory, inferd_factory, model_dir):
    memd, _inferd, url = await start_stack(memd_factory, inferd_factory, model_dir)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
    messages = [{"role": "user", "content": "What does memd keep between the turns of a chat?"}]
    usages = []
    for turn in range(2):                             # a session's second turn finds its first one in memd
        reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                     extra_headers={"X-Session-Id": "chat"},
                                                     extra_body={"ignore_eos": True})
        usages.append(reply.usage)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And turn {turn + 2}?"}]
    stream = await client.completions.create(model=MODEL, prompt="Pages of KV", max_tokens=4, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usages += [chunk.usage async for chunk in stream if chunk.usage is not None]
    await client.close()
    async with httpx.AsyncClient(timeout=30) as http:
        ours = exported((await http.get(f"{url}/metrics")).text)
    async with memd.admin() as admin:
        pool_blocks = (await admin.stats()).total_blocks

    assert set(ours) >= READ_BY_THE_FLEET, READ_BY_THE_FLEET - set(ours)
    for name, family in ours.items():
        assert name in vllm_families, f"{name} is not a metric of vLLM's"
        theirs = vllm_families[name]
        assert (family["type"], family["buckets"]) == (theirs["type"], theirs["buckets"]), name
        if name == "vllm:cache_config_info":         # an info gauge: the labels kvpool has, of vLLM's
            assert {"block_size", "num_gpu_blocks", "engine"} <= set(family["labels"]) <= set(theirs["labels"])
        else:
            assert family["labels"] == theirs["labels"], name

    labels = {"model_name": MODEL, "engine": "0"}
    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0 for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert cached > 0                                  # the second turn's
    assert value(ours, "vllm:request_success", "vllm:request_success_total", finished_reason="length",
                 **labels) == 3
    assert value(ours, "vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 0
    assert value(ours, "vllm:prompt_tokens", "vllm:prompt_tokens_total", **labels) == prompt
    assert value(ours, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == prompt
    assert value(ours, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == cached
    assert value(ours, "vllm:generation_tokens", "vllm:generation_tokens_total") == generated == 14
    assert value(ours, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 3
    assert value(ours, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 14 - 3
    assert value(ours, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 3
    assert value(ours, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_count") == 3
    assert value(ours, "vllm:num_requests_running", "vllm:num_requests_running", **labels) == 0
    assert value(ours, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 0
    usage = value(ours, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
    assert 0 < usage < 1                               # the parked session holds pages of the pool
    info = next(dict(key[1]) for key in ours["vllm:cache_config_info"]["samples"])
    assert (info["block_size"], info["num_gpu_blocks"]) == ("16", str(pool_blocks))
