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
import os
import shutil
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
    device_key = "self_device_time_total" if torch.__version__ >= "2.4" else "self_cuda_time_total"
    tables = [f"=== {label}: by self CPU time\n", averages.table(sort_by="self_cpu_time_total", row_limit=45)]
    if torch.cuda.is_available():
        tables += [f"\n=== {label}: by self device time\n", averages.table(sort_by=device_key, row_limit=30)]
    (out_dir / f"profile_{label}.txt").write_text("".join(tables))
    trace = out_dir / f"profile_{label}.json"
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()


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
        proc.send_signal(2)                      # SIGINT: py-spy writes what it sampled and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            _, err = await asyncio.to_thread(proc.communicate, timeout=30)
            if proc.returncode not in (0, None) and not out.exists():
                print(f"py-spy failed: {err.strip()[-500:]}", file=sys.stderr)
