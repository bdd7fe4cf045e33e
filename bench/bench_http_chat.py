"""Multi-turn chat load over inferd's OpenAI-compatible HTTP API: what KV reuse is worth to a chat service.

    .venv/bin/python bench/bench_http_chat.py [--quick] [--json] [--users 8] [--turns 4] [--think 1.0]

N users chat at once, each a conversation of several turns with think time
between them; every turn resends the whole conversation (as OpenAI clients
do) and streams the reply, through the official `openai` async client, to a
real memd + inferd (`--http`) on the CPU tiny model. Three runs, each on
fresh daemons:

- **no reuse**: memd `--no-prefix-cache`, no session header: every turn
  computes the whole conversation again (a server without prefix caching);
- **prefix cache**: stateless requests; the full blocks of earlier turns are
  found in memd's prefix cache;
- **session**: `X-Session-Id` per user: memd keeps each conversation's
  sequence parked between turns, its partial last block included.

Each user's system prompt (about 1k tokens, as a chat service's instructions
run) starts with the user's own number, so users share no blocks: what is
reused is a conversation's own earlier turns. Think time is 1 s. Reported per
run: time to first token (turn 1, and turns >= 2) and inter-token latency,
p50 and p99, output tokens/s over the run's wall time, and the share of turn
>= 2 prompt tokens memd served from cache. Target: turn >= 2 TTFT p50 with
reuse at least 5x lower than without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from tables import table

from inferd.tiny import CORPUS, make_tiny_model
from shared.launch import free_port, spawn_ready

FULL = {"users": 8, "turns": 4, "think_s": 1.0, "max_tokens": 32, "corpus": 4,
        "model": {"arch": "llama", "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096, "seed": 0}}
QUICK = {"users": 2, "turns": 2, "think_s": 0.0, "max_tokens": 4, "corpus": 1,
         "model": {"arch": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512, "seed": 0}}
MODES = ("no reuse", "prefix cache", "session")
QUESTIONS = ["What does the memory manager do?", "And what happens when a worker crashes?",
             "How are cold sessions swapped out?", "What is time to first token?", "Why share prefixes?",
             "What does a block table hold?"]
TARGET_TTFT = 5.0


@dataclass
class Run:
    mode: str
    ttft_first: list[float] = field(default_factory=list)      # seconds, turn 1
    ttft_later: list[float] = field(default_factory=list)      # seconds, turns >= 2
    itl: list[float] = field(default_factory=list)             # seconds between streamed text chunks
    tokens: int = 0
    prompt_later: int = 0
    cached_later: int = 0
    wall_s: float = 0.0


async def streamed_chat(client: openai.AsyncOpenAI, model: str, messages: list[dict], max_tokens: int,
                        itl: list[float], headers: dict[str, str]) -> tuple[float, str, Any]:
    """One greedy streamed chat turn (`ignore_eos`): its time to first text, its reply and its usage; the gaps
    between text chunks after the first go to `itl`."""
    started = time.perf_counter()
    last, first, reply, usage = started, None, "", None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, extra_headers=headers)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        text = "".join(c.delta.content or "" for c in chunk.choices)
        if not text:
            continue
        now = time.perf_counter()
        if first is None:
            first = now - started
        else:
            itl.append(now - last)
        last, reply = now, reply + text
    if first is None or usage is None:
        raise RuntimeError("a streamed reply came without text or without usage")
    return first, reply, usage


async def user(client: openai.AsyncOpenAI, model: str, number: int, run: Run, shape: dict[str, Any]) -> None:
    headers = {"X-Session-Id": f"user-{number}"} if run.mode == "session" else {}
    messages = [{"role": "system", "content": f"You are assistant number {number}.\n" + CORPUS * shape["corpus"]}]
    for turn in range(shape["turns"]):
        if turn and shape["think_s"]:
            await asyncio.sleep(shape["think_s"])        # the user reads and types: think time, not a wait
        messages.append({"role": "user", "content": QUESTIONS[(number + turn) % len(QUESTIONS)]})
        first, reply, usage = await streamed_chat(client, model, messages, shape["max_tokens"], run.itl, headers)
        messages.append({"role": "assistant", "content": reply})
        (run.ttft_later if turn else run.ttft_first).append(first)
        run.tokens += usage.completion_tokens
        if turn:
            run.prompt_later += usage.prompt_tokens
            run.cached_later += usage.prompt_tokens_details.cached_tokens


def run_mode(mode: str, model_dir: Path, work: Path, shape: dict[str, Any]) -> Run:
    memd_addr, port = f"unix:{work / f'memd-{MODES.index(mode)}.sock'}", free_port()
    flags = ["--no-prefix-cache"] if mode == "no reuse" else []
    daemons = []
    with open(work / "memd.log", "a") as memd_log, open(work / "inferd.log", "a") as inferd_log:
        try:
            daemons.append(spawn_ready(["memd", "--device", "cpu", "--model", str(model_dir), "--block-size", "16",
                                        "--pool-bytes", "128MiB", "--listen", memd_addr, *flags,
                                        "--log-format", "json"], work, stderr=memd_log.fileno()))
            daemons.append(spawn_ready(["inferd", "serve", "--model", str(model_dir), "--memd", memd_addr,
                                        "--listen", f"unix:{work / 'inferd.sock'}", "--http", f"127.0.0.1:{port}",
                                        "--served-model-name", "tiny", "--log-format", "json"],
                                       work, stderr=inferd_log.fileno()))
            return asyncio.run(load(mode, f"http://127.0.0.1:{port}/v1", shape))
        finally:
            for proc in reversed(daemons):
                proc.terminate()
                proc.wait(timeout=30)


async def load(mode: str, url: str, shape: dict[str, Any]) -> Run:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "warm up"}],
                                         max_tokens=2)        # the first pass pays for torch's warm-up
    run = Run(mode)
    started = time.perf_counter()
    await asyncio.gather(*[user(client, "tiny", number, run, shape) for number in range(shape["users"])])
    run.wall_s = time.perf_counter() - started
    await client.close()
    return run


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(run: Run) -> dict[str, float]:
    return {"ttft_turn1_p50_ms": 1000 * pct(run.ttft_first, 50),
            "ttft_later_p50_ms": 1000 * pct(run.ttft_later, 50), "ttft_later_p99_ms": 1000 * pct(run.ttft_later, 99),
            "itl_p50_ms": 1000 * pct(run.itl, 50), "itl_p99_ms": 1000 * pct(run.itl, 99),
            "output_tok_s": run.tokens / run.wall_s if run.wall_s else 0.0,
            "cached_share_later": run.cached_later / run.prompt_later if run.prompt_later else 0.0}


def chat_load_args(doc: str, full: dict[str, Any], quick: dict[str, Any]) -> tuple[argparse.Namespace,
                                                                                   dict[str, Any]]:
    """The flags of a chat-load bench, and the load's shape they choose (--quick's or the full one, adjusted)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model and load: checks the bench still runs")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--users", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--think", type=float, dest="think_s")
    args = p.parse_args()
    shape = dict(quick if args.quick else full)
    return args, shape | {k: v for k in ("users", "turns", "think_s") if (v := getattr(args, k)) is not None}


def main() -> int:
    args, shape = chat_load_args(__doc__, FULL, QUICK)
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-http-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "tiny", **shape["model"])
        try:
            runs = {mode: summary(run_mode(mode, model_dir, work, shape)) for mode in MODES}
        except (subprocess.SubprocessError, OSError, openai.OpenAIError) as exc:
            print(f"bench failed: {exc}", file=sys.stderr)
            for name in ("memd.log", "inferd.log"):
                print(f"--- {name}\n" + "".join((work / name).read_text().splitlines(True)[-10:]), file=sys.stderr)
            return 1
    off = runs["no reuse"]["ttft_later_p50_ms"]
    ratios = {mode: off / r["ttft_later_p50_ms"] for mode, r in runs.items() if mode != "no reuse"}
    if args.json:
        print(json.dumps({"shape": {k: v for k, v in shape.items() if k != "model"}, "runs": runs,
                          "ttft_later_ratio": ratios, "target": TARGET_TTFT}, indent=2))
        return 0
    print(f"{shape['users']} users x {shape['turns']} turns, think {shape['think_s']} s, "
          f"{shape['max_tokens']} tokens per reply, streamed over HTTP (CPU tiny model)\n")
    rows = [["", "TTFT turn 1 p50", "TTFT turn>=2 p50", "p99", "ITL p50", "p99", "output tok/s",
             "cached (turn>=2)"]]
    for mode, r in runs.items():
        rows.append([mode, f"{r['ttft_turn1_p50_ms']:.1f} ms", f"{r['ttft_later_p50_ms']:.1f} ms",
                     f"{r['ttft_later_p99_ms']:.1f} ms", f"{r['itl_p50_ms']:.1f} ms", f"{r['itl_p99_ms']:.1f} ms",
                     f"{r['output_tok_s']:.0f}", f"{100 * r['cached_share_later']:.0f}%"])
    print(table(rows))
    print("\nturn >= 2 TTFT p50, no reuse over reuse: " + ", ".join(
        f"{mode} {ratio:.1f}x" for mode, ratio in ratios.items()) + f" (target >= {TARGET_TTFT:g}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
