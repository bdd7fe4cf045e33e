"""GPU decode bench: inferd on a GPU pool against transformers on the same GPU, on a Llama-1B-shaped checkpoint.

    python3 bench/bench_gpu_decode.py [--device cuda:0] [--quick] [--json]

The checkpoint is random, of Llama 3.2 1B's shape (16 layers, hidden 2048,
32 query and 8 KV heads of 64, MLP 8192, vocabulary 128,256, bfloat16);
`--quick` makes a tiny one instead, and with `--device cpu` the whole bench
runs where no GPU is (the test suite does, so that it cannot rot).

1. Served decode. memd owns the pool on the device (`memd --device`), and
   inferd's `Scheduler` runs in this process over a real `MemdClient`, its
   decoder writing and reading K/V in the pool through CUDA IPC, one memd Step
   per iteration, as `inferd serve` runs it. transformers runs as its users
   run it: a process of its own (bench_inferd.py's anchor), model on the same
   device, `generate()` on its main thread, warm. Decode tokens/s (first
   token to last, the prefill's token not counted) at 1 request (one at a
   time, both systems), and at 16 and 64 concurrent requests against the same
   prompts as one left-padded batch for transformers.
2. Time to first token of a chat's second turn after a ~1k-token first turn:
   kvpool resumes the session memd parked; transformers prefills history and
   message again (it keeps nothing between calls).
3. What the paged read buys: the decoder alone, on the pages memd handed out,
   16 and 64 decode rows at ~1k tokens of context, flex attention reading the
   pages (`--attention`, default flex) against the gathered copy (inferd's
   default on a GPU), the same step's logits compared.

The systems take turns, which goes first alternating, as in bench_inferd.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import uvloop
from bench_inferd import (
    BLOCK_SIZE,
    HfAnchor,
    Memd,
    Run,
    both,
    decode_rate,
    kv_batch,
    kv_generate,
    kv_scheduler,
    token_ids,
)
from step_profile import pyspy_profile, torch_profile
from tables import table

from inferd.checkpoint import read_config
from inferd.model import ATTENTION, PagedDecoder, build_batch
from inferd.tiny import make_tiny_model
from shared.logs import configure
from shared.ops import Free, Open

LLAMA_1B = {"arch": "llama", "hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192,
            "vocab": 128256, "dtype": "bfloat16", "rope_theta": 500000.0, "seed": 0}
PROFILED_TOKENS = 32          # tokens a request in a --profile window (py-spy's window: 4x as many)
TINY = {"arch": "llama", "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512, "dtype": "float32",
        "seed": 0}


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"concurrency": (1, 4), "prompt": (24, 40), "new_tokens": 8, "singles": 1, "history": 100,
                "message": 8, "turns": 1, "read_rows": (1, 4), "read_context": 100, "read_steps": 2}
    return {"concurrency": (1, 16, 64), "prompt": (56, 120), "new_tokens": 128, "singles": 3, "history": 1000,
            "message": 16, "turns": 3, "read_rows": (1, 16, 64), "read_context": 1000, "read_steps": 20}


async def served(anchor: HfAnchor, model_dir: Path, address: str, size: dict, rng: random.Random) -> dict:
    config = read_config(model_dir)
    vocab = config.vocab_size
    client, model, scheduler = await kv_scheduler(model_dir, address, "bench-gpu", max(size["concurrency"]),
                                                  size["attention"])
    task = asyncio.create_task(scheduler.run())
    lo, hi = size["prompt"]
    prompts = lambda n: [token_ids(rng, rng.randrange(lo, hi), vocab) for _ in range(n)]  # noqa: E731
    res: dict[str, Any] = {"attention": model.attention}
    try:
        # Warm: flex attention compiled for every batch size, as inferd serve does at attach; caches settle.
        await scheduler.forward_thread.run(model.compile_ahead, max(size["concurrency"]), tokens=0)
        for n in size["concurrency"]:
            warm = prompts(n)
            await both(0, lambda w=warm: kv_batch(scheduler, w, 4), lambda w=warm: anchor.generate(w, 4))
        # Each decode pass's time on the forward thread (the decoder and the read-back of its tokens): the
        # served step's time less this is what the scheduler, memd and the event loop add.
        # The same for the scheduler's memd Steps, and its passes run ahead of their step: taken, or thrown
        # away (and run again) because memd changed the batch's pages.
        passes: list[float] = []
        memd_steps: list[float] = []
        forward = scheduler.forward_thread
        forward.on_pass = lambda kind, seconds: passes.append(seconds) if kind == "decode" else None
        step = client.step

        async def timed_step(*ops: Any, **fields: Any) -> Any:
            started = time.perf_counter()
            try:
                return await step(*ops, **fields)
            finally:
                memd_steps.append(time.perf_counter() - started)
        client.step = timed_step
        for n in size["concurrency"]:
            kv_runs: list[list[Run]] = []
            hf_runs: list[list[Run]] = []
            passes.clear()
            memd_steps.clear()
            taken, dropped = forward.ahead_taken, forward.ahead_dropped
            for i in range(size["singles"] if n == 1 else 1):
                work = prompts(n)
                kv, hf = await both(i, lambda w=work: kv_batch(scheduler, w, size["new_tokens"]),
                                    lambda w=work: anchor.generate(w, size["new_tokens"]))
                kv_runs.append(kv)
                hf_runs.append(hf)
            res[f"kvpool_b{n}_decode"] = decode_rate(kv_runs)
            res[f"hf_b{n}_decode"] = decode_rate(hf_runs)
            res[f"kvpool_b{n}_pass_ms"] = statistics.median(passes) * 1e3
            res[f"kvpool_b{n}_passes"] = len(passes)
            res[f"kvpool_b{n}_memd_steps"] = len(memd_steps)
            res[f"kvpool_b{n}_memd_step_ms"] = statistics.median(memd_steps) * 1e3 if memd_steps else 0.0
            res[f"kvpool_b{n}_ahead_taken"] = forward.ahead_taken - taken
            res[f"kvpool_b{n}_ahead_dropped"] = forward.ahead_dropped - dropped
            # As it goes: a run cut short by its time limit still shows what it measured.
            print(f"b{n}: " + ", ".join(f"{k.removeprefix('kvpool_')} {v:.4g}" for k, v in res.items()
                                      if k.endswith(f"_b{n}_decode") or k.startswith(f"kvpool_b{n}_")),
                  file=sys.stderr, flush=True)
        forward.on_pass = None
        client.step = step
        if size.get("profile"):                             # after the figures: the profilers slow what they see
            out_dir = Path(size["profile"])
            for n in size["concurrency"]:
                work = prompts(n)
                await torch_profile(lambda w=work: kv_batch(scheduler, w, PROFILED_TOKENS), out_dir, f"b{n}")
            work = prompts(1)
            await pyspy_profile(lambda: kv_batch(scheduler, work, 4 * PROFILED_TOKENS), out_dir, "b1")
        reuse, recompute = [], []
        for i in range(size["turns"] + 1):                  # the first warms the chunk's pass: not counted
            session = f"bench-gpu-{os.getpid()}-{i}"
            first = await kv_generate(scheduler, token_ids(rng, size["history"], vocab), 8, session)
            message = token_ids(rng, size["message"], vocab)
            fresh = token_ids(rng, size["history"] + len(first.tokens) + size["message"], vocab)
            second = await kv_generate(scheduler, message, 1, session)
            hf = (await asyncio.to_thread(anchor.generate, [fresh], 1))[0]
            await scheduler.reset(session)
            if i:
                reuse.append(second.ttft_ms)
                recompute.append((hf.first - hf.submitted) * 1e3)
        res["kvpool_turn2_ttft_ms"] = statistics.median(reuse)
        res["hf_turn2_ttft_ms"] = statistics.median(recompute)
        print(f"turn-2 TTFT ms: kvpool {res['kvpool_turn2_ttft_ms']:.2f}, transformers {res['hf_turn2_ttft_ms']:.2f}",
              file=sys.stderr, flush=True)
        res["page_read"] = await page_read(client, model, model_dir, size, rng)
        if task.done():
            task.result()
    finally:
        task.cancel()
        await client.close()
    return res


async def page_read(client: Any, model: PagedDecoder, model_dir: Path, size: dict, rng: random.Random) -> dict:
    """Decode steps of the decoder alone on pages memd handed out: its attention against the gathered copy."""
    config = read_config(model_dir)
    gather = PagedDecoder(config, model.weights, model.kv, device=model.device, attention="gather")
    out: dict[str, Any] = {}
    for rows in size["read_rows"]:
        ctx = size["read_context"]
        opened = await client.step(*[Open(token_ids(rng, ctx, config.vocab_size), reserve=size["read_steps"] + 1)
                                     for _ in range(rows)])
        try:
            tables = [r.block_ids for r in opened]
            logits = {}
            for name, decoder in ((model.attention, model), ("gather", gather)):
                times = []
                for step in range(size["read_steps"] + 2):
                    batch = build_batch([([5], ctx + step % 2, t) for t in tables], BLOCK_SIZE, model.device)
                    started = time.perf_counter()
                    logits[name] = decoder.forward(batch)
                    logits[name].argmax(-1).tolist()
                    if step >= 2:                            # two warm-up passes: the first compiles
                        times.append(time.perf_counter() - started)
                out[f"{name}_{rows}_ms"] = statistics.median(times) * 1e3
            # The same step both ways (their last, on the same pages): the paged read must be the copy's attention.
            paged, copied = logits[model.attention], logits["gather"]
            out[f"max_logit_diff_{rows}"] = float((paged - copied).abs().max())
            out[f"argmax_agree_{rows}"] = float((paged.argmax(-1) == copied.argmax(-1)).float().mean())
            print(f"decoder alone, {rows} rows: " + ", ".join(f"{k} {v:.4g}" for k, v in out.items()
                                                             if k.endswith(f"_{rows}_ms") or k.endswith(f"_{rows}")),
                  file=sys.stderr, flush=True)
        finally:
            await client.step(*[Free(r.seq_id) for r in opened])
    return out


def report(res: dict) -> str:
    rows = [["", "kvpool", "transformers", "ratio"]]
    for n in res["concurrency"]:
        kv, hf = res[f"kvpool_b{n}_decode"], res[f"hf_b{n}_decode"]
        label = "1 request at a time" if n == 1 else f"{n} concurrent / one padded batch"
        rows.append([f"decode tok/s, {label}", f"{kv:,.0f}", f"{hf:,.0f}", f"{kv / hf:.2f}x"])
    kv, hf = res["kvpool_turn2_ttft_ms"], res["hf_turn2_ttft_ms"]
    rows.append(["turn-2 TTFT ms (kvpool: parked session; transformers: recompute)", f"{kv:.1f}", f"{hf:.1f}",
                 f"{hf / kv:.1f}x faster"])
    read = res["page_read"]
    lines = [f"GPU decode bench on {res['device_name']}: {res['shape']} checkpoint ({res['dtype']}), torch "
             f"{res['torch']}, decode attention {res['attention']}\n", table(rows), ""]
    for n in res["concurrency"]:
        step = n / res[f"kvpool_b{n}_decode"] * 1e3
        lines.append(f"served, {n} at a time: a step every {step:.2f} ms, of which its decode pass (the decoder and "
                     f"its tokens' read-back) {res[f'kvpool_b{n}_pass_ms']:.2f} ms; {res[f'kvpool_b{n}_passes']} "
                     f"passes, {res[f'kvpool_b{n}_memd_steps']} memd Steps (p50 "
                     f"{res[f'kvpool_b{n}_memd_step_ms']:.2f} ms), passes run ahead: "
                     f"{res[f'kvpool_b{n}_ahead_taken']} taken, {res[f'kvpool_b{n}_ahead_dropped']} thrown away")
    for rows_n in res["read_rows"]:
        paged, gathered = read[f"{res['attention']}_{rows_n}_ms"], read[f"gather_{rows_n}_ms"]
        label = f"{rows_n} row{'s' if rows_n > 1 else ''}"
        lines.append(f"decoder alone, {label} at {res['read_context']} tokens: {res['attention']} "
                     f"{paged:.2f} ms per step, gathered copy {gathered:.2f} ms ({gathered / paged:.2f}x); "
                     f"logits differ by at most {read[f'max_logit_diff_{rows_n}']:.3g}, argmax agrees on "
                     f"{read[f'argmax_agree_{rows_n}']:.0%} of rows")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0", help="where memd's pool and both models live (default: cuda:0)")
    p.add_argument("--quick", action="store_true", help="a tiny checkpoint and few requests: a smoke run")
    p.add_argument("--pool", default="16GiB", help="memd's pool (default: 16GiB)")
    p.add_argument("--attention", choices=ATTENTION, default="flex",
                   help="how inferd's decode rows read K/V (inferd serve --attention; default: flex)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="then profile a window of served decode at each concurrency into DIR (bench/step_profile.py)")
    args = p.parse_args()
    configure("info", "console")          # as the daemons log: a failure's traceback without its locals
    size = sizes(args.quick) | {"attention": args.attention, "profile": args.profile}
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    shape = TINY if args.quick else LLAMA_1B
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-decode-") as tmp:
        started = time.monotonic()
        model_dir = make_tiny_model(Path(tmp) / "model", **shape)
        print(f"checkpoint written in {time.monotonic() - started:.0f} s", file=sys.stderr)
        memd = Memd(Path(tmp), model_dir, device=args.device, pool=args.pool)
        anchor = HfAnchor(model_dir, torch.get_num_threads(), args.device)
        try:
            try:
                raw = uvloop.run(served(anchor, model_dir, memd.address, size, rng))
            except Exception as exc:
                if size["attention"] == "gather":
                    raise
                # One try on a lent GPU: a failure of the paged read still leaves the gathered copy's figures.
                traceback.print_exc()
                failed = f"{type(exc).__name__}: {exc}"
                print(f"--attention {size['attention']} failed ({failed}); measuring gather", file=sys.stderr)
                raw = uvloop.run(served(anchor, model_dir, memd.address, size | {"attention": "gather"}, rng))
                raw["attention_failed"] = failed
        finally:
            anchor.close()
            memd.kill()
    device = torch.device(args.device)
    res = {"device": args.device, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "shape": "tiny" if args.quick else "Llama-1B", "dtype": shape["dtype"], "torch": torch.__version__,
           "quick": args.quick, "concurrency": list(size["concurrency"]), "read_rows": list(size["read_rows"]),
           "read_context": size["read_context"], **raw}
    for n in size["concurrency"]:
        res[f"decode_b{n}_ratio_vs_hf"] = res[f"kvpool_b{n}_decode"] / res[f"hf_b{n}_decode"]
    res["turn2_ttft_speedup_vs_hf"] = res["hf_turn2_ttft_ms"] / res["kvpool_turn2_ttft_ms"]
    print(report(res))
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
