"""`bench_inferd.py --served`: decode through `inferd serve`, as its users reach it, against transformers.

inferd runs as a process of its own (`inferd serve --http`, its torch
threads set by `--threads`), attached to a memd; this process is the client:
it streams `/v1/completions` (greedy, `ignore_eos`) over HTTP and notes when
each chunk arrives. The client is aiohttp, as vLLM's own serving benchmark
uses: on two cores the client shares the machine with the server, and
httpx's pure-Python HTTP parsing took 3 ms of CPU per decode step of 16
streams from the server it measures. transformers runs as in the in-process bench: its own
process, `generate()` on its main thread, the same checkpoint, prompts and
thread count, warm. Each thread count gets a fresh inferd; both systems take
turns on every measurement. Both processes are held to the same cores (the
first N for N threads: inferd's event loop and forward thread share them),
and transformers runs with inferd's heap and collector policy.

Both decode greedily on the same weights, so their tokens must agree:
`agreement` is the share of the first batch's prompts whose completion
through inferd (asked again, untimed, for its token ids) is transformers'
to the last token, or parts from it only where kvpool picked </s>
(`ignore_eos` lets it; transformers' `min_new_tokens` masks it out).

Decode tok/s: tokens after each request's first over first -> last chunk
(one request at a time: summed over requests; 16 at once: one window per
batch, against transformers' 16 prompts as one left-padded batch).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
from bench_inferd import (
    BLOCK_SIZE,
    CONCURRENT,
    MAX_BATCH_TOKENS,
    START_TIMEOUT_S,
    HfAnchor,
    Run,
    both,
    compare_tokens,
    decode_rate,
)
from scraped_metrics import scraped

from inferd.checkpoint import read_config
from shared.launch import free_port, spawn_ready


async def stream_one(client: aiohttp.ClientSession, model: str, prompt: list[int], n: int) -> Run:
    """One streamed completion; its tokens are counted from the usage chunk, timed by chunk arrival."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    submitted, times, generated = time.monotonic(), [], 0
    async with client.post("/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.monotonic())
            if chunk.get("usage"):
                generated = chunk["usage"]["completion_tokens"]
    if generated != n or not times:
        raise RuntimeError(f"inferd answered {generated} tokens of {n}")
    return Run([0] * generated, submitted, times[0], times[-1])


async def greedy_ids(client: aiohttp.ClientSession, model: str, prompt: list[int], n: int) -> Run:
    """The token ids of one greedy completion (logprobs naming tokens by id, as vLLM's option does); untimed."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    async with client.post("/v1/completions", json=body) as reply:
        reply.raise_for_status()
        tokens = (await reply.json())["choices"][0]["logprobs"]["tokens"]
    return Run([int(t.removeprefix("token_id:")) for t in tokens], 0.0, 0.0, 0.0)


async def _measure(url: str, anchor: HfAnchor, work: dict, n: int) -> dict[str, list]:
    """Warm-up, then each measurement on both systems, alternating which goes first."""
    out: dict[str, list] = {"kv_single": [], "hf_single": [], "kv_batch": [], "hf_batch": []}
    connector = aiohttp.TCPConnector(limit=CONCURRENT * 2)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as client:
        async with client.get("/v1/models") as reply:
            model = (await reply.json())["data"][0]["id"]

        async def kv_batch(prompts: list[list[int]], tokens: int) -> list[Run]:
            return list(await asyncio.gather(*[stream_one(client, model, p, tokens) for p in prompts]))

        for prompts in work["warmup"]:
            await both(0, lambda p=prompts: kv_batch(p, 8), lambda p=prompts: anchor.generate(p, 8))
        for i, prompt in enumerate(work["singles"]):
            ours, theirs = await both(i, lambda p=prompt: stream_one(client, model, p, n),
                                      lambda p=prompt: anchor.generate([p], n)[0])
            out["kv_single"].append(ours)
            out["hf_single"].append(theirs)
        for i, prompts in enumerate(work["batches"]):
            ours, theirs = await both(i, lambda ps=prompts: kv_batch(ps, n), lambda ps=prompts: anchor.generate(ps, n))
            out["kv_batch"].append(ours)
            out["hf_batch"].append(theirs)
        out["kv_ids"] = list(await asyncio.gather(*[greedy_ids(client, model, p, n) for p in work["batches"][0]]))
    return out


def served(model_dir: Path, memd_address: str, tmp: Path, threads: int, work: dict, n: int) -> dict:
    """Decode rates of `inferd serve --threads threads` and of transformers on as many threads."""
    port, cpus = free_port(), set(range(threads))
    inferd = spawn_ready(["inferd", "serve", "--model", str(model_dir), "--memd", memd_address, "--listen",
                          f"unix:{tmp / f'inferd-{threads}.sock'}", "--http", f"127.0.0.1:{port}",
                          "--threads", str(threads), "--block-size", str(BLOCK_SIZE), "--max-num-seqs",
                          str(CONCURRENT), "--max-batch-tokens", str(MAX_BATCH_TOKENS), "--log-level", "warning"],
                         tmp, timeout_s=START_TIMEOUT_S, cpus=cpus)
    anchor = HfAnchor(model_dir, threads, cpus=cpus)
    try:
        raw = asyncio.run(_measure(f"http://127.0.0.1:{port}", anchor, work, n))
        metrics = scraped(f"http://127.0.0.1:{port}/metrics")
    finally:
        anchor.close()
        inferd.terminate()
        inferd.wait()
    res = {"threads": threads,
           "kvpool_b1_decode": decode_rate([[r] for r in raw["kv_single"]]),
           "hf_b1_decode": decode_rate([[r] for r in raw["hf_single"]]),
           "kvpool_b16_decode": decode_rate(raw["kv_batch"]),
           "hf_b16_padded_decode": decode_rate(raw["hf_batch"])}
    for kind in ("decode", "prefill", "mixed"):          # the served inferd's own account of its passes
        count = metrics[f'kvpool_inferd_forward_pass_seconds_count{{kind="{kind}"}}']
        total = metrics[f'kvpool_inferd_forward_pass_seconds_sum{{kind="{kind}"}}']
        res[f"inferd_{kind}_passes"] = count
        res[f"inferd_{kind}_pass_ms"] = total / count * 1e3 if count else 0.0
    res["inferd_full_collections"] = metrics["kvpool_inferd_gc_full_collections_total"]
    res["inferd_longest_full_collection_ms"] = metrics["kvpool_inferd_gc_longest_full_collection_seconds"] * 1e3
    agreed = compare_tokens(raw["kv_ids"], raw["hf_batch"][0], read_config(model_dir).eos_token_ids)
    res["agreement"] = (agreed["same_tokens"] + agreed["differ_at_eos"]) / agreed["compared"]
    res["b1_ratio"] = res["kvpool_b1_decode"] / res["hf_b1_decode"]
    res["b16_ratio"] = res["kvpool_b16_decode"] / res["hf_b16_padded_decode"]
    return res
