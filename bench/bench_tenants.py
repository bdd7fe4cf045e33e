"""A noisy neighbour on one pool: does a tenant with guaranteed pages keep its conversations' K/V?

    .venv/bin/python bench/bench_tenants.py [--quick] [--json] [--users 4] [--turns 4]

One memd and one inferd (`--http`), their tenants and quotas from one file
(inferd --api-keys, memd --quotas), as an operator runs them, on the CPU
tiny model of bench_http_chat, with memd's default swap tier. The quiet
tenant's users chat in sessions (a system prompt of about 1k tokens each,
streamed replies, the official `openai` client). Between their turns the
noisy tenant floods the pool with long chats of its own, several times what
the pool holds beside the quiet tenant's sessions. Three runs, each on fresh
daemons:

- **alone**: no noisy tenant (the baseline);
- **noisy, guaranteed**: quiet has `guaranteed_pages` for its sessions;
- **noisy, no quota**: the same flood, no quotas: heat alone decides.

Reported per run: the quiet tenant's time to first token on turns >= 2
(p50, p99: measured with the flood done, so it is what the flood left in the
pool that counts, not a shared CPU), the share of those turns' prompt tokens
memd had cached, and the noisy tenant's output tokens. Target: turn >= 2
TTFT p50 with the guaranteed noisy neighbour within 1.2x of alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from bench_http_chat import QUESTIONS, pct, streamed_chat
from kv_hosts import BLOCK_SIZE, serving
from tables import table

from inferd.tiny import CORPUS, make_tiny_model
from shared.geometry import read_model_shape

FULL = {"users": 4, "turns": 4, "max_tokens": 32, "corpus": 4, "noisy_chats": 8, "noisy_tokens": 1800,
        "model": {"arch": "llama", "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096, "seed": 0}}
QUICK = {"users": 2, "turns": 2, "max_tokens": 4, "corpus": 1, "noisy_chats": 4, "noisy_tokens": 600,
         "model": {"arch": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512, "seed": 0}}
RUNS = ("alone", "noisy, guaranteed", "noisy, no quota")
TARGET = 1.2


@dataclass
class Run:
    name: str
    ttft_later: list[float] = field(default_factory=list)
    prompt_later: int = 0
    cached_later: int = 0
    noisy_tokens: int = 0


def sizes(model_dir: Path, shape: dict[str, Any]) -> tuple[int, int, int]:
    """(page bytes, pages the quiet tenant's sessions hold at their last turn, pool pages): the pool holds the
    quiet tenant's sessions with room to spare, and far less than the flood wants beside them."""
    m = read_model_shape(model_dir)
    page = BLOCK_SIZE * 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4
    per_user = (len(CORPUS) // 3 * shape["corpus"] + shape["turns"] * (shape["max_tokens"] + 24)) // BLOCK_SIZE + 4
    quiet = per_user * shape["users"]
    return page, quiet, 2 * quiet


def tenants_file(work: Path, run: str, guaranteed: int) -> Path:
    path = work / f"tenants-{RUNS.index(run)}.toml"
    quota = f"guaranteed_pages = {guaranteed}\n" if run == "noisy, guaranteed" else ""
    path.write_text(f'[tenants.quiet]\nkeys = ["sk-quiet"]\n{quota}\n[tenants.noisy]\nkeys = ["sk-noisy"]\n')
    return path


async def quiet_turn(client: openai.AsyncOpenAI, number: int, turn: int, messages: list[dict], run: Run,
                     shape: dict[str, Any]) -> None:
    messages.append({"role": "user", "content": QUESTIONS[(number + turn) % len(QUESTIONS)]})
    first, reply, usage = await streamed_chat(client, "tiny", messages, shape["max_tokens"], [],
                                              {"X-Session-Id": f"user-{number}"})
    messages.append({"role": "assistant", "content": reply})
    if turn:
        run.ttft_later.append(first)
        run.prompt_later += usage.prompt_tokens
        run.cached_later += usage.prompt_tokens_details.cached_tokens


async def flood(client: openai.AsyncOpenAI, run: Run, shape: dict[str, Any], rng: random.Random, wave: int) -> None:
    """Long chats of the noisy tenant, all at once, two turns each: pages it holds past the pool's room."""
    vocab = shape["model"]["vocab"]

    async def chat(n: int) -> None:
        history = [rng.randrange(vocab) for _ in range(shape["noisy_tokens"])]
        for _ in range(2):
            reply = await client.completions.create(
                model="tiny", prompt=history, max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
                extra_headers={"X-Session-Id": f"noisy-{wave}-{n}"})
            run.noisy_tokens += reply.usage.completion_tokens
            history += [rng.randrange(vocab) for _ in range(shape["noisy_tokens"] // 4)]
    await asyncio.gather(*(chat(n) for n in range(shape["noisy_chats"])))


async def load(run: Run, url: str, shape: dict[str, Any]) -> None:
    quiet = openai.AsyncOpenAI(base_url=url, api_key="sk-quiet", max_retries=0)
    noisy = openai.AsyncOpenAI(base_url=url, api_key="sk-noisy", max_retries=0)
    await quiet.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "warm up"}],
                                        max_tokens=2)          # the first pass pays for torch's warm-up
    rng = random.Random(0)
    chats = [[{"role": "system", "content": f"You are assistant number {n}.\n" + CORPUS * shape["corpus"]}]
             for n in range(shape["users"])]
    for turn in range(shape["turns"]):
        if turn and run.name != "alone":
            await flood(noisy, run, shape, rng, turn)
        await asyncio.gather(*(quiet_turn(quiet, n, turn, chat, run, shape) for n, chat in enumerate(chats)))
    await quiet.close()
    await noisy.close()


def run_one(name: str, model_dir: Path, work: Path, shape: dict[str, Any]) -> Run:
    page, quiet_pages, pool_pages = sizes(model_dir, shape)
    keys = str(tenants_file(work, name, quiet_pages))
    with serving(work, model_dir, hosts=1, pool=str(pool_pages * page), kvroute=False,
                 memd_flags=("--quotas", keys), inferd_flags=("--api-keys", keys)) as url:
        run = Run(name)
        asyncio.run(load(run, f"{url}/v1", shape))
        return run


def summary(run: Run) -> dict[str, float]:
    return {"ttft_later_p50_ms": 1000 * pct(run.ttft_later, 50), "ttft_later_p99_ms": 1000 * pct(run.ttft_later, 99),
            "cached_share_later": run.cached_later / run.prompt_later if run.prompt_later else 0.0,
            "noisy_output_tokens": run.noisy_tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model and load: checks the bench still runs")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--users", type=int)
    p.add_argument("--turns", type=int)
    args = p.parse_args()
    shape = dict(QUICK if args.quick else FULL)
    shape |= {k: v for k in ("users", "turns") if (v := getattr(args, k)) is not None}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-tenants-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "tiny", **shape["model"])
        _, quiet_pages, pool_pages = sizes(model_dir, shape)
        try:
            runs = {name: summary(run_one(name, model_dir, work, shape)) for name in RUNS}
        except (subprocess.SubprocessError, OSError, RuntimeError, openai.OpenAIError) as exc:
            print(f"bench failed: {exc}", file=sys.stderr)
            print("".join((work / "daemons.log").read_text().splitlines(True)[-10:]), file=sys.stderr)
            return 1
    ratio = runs["noisy, guaranteed"]["ttft_later_p50_ms"] / runs["alone"]["ttft_later_p50_ms"]
    unprotected = runs["noisy, no quota"]["ttft_later_p50_ms"] / runs["alone"]["ttft_later_p50_ms"]
    if args.json:
        print(json.dumps({"shape": {k: v for k, v in shape.items() if k != "model"}, "pool_pages": pool_pages,
                          "guaranteed_pages": quiet_pages, "runs": runs, "guaranteed_over_alone": ratio,
                          "no_quota_over_alone": unprotected, "target": TARGET,
                          "seconds": time.perf_counter() - started}, indent=2))
        return 0
    print(f"quiet: {shape['users']} users x {shape['turns']} turns in sessions, {shape['max_tokens']} tokens per "
          f"reply; noisy: {shape['noisy_chats']} chats of {shape['noisy_tokens']}+ tokens between turns; pool "
          f"{pool_pages} pages, quiet guaranteed {quiet_pages} (CPU tiny model)\n")
    rows = [["", "quiet TTFT turn>=2 p50", "p99", "cached (turn>=2)", "noisy output tokens"]]
    for name, r in runs.items():
        rows.append([name, f"{r['ttft_later_p50_ms']:.1f} ms", f"{r['ttft_later_p99_ms']:.1f} ms",
                     f"{100 * r['cached_share_later']:.0f}%", str(r["noisy_output_tokens"])])
    print(table(rows))
    print(f"\nturn >= 2 TTFT p50 over alone: guaranteed {ratio:.2f}x (target <= {TARGET:g}x), "
          f"no quota {unprotected:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
