"""How fast memd swaps, and what a swap storm does to everyone else's Steps.

    .venv/bin/python bench/bench_swap.py [--seconds 5] [--json] [--device cpu|cuda:N]

1. Bandwidth: memd's swap-out and swap-in copies (memd.swap, the code memd
   runs) of a sequence's pages, against one plain `copy_` of the same bytes
   between the same two buffers; and the swap-in as memd runs it, each page
   checked against its checksum (memd.page_copier.run_effects), against the
   unchecked one: the cost of verification. The sequence's pages are scattered over the
   pool (every other page), as they are after a while of serving; contiguous
   pages are reported too. Measured twice, in fresh processes: with glibc's
   defaults, and with the GLIBC_TUNABLES that systemd/memd.service sets.
   memd's real path is the checked one: a swap-out hashes every page as it
   copies it (`copy_out_checked`), a swap-in checks every page it brings
   back. Its anchor is glibc's memmove of the same bytes, contiguous, split
   among as many threads as memd copies with (on a GPU: one DMA).
   With --device cuda:N the pool is memd's GPU pool (CudaMemory) and the
   swap tier its pinned host memory (PinnedSwap): device<->host DMA, once.
2. Step latency: a probe client sends small Steps (allocate one page, free
   one) to a real memd, quiet, and while another process swaps 16 sequences
   out and back in without pause (forced evictions and resumes): three
   rounds of each, taking turns. p50 and p99 of the probe's Steps, and the
   ratio. A third kind of round puts a busy worker beside the probe (the
   same process sending plain Steps as fast as memd answers): storm over
   busy is what swapping adds to a memd that is merely shared.
3. One long session: a 128k-token chat (8,192 pages of 16 tokens, small pages:
   the bookkeeping is measured, not the copy) swapped out and resumed, its
   pages still cached or, every other time, reused by other requests in
   between (each copied back). Each round trip, and the longest probe Step
   that overlapped it: how long memd's loop is held from every other worker.

Targets, with the settings memd.service ships: memd's real (checked) path
>= 80% of the memmove anchor at every page size and in both directions
(`swap_checked_min_ratio` in --json); the unchecked copies >= 90% of one
plain copy_ (`swap_min_ratio`: the copy alone, which memd never runs
without its hashes); Step p99 during swapping <= 1.5x quiet
(`storm_p99_ratio`; over busy: `storm_p99_ratio_vs_busy`).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import uvloop
from tables import table

from memd.memory import ShmMemory
from memd.page_copier import run_effects
from memd.page_effects import SwapIn
from memd.swap import COPY_THREADS, NON_TEMPORAL_TUNABLE, HostSwap
from shared.launch import spawn_ready
from shared.ops import Free, Open, Park, Resume
from shared.sizes import format_size, parse_size

BLOCK_SIZE = 16
STORM_SEQS, STORM_BLOCKS = 16, 64          # the storm's sequences, pages each
PAGE_FOR_STEPS = "64KiB"
LONG_TOKENS, PAGE_FOR_LONG = 128 * 1024, "1KiB"     # one long chat session, in small pages
START_TIMEOUT_S = 120.0                    # the storm's process: its imports and sequences, or a pause
SETTLE_S = 0.02                            # idle before each timed copy (best_times)


# ---- 1. bandwidth -------------------------------------------------------------

def best_times(fns: list, repeats: int) -> list[float]:
    """Best of `repeats` for each, after one warm-up, interleaved so that noise on a shared machine
    falls on all of them alike rather than on whichever ran during it.

    Each timed call starts after SETTLE_S idle: after a parallel copy_, torch's OpenMP threads spin
    a few ms waiting for more work, and a copy timed right then shared its cores with them (memd's
    swap-out of 64 KiB pages measured 17% slower straight after copy_ than 20 ms later). memd
    runs no torch; neither copy is timed with the other's leftovers.
    """
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            time.sleep(SETTLE_S)
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def bench_bandwidth(block_bytes: int, moved_bytes: int, repeats: int) -> dict:
    count = moved_bytes // block_bytes
    pool = ShmMemory(2 * count, block_bytes)
    swap = HostSwap(pool, count, block_bytes)
    swap.populated()                           # measured settled: populated (and locked where allowed)
    try:
        return measure(pool, swap, count, block_bytes, repeats)
    finally:
        swap.close()
        pool.close()


def bench_bandwidth_cuda(device: str, block_bytes: int, moved_bytes: int, repeats: int) -> dict:
    """The same copies with memd's GPU pool and pinned swap tier; the raw copy_ is one DMA, synchronized."""
    from memd.memory import CudaMemory
    from memd.pinned_swap import GATHER_BELOW_BYTES, PinnedSwap

    count = moved_bytes // block_bytes
    pool = CudaMemory(device, 2 * count, block_bytes)
    swap = PinnedSwap(pool, count, block_bytes)
    # What memd does not do at this page size (gather through a staging buffer, or not), for comparison.
    other = PinnedSwap(pool, count, block_bytes, gather=block_bytes >= GATHER_BELOW_BYTES)
    moved = count * block_bytes
    raw_pool, raw_swap = pool.pages.view(-1)[:moved], swap.slots.view(-1)[:moved]

    def raw(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(pool.index)

    scattered = [(2 * i, i) for i in range(count)]
    back = [(slot, block) for block, slot in scattered]
    checked = swap_ins(pool, back)
    halt = threading.Event()

    def checked_out() -> None:
        swap.copy_out_checked(scattered, halt)
        torch.cuda.synchronize(pool.index)
    (raw_out, swap_out, raw_in, swap_in, contiguous, swap_in_checked, other_out, other_in,
     swap_out_checked) = best_times([
        lambda: raw(raw_swap, raw_pool), lambda: swap.copy_out(scattered),
        lambda: raw(raw_pool, raw_swap), lambda: swap.copy_in(back),
        lambda: swap.copy_out([(i, i) for i in range(count)]), lambda: run_effects(pool, swap, checked),
        lambda: other.copy_out(scattered), lambda: other.copy_in(back), checked_out], repeats)
    # The round trip must be exact: what went out (pages 0, 2, 4, ..., each marked) comes back, each in its place.
    marks = (torch.arange(count, device=pool.pages.device) % 251 + 1).to(torch.uint8)[:, None]
    exact = True
    for tier in (swap, other):
        pool.pages[0::2][:count].copy_(marks.expand(-1, block_bytes))
        tier.copy_out(scattered)
        pool.pages.zero_()
        tier.copy_in(back)
        exact = exact and bool((pool.pages[0::2][:count] == marks).all())
    gib = moved / (1 << 30)
    return {"block_bytes": block_bytes, "moved_bytes": moved, "locked": swap.locked, "device": pool.device,
            "round_trip_exact": exact, "gathered": block_bytes < GATHER_BELOW_BYTES,
            "other_out_ratio": raw_out / other_out, "other_in_ratio": raw_in / other_in,
            "raw_out_gib_s": gib / raw_out, "raw_in_gib_s": gib / raw_in,
            "swap_out_gib_s": gib / swap_out, "swap_in_gib_s": gib / swap_in,
            "swap_out_contiguous_gib_s": gib / contiguous,
            "out_ratio": raw_out / swap_out, "in_ratio": raw_in / swap_in,
            "swap_in_checked_gib_s": gib / swap_in_checked, "check_cost": 1 - swap_in / swap_in_checked,
            "memmove_out_gib_s": gib / raw_out, "memmove_in_gib_s": gib / raw_in,     # one DMA is the anchor here
            "swap_out_checked_gib_s": gib / swap_out_checked,
            "checked_out_ratio": raw_out / swap_out_checked, "checked_in_ratio": raw_in / swap_in_checked}


def swap_ins(pool: object, back: list[tuple[int, int]]) -> list[SwapIn]:
    """memd's swap-in effects for (slot, block) pairs, each checked against the page's checksum as it is now."""
    sums = pool.checksums([block for _, block in back])                           # type: ignore[attr-defined]
    return [SwapIn([slot for slot, _ in back], [block for _, block in back], sums)]


def measure(pool: ShmMemory, swap: HostSwap, count: int, block_bytes: int, repeats: int) -> dict:
    moved = count * block_bytes
    raw_pool = torch.frombuffer(pool.view(), dtype=torch.uint8)[:moved]
    raw_swap = torch.frombuffer(swap.view(), dtype=torch.uint8)[:moved]
    scattered = [(2 * i, i) for i in range(count)]
    back = [(slot, block) for block, slot in scattered]
    checked = swap_ins(pool, back)
    halt = threading.Event()                  # memd's swap-outs can be called off: checked between chunks
    with ThreadPoolExecutor(COPY_THREADS) as threads:
        (raw_out, swap_out, raw_in, swap_in, contiguous, swap_in_checked, memmove_out, swap_out_checked,
         memmove_in) = best_times([
            lambda: raw_swap.copy_(raw_pool), lambda: swap.copy_out(scattered),
            lambda: raw_pool.copy_(raw_swap), lambda: swap.copy_in(back),
            lambda: swap.copy_out([(i, i) for i in range(count)]), lambda: run_effects(pool, swap, checked),
            lambda: memmove(threads, raw_swap.data_ptr(), raw_pool.data_ptr(), moved),
            lambda: swap.copy_out_checked(scattered, halt),
            lambda: memmove(threads, raw_pool.data_ptr(), raw_swap.data_ptr(), moved)], repeats)
    gib = moved / (1 << 30)
    return {"block_bytes": block_bytes, "moved_bytes": moved, "locked": swap.locked,
            "checked_round_trip_exact": checked_round_trip(
                pool, swap, scattered, torch.frombuffer(pool.view(), dtype=torch.uint8).view(2 * count, -1)),
            "raw_out_gib_s": gib / raw_out, "raw_in_gib_s": gib / raw_in,
            "swap_out_gib_s": gib / swap_out, "swap_in_gib_s": gib / swap_in,
            "swap_out_contiguous_gib_s": gib / contiguous,
            "out_ratio": raw_out / swap_out, "in_ratio": raw_in / swap_in,
            "swap_in_checked_gib_s": gib / swap_in_checked, "check_cost": 1 - swap_in / swap_in_checked,
            "memmove_out_gib_s": gib / memmove_out, "memmove_in_gib_s": gib / memmove_in,
            "swap_out_checked_gib_s": gib / swap_out_checked,
            "checked_out_ratio": memmove_out / swap_out_checked, "checked_in_ratio": memmove_in / swap_in_checked}


def checked_round_trip(pool: ShmMemory, swap: HostSwap, scattered: list[tuple[int, int]],
                       pages: torch.Tensor) -> bool:
    """Pages marked each its own way go out hashed and come back checked, each in its place, with the
    hashes a plain hash of the pages gives: what the timed calls did was a swap, not merely fast."""
    moved = [page for page, _ in scattered]
    pages[moved] = (torch.arange(len(moved)) % 251 + 1).to(torch.uint8)[:, None]
    pages[moved, 0] = torch.arange(len(moved)).to(torch.uint8)
    want = pool.checksums(moved)
    sums = swap.copy_out_checked(scattered, threading.Event())
    pages.zero_()
    wrong = run_effects(pool, swap, [SwapIn([slot for _, slot in scattered], moved, sums or [])])
    return sums == want and len(set(want)) == min(len(want), 256 * 251) and not wrong \
        and pool.checksums(moved) == want


def memmove(threads: ThreadPoolExecutor, dst: int, src: int, size: int) -> None:
    """The anchor of memd's real swap path: glibc's memmove of the same bytes in one contiguous run, split
    among as many threads as memd copies with, and nothing else: no pages to find, nothing hashed."""
    share = -(-size // COPY_THREADS)
    list(threads.map(lambda at: ctypes.memmove(dst + at, src + at, min(share, size - at)), range(0, size, share)))


# ---- 2. Step latency during a swap storm ---------------------------------------

async def probe(address: str, seconds: float, until: Callable[[], bool] | None = None,
                starts: list[float] | None = None) -> list[float]:
    """Small Steps back to back, for `seconds` or `until` it says so: each allocates one page and frees the
    previous one. `starts`: each Step's start (time.monotonic, the clock every process here reads) is added."""
    from shared.client import MemdClient

    client = await MemdClient.attach(address, name="probe", block_size=BLOCK_SIZE, map_memory=False)
    latencies, previous = [], None
    deadline = time.monotonic() + seconds
    try:
        while (now := time.monotonic()) < deadline and not (until and until()):
            ops = [Open([], reserve=BLOCK_SIZE)] + ([Free(previous)] if previous else [])
            opened = (await client.step(*ops))[0]
            latencies.append(time.monotonic() - now)
            if starts is not None:
                starts.append(now)
            previous = opened.seq_id
        if previous:
            await client.step(Free(previous))
    finally:
        await client.close()
    return latencies


async def storm(address: str) -> None:
    """Swap STORM_SEQS sequences out and back in, round and round, until killed.

    Its stdin steers it, a line at a time: "go" swaps; "busy" sends plain Steps instead, as fast as memd
    answers them (the probe's kind: a worker as busy as the storm, that never swaps); "pause" ends the
    turn it is in (no copy left in flight: an eviction's reply waits for its swap-out, a Resume's for its
    swap-in) and says "paused"."""
    from shared.client import MemdAdmin, MemdClient

    client = await MemdClient.attach(address, name="storm", block_size=BLOCK_SIZE, map_memory=False)
    tokens = STORM_BLOCKS * BLOCK_SIZE
    sessions = [f"storm-{i}" for i in range(STORM_SEQS)]
    for i, session in enumerate(sessions):
        opened, = await client.step(Open([(i << 20) + t for t in range(tokens)], session_id=session))
        await client.step(Park(opened.seq_id, commit_to=tokens))
    going, mode = asyncio.Event(), ["go"]
    going.set()
    # A daemon thread: should the storm fail, nothing waits for a read of stdin before the process exits.
    threading.Thread(target=_storm_commands, args=(asyncio.get_running_loop(), going, mode), daemon=True).start()
    print("storming", flush=True)
    previous = None
    async with MemdAdmin(address) as admin:
        while True:
            for session in sessions:
                if not going.is_set():
                    print("paused", flush=True)
                    await going.wait()
                if mode[0] == "busy":               # as many Steps as a swap turn makes, none of them swapping
                    for _ in range(3):
                        ops = [Open([], reserve=BLOCK_SIZE)] + ([Free(previous)] if previous else [])
                        previous = (await client.step(*ops))[0].seq_id
                    continue
                await admin.evict(session_id=session, mode="swap")
                resumed, = await client.step(Resume(session_id=session))
                await client.step(Park(resumed.seq_id))


def _storm_commands(loop: asyncio.AbstractEventLoop, going: asyncio.Event, mode: list[str]) -> None:
    for line in sys.stdin:
        command = line.strip()
        if command in ("go", "busy"):
            mode[0] = command
        loop.call_soon_threadsafe(going.clear if command == "pause" else going.set)


def _storm_says(storm: subprocess.Popen, expected: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait for the storm's process to print `expected`; RuntimeError if it dies or says nothing in time."""
    assert storm.stdout is not None
    ready, _, _ = select.select([storm.stdout], [], [], timeout_s)
    line = storm.stdout.readline().strip() if ready else None
    if line != expected:
        raise RuntimeError(f"the storm process did not say {expected!r} "
                           f"({'exited ' + str(storm.poll()) if storm.poll() is not None else 'no answer'})")


def percentiles(latencies: list[float]) -> dict:
    qs = statistics.quantiles(latencies, n=100)
    return {"steps": len(latencies), "p50_ms": qs[49] * 1e3, "p99_ms": qs[98] * 1e3}


MODES = ("quiet", "busy", "storm")           # the probe's neighbour: none, a busy worker, the swap storm


def bench_steps(seconds: float, device: str = "cpu", rounds: int = 3) -> dict:
    """The probe's Steps on a quiet memd, next to a busy worker and during the storm, taking turns `rounds`
    times (the order rotates), `seconds` each in all: what else the machine does meanwhile weighs on all
    alike. The storm's process lives throughout and plays the busy worker too; it is paused (its last turn
    finished) for the quiet rounds and between the others.

    The busy worker sends the probe's kind of Step as fast as memd answers them: beside the storm-over-quiet
    ratio (the target), the storm over busy says what swapping adds to a memd that is merely shared."""
    page = parse_size(PAGE_FOR_STEPS)
    pool = 4 * STORM_SEQS * STORM_BLOCKS * page                  # room for the storm and the probe
    with tempfile.TemporaryDirectory(prefix="swap-bench-") as tmp:
        address = f"unix:{tmp}/memd.sock"
        os.environ["GLIBC_TUNABLES"] = NON_TEMPORAL_TUNABLE          # as systemd/memd.service starts memd
        memd = spawn_ready(["memd", "--device", device, "--pool-bytes", str(pool), "--block-bytes", str(page),
                            "--swap-ratio", "0.5", "--free-watermark", "0", "--listen", address,
                            "--log-level", "warning"], Path(tmp))
        storm_proc = None
        runs: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
        try:
            storm_proc = subprocess.Popen([sys.executable, __file__, "--storm", address], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)
            assert storm_proc.stdin is not None
            _storm_says(storm_proc, "storming")                        # its sequences are in place
            now = "storm"
            for r in range(rounds):
                for mode in MODES[r % 3:] + MODES[:r % 3]:
                    if mode != now:                   # a change: the last mode paused (waited for), the next told
                        if now != "quiet":
                            storm_proc.stdin.write("pause\n")
                            storm_proc.stdin.flush()
                            _storm_says(storm_proc, "paused")
                        if mode != "quiet":
                            storm_proc.stdin.write("go\n" if mode == "storm" else "busy\n")
                            storm_proc.stdin.flush()
                        now = mode
                    # On uvloop, as inferd runs its client of memd.
                    runs[mode].append(uvloop.run(probe(address, seconds / rounds)))
                    if storm_proc.poll() is not None:                  # a storm that died made a quiet round
                        raise RuntimeError(f"the storm process exited ({storm_proc.returncode})")
            swaps = asyncio.run(swap_counters(address))
        finally:
            if storm_proc is not None:
                storm_proc.kill()
                storm_proc.wait()
            memd.terminate()
            memd.wait()
    q, busy, s = (percentiles([x for run in runs[mode] for x in run]) for mode in MODES)
    return {"page_bytes": page, "quiet": q, "busy": busy, "storm": s, "storm_swaps": swaps, "rounds": rounds,
            "p50_ratio": s["p50_ms"] / q["p50_ms"], "p99_ratio": s["p99_ms"] / q["p99_ms"],
            "busy_p99_ratio": busy["p99_ms"] / q["p99_ms"], "p99_ratio_vs_busy": s["p99_ms"] / busy["p99_ms"],
            "rounds_p99_ratio": [percentiles(b)["p99_ms"] / percentiles(a)["p99_ms"]
                                 for a, b in zip(runs["quiet"], runs["storm"], strict=True)]}


# ---- 3. one long session ---------------------------------------------------------

async def long_session(address: str, cycles: int) -> None:
    """Its own process: a LONG_TOKENS session, parked; once told "go" on stdin, swapped out and resumed
    `cycles` times, its pages reused by another request in between every other time. Prints each phase
    as [what, start, end] (time.monotonic) in one JSON line."""
    from shared.client import MemdAdmin, MemdClient

    client = await MemdClient.attach(address, name="long", block_size=BLOCK_SIZE, map_memory=False)
    opened, = await client.step(Open(list(range(LONG_TOKENS)), session_id="long"))
    await client.step(Park(opened.seq_id, commit_to=LONG_TOKENS))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    phases = []
    async with MemdAdmin(address) as admin:
        for cycle in range(cycles):
            start = time.monotonic()
            await admin.evict(session_id="long", mode="swap")
            phases.append(["swap-out", start, time.monotonic()])
            reused = cycle % 2 == 1
            if reused:             # another request takes the free pages (the probe's aside): the cached copies go
                free = (await admin.stats()).free_blocks
                other, = await client.step(Open([1 << 30] * (BLOCK_SIZE * (free - 4))))
                await client.step(Free(other.seq_id))
            start = time.monotonic()
            resumed, = await client.step(Resume(session_id="long"))
            phases.append(["resume, pages reused" if reused else "resume, pages cached", start, time.monotonic()])
            await client.step(Park(resumed.seq_id))
    print(json.dumps(phases), flush=True)
    await client.close()


def bench_long_session(cycles: int, quiet_s: float, device: str = "cpu") -> dict:
    """The round trips of `long_session`'s phases, and the longest probe Step that overlapped each."""
    page, pages = parse_size(PAGE_FOR_LONG), LONG_TOKENS // BLOCK_SIZE
    with tempfile.TemporaryDirectory(prefix="swap-bench-") as tmp:
        address = f"unix:{tmp}/memd.sock"
        memd = spawn_ready(["memd", "--device", device, "--pool-bytes", str(3 * pages * page), "--block-bytes",
                            str(page), "--swap-ratio", "0.5", "--free-watermark", "0", "--listen", address,
                            "--log-level", "warning"], Path(tmp))
        session = None
        try:
            session = subprocess.Popen([sys.executable, __file__, "--long-session", address, "--cycles",
                                        str(cycles)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert session.stdin is not None and session.stdout is not None
            _storm_says(session, "ready")
            quiet = uvloop.run(probe(address, quiet_s))
            session.stdin.write("go\n")
            session.stdin.flush()
            starts: list[float] = []
            during = uvloop.run(probe(address, float("inf"), until=lambda: session.poll() is not None,
                                      starts=starts))
            if session.wait() != 0:
                raise RuntimeError(f"the long session's process exited ({session.returncode})")
            phases = json.loads(session.stdout.read().splitlines()[-1])
        finally:
            if session is not None and session.poll() is None:
                session.kill()
                session.wait()
            memd.terminate()
            memd.wait()
    out: dict = {"tokens": LONG_TOKENS, "pages": pages, "page_bytes": page, "cycles": cycles,
                 "quiet": {"steps": len(quiet), "p50_ms": statistics.median(quiet) * 1e3,
                           "max_ms": max(quiet) * 1e3}, "phases": {}}
    for what in dict.fromkeys(name for name, _, _ in phases):
        trips = [(start, end) for name, start, end in phases if name == what]
        longest = [max((lat for s, lat in zip(starts, during, strict=True) if s < end and s + lat > start),
                       default=0.0) for start, end in trips]
        out["phases"][what] = {"round_trip_ms": statistics.median(end - start for start, end in trips) * 1e3,
                               "probe_max_ms": statistics.median(longest) * 1e3, "count": len(trips)}
    out["probe_max_ms"] = max(p["probe_max_ms"] for p in out["phases"].values())
    return out


async def swap_counters(address: str) -> dict:
    from shared.client import MemdAdmin

    async with MemdAdmin(address) as admin:
        c = (await admin.stats()).counters
    return {"swap_outs": c["swap_outs"], "swap_ins": c["swap_ins"], "swap_out_blocks": c["swap_out_blocks"]}


# ---- report ---------------------------------------------------------------------

def bandwidth_runs(moved: int, repeats: int, device: str = "cpu") -> dict[str, list[dict]]:
    """The bandwidth table in fresh processes: glibc's default, and memd.service's GLIBC_TUNABLES."""
    if device != "cpu":                      # DMA between the GPU and pinned memory: glibc plays no part
        out = subprocess.run([sys.executable, __file__, "--bandwidth-only", "--moved", str(moved), "--repeats",
                              str(repeats), "--device", device], capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"the {device} bandwidth run failed:\n{out.stderr[-4000:]}")
        return {f"pinned host <-> {device}": json.loads(out.stdout.splitlines()[-1])}
    runs = {}
    for label, tunables in (("glibc default", ""), ("memd.service tunable", NON_TEMPORAL_TUNABLE)):
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        out = subprocess.run([sys.executable, __file__, "--bandwidth-only", "--moved", str(moved), "--repeats",
                              str(repeats)], env=env, capture_output=True, text=True, check=True).stdout
        runs[label] = json.loads(out.splitlines()[-1])
    return runs


def report(res: dict) -> str:
    first = "glibc" if res.get("device", "cpu") == "cpu" else "copies"
    rows = [[first, "page", "raw copy_ out", "memd swap-out", "ratio", "raw copy_ in", "memd swap-in", "ratio",
             "swap-in, checked", "check cost", "swap-out (contiguous)"]]
    for label, b in ((label, b) for label, table_rows in res["bandwidth"].items() for b in table_rows):
        rows.append([label, format_size(b["block_bytes"]), f"{b['raw_out_gib_s']:.2f} GiB/s",
                     f"{b['swap_out_gib_s']:.2f} GiB/s", f"{b['out_ratio']:.0%}", f"{b['raw_in_gib_s']:.2f} GiB/s",
                     f"{b['swap_in_gib_s']:.2f} GiB/s", f"{b['in_ratio']:.0%}",
                     f"{b['swap_in_checked_gib_s']:.2f} GiB/s", f"{b['check_cost']:.0%}",
                     f"{b['swap_out_contiguous_gib_s']:.2f} GiB/s"])
    real = [[first, "page", "memmove out", "memd swap-out, hashed", "ratio", "memmove in", "memd swap-in, checked",
             "ratio"]]
    for label, b in ((label, b) for label, table_rows in res["bandwidth"].items() for b in table_rows):
        real.append([label, format_size(b["block_bytes"]), f"{b['memmove_out_gib_s']:.2f} GiB/s",
                     f"{b['swap_out_checked_gib_s']:.2f} GiB/s", f"{b['checked_out_ratio']:.0%}",
                     f"{b['memmove_in_gib_s']:.2f} GiB/s", f"{b['swap_in_checked_gib_s']:.2f} GiB/s",
                     f"{b['checked_in_ratio']:.0%}"])
    lines = [table(rows), "memd's real path (every page hashed out, checked in) against a memmove of the same bytes "
             "in as many threads:", table(real)]
    other = [b for table_rows in res["bandwidth"].values() for b in table_rows if "other_out_ratio" in b]
    if other:
        ways = [f"{format_size(b['block_bytes'])} {'one DMA a run' if b['gathered'] else 'gathered'}: out "
                f"{b['other_out_ratio']:.0%}, in {b['other_in_ratio']:.0%}" for b in other]
        lines.append("the other way on this GPU (pages gathered on it, or not: whichever memd does not do at that "
                     "size): " + "; ".join(ways))
    s = res["steps"]
    steps = [["probe Steps", "count", "p50", "p99"],
             ["quiet memd", str(s["quiet"]["steps"]), f"{s['quiet']['p50_ms']:.3f} ms",
              f"{s['quiet']['p99_ms']:.3f} ms"],
             ["next to a busy worker (no swaps)", str(s["busy"]["steps"]), f"{s['busy']['p50_ms']:.3f} ms",
              f"{s['busy']['p99_ms']:.3f} ms"],
             ["during a swap storm", str(s["storm"]["steps"]), f"{s['storm']['p50_ms']:.3f} ms",
              f"{s['storm']['p99_ms']:.3f} ms"],
             ["storm / quiet", "", f"{s['p50_ratio']:.2f}x", f"{s['p99_ratio']:.2f}x"],
             ["busy / quiet, storm / busy", "", "",
              f"{s['busy_p99_ratio']:.2f}x, {s['p99_ratio_vs_busy']:.2f}x"]]
    if len(s["rounds_p99_ratio"]) > 1:
        steps.append(["p99 ratio by round", "", "", ", ".join(f"{x:.2f}x" for x in s["rounds_p99_ratio"])])
    long = res["long_session"]
    phases = [[f"one session of {long['tokens']:,} tokens, {long['pages']:,} pages", "count", "round trip (median)",
               "longest probe Step during it (median)"]]
    phases += [[what, str(p["count"]), f"{p['round_trip_ms']:.1f} ms", f"{p['probe_max_ms']:.1f} ms"]
               for what, p in long["phases"].items()]
    phases.append(["probe Steps, quiet memd", str(long["quiet"]["steps"]), "",
                   f"p50 {long['quiet']['p50_ms']:.2f} ms, max {long['quiet']['max_ms']:.2f} ms"])
    every = [b for table_rows in res["bandwidth"].values() for b in table_rows]
    moved = format_size(every[0]["moved_bytes"])
    locked = all(b["locked"] for b in every)
    return (f"swap bandwidth: {moved} per copy, pages scattered over the pool, best of {res['repeats']}, interleaved "
            f"(swap tier {'locked' if locked else 'NOT locked: raise RLIMIT_MEMLOCK'}); {res['cores']} cores\n"
            + "\n".join(lines) + "\n\n"
            f"Step latency, {res['seconds']:g} s each in {s['rounds']} turns, pages of "
            f"{format_size(s['page_bytes'])}; the storm swapped "
            f"{s['storm_swaps']['swap_outs']} sequences out and {s['storm_swaps']['swap_ins']} in "
            f"({format_size(s['storm_swaps']['swap_out_blocks'] * s['page_bytes'])} out)\n{table(steps)}\n\n"
            f"A long session swapped out and back ({format_size(long['page_bytes'])} pages, its pages reused by "
            f"another request before every other resume): what it holds every other worker's Steps\n{table(phases)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="length of each latency run (default: 5)")
    p.add_argument("--moved", default="256MiB", help="bytes per bandwidth copy (default: 256MiB)")
    p.add_argument("--repeats", type=int, default=5, help="bandwidth repeats, best kept (default: 5)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    p.add_argument("--device", default="cpu",
                   help="memd's pool: cpu (shared memory, host swap; the default) or cuda:N (GPU pool, pinned swap)")
    p.add_argument("--storm", metavar="ADDRESS", help=argparse.SUPPRESS)     # the storm's own process
    p.add_argument("--bandwidth-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--long-session", metavar="ADDRESS", help=argparse.SUPPRESS)   # the long session's process
    p.add_argument("--cycles", type=int, default=10, help="long-session swap-outs and resumes (default: 10)")
    p.add_argument("--quick", action="store_true", help="a short smoke run: checks the bench still runs")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.moved, args.repeats, args.cycles = 0.5, "16MiB", 1, 2
    if args.storm:
        uvloop.run(storm(args.storm))
        return
    if args.long_session:
        uvloop.run(long_session(args.long_session, args.cycles))
        return
    if args.bandwidth_only and args.device != "cpu":
        print(json.dumps([bench_bandwidth_cuda(args.device, parse_size(page), parse_size(args.moved), args.repeats)
                          for page in ("64KiB", "1MiB", "8MiB")]))
        return
    if args.bandwidth_only:
        print(json.dumps([bench_bandwidth(parse_size(page), parse_size(args.moved), args.repeats)
                          for page in ("64KiB", "1MiB", "8MiB")]))
        return
    res: dict = {"cores": os.cpu_count(), "seconds": args.seconds, "repeats": args.repeats}
    if args.device != "cpu":
        res["device"] = args.device
    res["bandwidth"] = bandwidth_runs(parse_size(args.moved), args.repeats, args.device)
    res["steps"] = bench_steps(args.seconds, args.device, 1 if args.quick else 3)
    res["long_session"] = bench_long_session(args.cycles, args.seconds / 5, args.device)
    # The figures the targets name: the lowest ratio with the settings memd.service ships (on a GPU, the only
    # run), over page sizes and directions; and Step p99 during the storm over quiet.
    shipped = res["bandwidth"].get("memd.service tunable") or next(iter(res["bandwidth"].values()))
    res["swap_min_ratio"] = min(min(b["out_ratio"], b["in_ratio"]) for b in shipped)
    res["swap_checked_min_ratio"] = min(min(b["checked_out_ratio"], b["checked_in_ratio"]) for b in shipped)
    res["storm_p99_ratio"] = res["steps"]["p99_ratio"]
    res["storm_p99_ratio_vs_busy"] = res["steps"]["p99_ratio_vs_busy"]
    res["long_session_probe_max_ms"] = res["long_session"]["probe_max_ms"]
    print(report(res))
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
