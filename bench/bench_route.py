"""Routing by the pools' blocks (kvroute --kv-events) against routing by the prompt's text, over two workers.

    .venv/bin/python bench/bench_route.py [--quick] [--json] [--prompts 8] [--users 4] [--slack 2]

Two hosts (memd --kv-events + inferd --http each, the CPU tiny model) behind
one kvroute, started fresh for each of two runs: **text** routes a request
without a session by its leading text (rendezvous hashing, within the load
slack); **kv** by the index kvroute builds from both memds' KV events, the
text rule deciding where no pool holds the prompt's first block.

The load: 8 system prompts, as a service's teams write them from one
template, so they begin alike (the same long opening: the text rule reads
the same ~128 characters in all of them) and part after it; 4 users each, a
new conversation per user (every request is a first turn, no session). The
users come in rounds: in each, one user of every system prompt at once, in a
shuffled order; the next round once all are answered. Each memd's pool
(12 MiB, about 380 blocks) holds about half the system prompts beside the
requests running: the two hold each prompt once, not twice, as a pool that
serves more than one template's prompts is sized. Reported per run:
turn-1 TTFT p50 and p99 (streamed, the `openai` client), the share of prompt
tokens memd served from cache (rounds after the first, whose prompts some
pool has computed), and where kvroute sent the requests and why. Target: the
kv run's cached share at least 1.5x the text run's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from bench_http_chat import pct
from kv_hosts import serving
from tables import table

from inferd.tiny import CORPUS, make_tiny_model

FULL = {"prompts": 8, "users": 4, "slack": 2, "max_tokens": 8, "opening": 200, "own": 2400, "pool": "12MiB",
        "model": {"arch": "llama", "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096, "seed": 0}}
QUICK = {"prompts": 4, "users": 2, "slack": 1, "max_tokens": 2, "opening": 200, "own": 600, "pool": "8MiB",
         "model": {"arch": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512, "seed": 0}}
MODES = ("text", "kv")
TARGET = 1.5


@dataclass
class Run:
    mode: str
    ttft: list[float] = field(default_factory=list)
    prompt_later: int = 0
    cached_later: int = 0
    routed: dict[str, float] = field(default_factory=dict)      # "worker reason" -> requests


def system_prompts(shape: dict[str, Any]) -> list[str]:
    """One template's prompts: the same opening, then each team's own text (a different stretch of the corpus)."""
    text = CORPUS * (2 + (shape["opening"] + shape["own"] * shape["prompts"]) // len(CORPUS))
    opening = text[:shape["opening"]]
    return [f"{opening}\nYou answer for team {k}. {text[shape['opening'] + 97 * k:][:shape['own']]}"
            for k in range(shape["prompts"])]


async def ask(client: openai.AsyncOpenAI, system: str, question: str, max_tokens: int) -> tuple[float, Any]:
    started = time.perf_counter()
    first, usage = None, None
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if first is None and any(c.delta.content for c in chunk.choices):
            first = time.perf_counter() - started
    if first is None or usage is None:
        raise RuntimeError("a streamed reply came without text or without usage")
    return first, usage


async def load(url: str, shape: dict[str, Any], mode: str, seed: int) -> Run:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    systems, rng, run = system_prompts(shape), random.Random(seed), Run(mode)
    for user in range(shape["users"]):
        order = list(range(len(systems)))
        rng.shuffle(order)
        answers = await asyncio.gather(*[ask(client, systems[k], f"User {user} asks: how do I reset my key?",
                                             shape["max_tokens"]) for k in order])
        for first, usage in answers:
            run.ttft.append(first)
            if user:
                run.prompt_later += usage.prompt_tokens
                run.cached_later += usage.prompt_tokens_details.cached_tokens
    await client.close()
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics")).text
    for labels, value in re.findall(r"kvpool_route_requests_total\{([^}]*)\} ([0-9.e+]+)", text):
        if float(value):
            fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            run.routed[f"{fields['worker']} {fields['reason']}"] = float(value)
    return run


def run_mode(mode: str, model_dir: Path, work: Path, shape: dict[str, Any], seed: int) -> Run:
    with serving(work, model_dir, hosts=2, pool=shape["pool"], kvroute=True, route_by_events=mode == "kv",
                 inferd_flags=("--threads", "1"), kvroute_flags=("--balance-slack", str(shape["slack"]))) as url:
        return asyncio.run(load(url, shape, mode, seed))


def summary(run: Run) -> dict[str, Any]:
    return {"ttft_p50_ms": 1000 * pct(run.ttft, 50), "ttft_p99_ms": 1000 * pct(run.ttft, 99),
            "cached_share": run.cached_later / run.prompt_later if run.prompt_later else 0.0,
            "routed": run.routed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model and load: checks the bench still runs")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--prompts", type=int)
    p.add_argument("--users", type=int)
    p.add_argument("--slack", type=int, help="kvroute's --balance-slack")
    p.add_argument("--pool", help="each memd's --pool-bytes (default 12MiB: the two pools hold every system prompt "
                                  "once, not twice)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    shape = dict(QUICK if args.quick else FULL)
    shape |= {k: v for k in ("prompts", "users", "slack", "pool") if (v := getattr(args, k)) is not None}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-route-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "tiny", **shape["model"])
        try:
            runs = {mode: summary(run_mode(mode, model_dir, work, shape, args.seed)) for mode in MODES}
        except (subprocess.SubprocessError, OSError, openai.OpenAIError, RuntimeError) as exc:
            print(f"bench failed: {exc}", file=sys.stderr)
            print("--- daemons.log\n" + "".join((work / "daemons.log").read_text().splitlines(True)[-12:]),
                  file=sys.stderr)
            return 1
    text_share = runs["text"]["cached_share"]
    ratio = runs["kv"]["cached_share"] / text_share if text_share else float("inf")
    if args.json:
        print(json.dumps({"shape": {k: v for k, v in shape.items() if k != "model"}, "runs": runs,
                          "cached_share_ratio": ratio, "target": TARGET}, indent=2))
        return 0
    print(f"{shape['prompts']} system prompts x {shape['users']} users, 2 workers, balance slack {shape['slack']}, "
          f"{shape['max_tokens']} tokens per reply (CPU tiny model)\n")
    rows = [["routing", "TTFT p50", "p99", "cached (rounds >= 2)", "routed (worker reason: requests)"]]
    for mode, r in runs.items():
        rows.append([mode, f"{r['ttft_p50_ms']:.1f} ms", f"{r['ttft_p99_ms']:.1f} ms",
                     f"{100 * r['cached_share']:.0f}%",
                     ", ".join(f"{k.rsplit(':', 1)[-1]}: {v:.0f}" for k, v in sorted(r["routed"].items()))])
    print(table(rows))
    print(f"\ncached share, kv over text: {ratio:.2f}x (target >= {TARGET:g}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
