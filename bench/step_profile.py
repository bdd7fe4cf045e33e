"""Where a served step's time goes: torch's profiler and py-spy over a window of served decode.

bench_gpu_decode's `--profile DIR` runs each concurrency once more, after the
measured runs (so the figures are not slowed by the profilers), under
torch.profiler on every thread (the forward thread's ops and kernels, the
GPU's kernels and copies, and the syncs between them), and the one-request
window again under py-spy (every thread's Python stacks, idle included: the
event loop's share of a step, and what the forward thread waits on).

DIR gets, per window: `profile_b{n}.txt` (ops by self CPU and by self device
time), `profile_b{n}.json.gz` (the trace, for chrome://tracing or Perfetto) and
`pyspy_b1.txt` (py-spy's collapsed stacks: one line a stack, then its samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch


def _profiler() -> Any:
    """torch.profiler over every thread where this torch can (2.6 on); else over the thread that starts it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        print("this torch's profiler records only the thread that starts it", file=sys.stderr)
        return profile(activities=activities)
    return profile(activities=activities, experimental_config=config)


async def torch_profile(window: Callable[[], Awaitable[Any]], out_dir: Path, label: str) -> None:
    """`window()` under torch.profiler: its op tables and its trace, into `out_dir`."""
    with _profiler() as prof:
        await window()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    averages = prof.key_averages()
    tables = [f"=== {label}: by self CPU time\n", averages.table(sort_by="self_cpu_time_total", row_limit=45)]
    if torch.cuda.is_available():
        tables += [f"\n=== {label}: by self device time\n",
                   averages.table(sort_by="self_device_time_total", row_limit=30)]
    trace = out_dir / f"profile_{label}.json"
    prof.export_chrome_trace(str(trace))
    summary = timeline(json.loads(trace.read_text())["traceEvents"])
    print(f"=== {label}: the profiled window's timeline\n{summary}", file=sys.stderr, flush=True)
    (out_dir / f"profile_{label}.txt").write_text(f"=== {label}: timeline\n{summary}\n\n" + "".join(tables))
    with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()


def _busy(spans: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Time covered by (start, end) spans, nested or overlapping ones once; and the gaps between them."""
    covered, gaps, end = 0.0, [], None
    for start, stop in sorted(spans):
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            covered += stop - start
            end = stop
        elif stop > end:
            covered += stop - end
            end = stop
    return covered, gaps


def timeline(events: list[dict]) -> str:
    """Per thread, how much of the window its ops cover and its longest idle gaps; on a GPU, how busy the
    device was, and the CUDA runtime calls that made the host wait (syncs, copies) or launched work."""
    spans = [(e["ts"], e["ts"] + e.get("dur", 0.0), e) for e in events if e.get("ph") == "X"]
    if not spans:
        return "no events"
    first, last = min(s for s, _, _ in spans), max(t for _, t, _ in spans)
    window = last - first
    lines = [f"window {window / 1e3:.1f} ms"]
    threads: dict[object, list[tuple[float, float]]] = {}
    device: list[tuple[float, float]] = []
    runtime: dict[str, list[float]] = {}
    for start, stop, e in spans:
        cat = e.get("cat")
        if cat == "cpu_op":
            threads.setdefault(e["tid"], []).append((start, stop))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            device.append((start, stop))
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            runtime.setdefault(e["name"], []).append(stop - start)
    for tid, own in sorted(threads.items(), key=lambda item: -len(item[1])):
        covered, gaps = _busy(own)
        gaps.sort(reverse=True)
        lines.append(f"thread {tid}: ops cover {covered / 1e3:.1f} ms ({covered / window:.0%}), {len(own)} ops; "
                     f"gaps over 1 ms: {sum(g > 1e3 for g in gaps)}, longest "
                     + ", ".join(f"{g / 1e3:.2f}" for g in gaps[:5]) + " ms")
    if device:
        covered, gaps = _busy(device)
        long_gaps = [g for g in gaps if g > 1e3]
        lines.append(f"device: busy {covered / 1e3:.1f} ms ({covered / window:.0%}), {len(device)} kernels and "
                     f"copies; idle gaps over 1 ms: {len(long_gaps)} ({sum(long_gaps) / 1e3:.1f} ms)")
    for name, times in sorted(runtime.items(), key=lambda item: -sum(item[1]))[:8]:
        lines.append(f"  {name}: {len(times)} calls, {sum(times) / 1e3:.2f} ms in all, "
                     f"longest {max(times) / 1e3:.2f} ms")
    return "\n".join(lines)


async def pyspy_profile(window: Callable[[], Awaitable[Any]], out_dir: Path, label: str) -> None:
    """`window()` under py-spy (every thread, idle too, without pausing the process), where py-spy is installed."""
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        print("py-spy is not on PATH: no Python stacks", file=sys.stderr)
        return
    out = out_dir / f"pyspy_{label}.txt"
    proc = subprocess.Popen([pyspy, "record", "--pid", str(os.getpid()), "--format", "raw", "--threads", "--idle",
                             "--nonblocking", "--rate", "200", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        await asyncio.sleep(1.0)                 # py-spy attaches (no readiness signal to wait on)
        await window()
    finally:
        proc.send_signal(signal.SIGINT)          # py-spy writes what it sampled and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            _, err = await asyncio.to_thread(proc.communicate, timeout=30)
            if proc.returncode not in (0, None) and not out.exists():
                print(f"py-spy failed: {err.strip()[-500:]}", file=sys.stderr)
    if out.exists():
        print(f"=== {label}: py-spy, the likeliest places per thread\n{stacks(out.read_text())}", file=sys.stderr,
              flush=True)


def stacks(collapsed: str, per_thread: int = 6) -> str:
    """py-spy's collapsed stacks, summed by thread and by their innermost two frames: where each thread was."""
    threads: dict[str, dict[str, int]] = {}
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        place = " < ".join(frame.split(" (")[0] + (f" ({frame.rsplit('/', 1)[-1]}" if "/" in frame else "")
                           for frame in reversed(frames[-2:]))
        where = threads.setdefault(frames[0], {})
        where[place] = where.get(place, 0) + int(count)
    lines = []
    for thread, where in sorted(threads.items(), key=lambda item: -sum(item[1].values())):
        total = sum(where.values())
        lines.append(f"{thread}: {total} samples")
        for place, n in sorted(where.items(), key=lambda item: -item[1])[:per_thread]:
            lines.append(f"  {n / total:4.0%} {place}")
    return "\n".join(lines)
