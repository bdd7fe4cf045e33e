"""What verified reuse costs a worker: decode and a chat's turn-2 TTFT with page checksums on and off.

    .venv/bin/python bench/bench_verify.py [--quick] [--json] [--threads 2] [--rounds 6]

The `Scheduler` runs here over a real memd subprocess (CPU shared memory),
on the tiny Llama of bench_inferd.py. The two arms differ in one thing:
whether the worker sums the pages it commits (`Scheduler.page_sums.enabled`,
switched off here only; kvpool always sums). They alternate round by round
(on, off, off, on, ...) so that whatever else the machine does weighs on both.
Each round, each arm:
- decode: 16 requests in flight, greedy, ignore_eos; generated tokens after
  each request's first over the batch's first-token-to-last-token window;
- turn 2: a session's first turn on a long history, then a short message:
  its time to first token (the history is memd's, parked; the checksums of
  its pages went with the Park that ended turn 1, and the new message's
  pages are summed as they fill).
Also, with checksums on, the worker's own time in `PageSums.commit` as a share
of the decode window: the direct cost, free of run-to-run noise.

The swap tier's side (each swapped-in page checked after its copy) is in
bench_swap.py ("swap-in, checked").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_inferd import (
    CONCURRENT,
    MODEL,
    Run,
    decode_rate,
    kv_batch,
    kv_generate,
    kv_scheduler,
    token_ids,
    with_memd,
)
from tables import table

from inferd.scheduler import Scheduler

TARGET_DECODE = 0.02       # the bound on what checksums may cost decode


class CommitClock:
    """Seconds spent in `PageSums.commit` (wrapped on the scheduler's instance, here only)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.seconds = 0.0
        sums = scheduler.page_sums
        original = sums.commit

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        sums.commit = timed                                         # type: ignore[method-assign]


async def arm(scheduler: Scheduler, clock: CommitClock, on: bool, rng: random.Random, sizes: dict,
              round_no: int) -> dict:
    scheduler.page_sums.enabled = on
    vocab = MODEL["vocab"]
    prompts = [token_ids(rng, n, vocab) for n in range(56, 56 + CONCURRENT)]
    before = clock.seconds
    runs: list[Run] = await kv_batch(scheduler, prompts, sizes["new_tokens"])
    window = max(r.last for r in runs) - min(r.first for r in runs)
    summing = clock.seconds - before
    session = f"{'on' if on else 'off'}-{round_no}"
    await kv_generate(scheduler, token_ids(rng, sizes["history"], vocab), 8, session)
    second = await kv_generate(scheduler, token_ids(rng, 16, vocab), 1, session)
    return {"decode_tok_s": decode_rate([runs]), "ttft_ms": second.ttft_ms, "sum_share": summing / window}


async def bench(model_dir: Path, address: str, sizes: dict, rounds: int) -> dict:
    client, _, scheduler = await kv_scheduler(model_dir, address, "bench-verify")
    clock = CommitClock(scheduler)
    task = asyncio.create_task(scheduler.run())
    rng = random.Random(0)
    try:
        await arm(scheduler, clock, True, rng, {**sizes, "new_tokens": 8}, -1)          # warm-up
        results: dict[str, list[dict]] = {"on": [], "off": []}
        for i in range(rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            for on in order:
                results["on" if on else "off"].append(await arm(scheduler, clock, on, rng, sizes, i))
    finally:
        task.cancel()
        await client.close()
    return {"runs": results}


def summarise(raw: dict) -> dict:
    med = {arm: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for arm, runs in raw["runs"].items()}
    return {"on": med["on"], "off": med["off"],
            "decode_ratio": med["on"]["decode_tok_s"] / med["off"]["decode_tok_s"],
            "ttft_ratio": med["on"]["ttft_ms"] / med["off"]["ttft_ms"],
            "decode_range": {arm: [min(r["decode_tok_s"] for r in runs), max(r["decode_tok_s"] for r in runs)]
                             for arm, runs in raw["runs"].items()},
            "rounds": len(raw["runs"]["on"])}


def report(res: dict) -> str:
    on, off = res["on"], res["off"]
    rows = [["checksums", "decode, 16 in flight", "turn-2 TTFT", "worker time summing pages"],
            ["on", f"{on['decode_tok_s']:.0f} tok/s", f"{on['ttft_ms']:.1f} ms", f"{on['sum_share']:.2%} of decode"],
            ["off", f"{off['decode_tok_s']:.0f} tok/s", f"{off['ttft_ms']:.1f} ms", ""],
            ["on / off", f"{res['decode_ratio']:.3f}x", f"{res['ttft_ratio']:.3f}x", ""]]
    verdict = "meets" if on["sum_share"] <= TARGET_DECODE else "MISSES"
    return (f"verified reuse, worker side: medians of {res['rounds']} alternating rounds, {res['threads']} torch "
            f"threads, {res['cores']} cores\n{table(rows)}\n"
            f"summing pages takes {on['sum_share']:.2%} of decode time: {verdict} the <= {TARGET_DECODE:.0%} target "
            f"(the tok/s ratio is the same cost seen through run-to-run noise)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run: checks the bench still runs")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument("--rounds", type=int, default=6, help="rounds of each arm (default: 6)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sizes = {"new_tokens": 16, "history": 128} if args.quick else {"new_tokens": 96, "history": 1000}
    rounds = 1 if args.quick else args.rounds
    raw = with_memd("verify-bench-", lambda model_dir, address: bench(model_dir, address, sizes, rounds))
    res = {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "quick": args.quick, **summarise(raw)}
    print(report(res))
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
