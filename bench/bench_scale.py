"""What memd costs as it holds more conversations: Steps, memory, operator calls, KV events, a restart.

    .venv/bin/python bench/bench_scale.py [--sizes 10000,100000,300000] [--pages 1048576] [--json] [--quick]

One memd per size, as a host runs it: CPU shared memory of `--pages` pages of
4 KiB, a state directory on /dev/shm (the journal, the pool and swap files),
the default swap tier, 8 tenants with guaranteed and max pages (memd
--quotas), KV events published, metrics served. A filler worker parks
`size` sessions of 3 pages each (16-token blocks) across the tenants, one in
25 of the guaranteed tenants' with a retention promise. Then, per size:

- a small Step (open a 1-page session and park it; free it) while a ballast
  sequence leaves a few pages free: its p50 and p99, over a worker's real
  gRPC Step stream;
- an evicting Step: with the pool full (a second ballast), each new 3-page
  session must evict the coldest parked one (swapped out: the Step waits
  for its copy); p50 and p99, and memd's own account that each did evict;
- memd's memory (its anonymous pages: the pool and swap files are shared
  memory, not counted) per parked session, and per pool page (a memd of
  `--pages` against one of 1,024 pages, both empty);
- `Stats`, `memctl snapshot` and `memctl tenants`, each as an operator runs
  it, while the Step probe runs: their time;
- KV-event lag: from a Park's send (the Step's own time included) to the
  BlockStored batch that announces its blocks arriving at a subscriber;
- memd's loop holds meanwhile (kvpool_memd_loop_lag_seconds): how many passed
  50 ms, and the bucket bound all stayed under (the filler's own 512-session
  Steps and the ballast's million-page ones are not counted);
- kill -9, then memd started again on the same state directory: to READY=1,
  and to the first Step served (a worker attaches and resumes a parked
  session); every parked session back; memd's memory then, against before.

Targets (300k sessions against 10k; 1M pages): small and evicting Step p99
within 1.5x, recovery to the first Step served within 5 s at 100k sessions,
memd's memory at most 2 KiB per parked session plus 64 B per page, no loop
hold over 50 ms. Read the growth across sizes on a busy host, not the level.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import zmq
from scraped_metrics import scraped
from tables import table

from shared.client import MemdAdmin, MemdClient
from shared.launch import free_port, free_port_pair, spawn_ready
from shared.ops import Free, Open, Park, Resume

BLOCK_SIZE = 16                  # tokens per block: 3-page sessions of 48 tokens
PAGE = "4KiB"
SESSION_PAGES = 3
TENANTS = 8
GUARANTEED_TENANTS = 4           # t0..t3 have guaranteed pages, and one session in RETAIN_EVERY of theirs a promise
RETAIN_EVERY = 25
BATCH = 512                      # Opens per filler Step
START_TIMEOUT_S = 600.0


@dataclass(slots=True)
class Host:
    """One memd's start-up flags and files, kept for its restart."""

    work: Path
    pages: int
    state: Path
    metrics_port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port_pair)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"unix:{self.work / 'memd.sock'}"

    def argv(self) -> list[str]:
        return ["memd", "--device", "cpu", "--pool-bytes", str(self.pages * 4096), "--block-bytes", PAGE,
                "--listen", self.address, "--state-dir", str(self.state), "--quotas", str(self.work / "quotas.toml"),
                "--kv-events", f"tcp://127.0.0.1:{self.events_port}", "--metrics-port", str(self.metrics_port),
                "--free-watermark", "0", "--idle-ttl", "3600", "--log-format", "json", "--log-level", "warning"]

    def start(self) -> float:
        """Seconds from exec to READY=1."""
        started = time.perf_counter()
        with open(self.work / "memd.log", "ab") as log:
            self.proc = spawn_ready(self.argv(), self.work, timeout_s=START_TIMEOUT_S, stderr=log.fileno())
        return time.perf_counter() - started

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()

    def anon_bytes(self) -> int:
        """memd's anonymous memory (its heap): the pool and swap tier are files in shared memory."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no Anonymous line in smaps_rollup")

    def metrics(self) -> dict[str, float]:
        return scraped(f"http://127.0.0.1:{self.metrics_port}/metrics")


def write_quotas(path: Path, pages: int) -> None:
    lines = []
    for t in range(TENANTS):
        lines.append(f"[tenants.t{t}]")
        if t < GUARANTEED_TENANTS:
            lines.append(f"guaranteed_pages = {pages // 64}")
        lines.append(f"max_pages = {pages // 3}")
    path.write_text("\n".join(lines) + "\n")


class Tokens:
    """Token ids no other session has: every block is its session's own."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


async def fill(host: Host, sessions: int, tokens: Tokens) -> None:
    client = await MemdClient.attach(host.address, name="filler", block_size=BLOCK_SIZE, map_memory=False)
    n = SESSION_PAGES * BLOCK_SIZE
    try:
        for first in range(0, sessions, BATCH):
            opens = []
            for i in range(first, min(sessions, first + BATCH)):
                tenant = i % TENANTS
                retain = 3600.0 if tenant < GUARANTEED_TENANTS and (i // TENANTS) % RETAIN_EVERY == 0 else 0.0
                opens.append(Open(tokens.take(n), session_id=f"s{i}", tenant=f"t{tenant}", retain_s=retain))
            opened = await client.step(*opens)
            await client.step(*[Park(o.seq_id, commit_to=n) for o in opened])
    finally:
        await client.close()


class EventWatch:
    """A KV-event subscriber: when each first token id of a BlockStored batch arrived."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVTIMEO, 200)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.seen: dict[int, float] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                _topic, _seq, payload = self.sub.recv_multipart()
            except zmq.Again:
                continue
            at = time.monotonic()
            _ts, events, _rank = msgpack.unpackb(payload)
            with self.lock:
                for event in events:
                    if event.get("type") == "BlockStored" and event.get("medium") == "GPU" and event["token_ids"]:
                        self.seen.setdefault(event["token_ids"][0], at)

    def arrival(self, first_token: int, timeout_s: float = 5.0) -> float | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if first_token in self.seen:
                    return self.seen[first_token]
            time.sleep(0.001)
        return None

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.context.destroy(linger=0)


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


async def probe(host: Host, tokens: Tokens, events: EventWatch, small_steps: int, evicting_steps: int) -> dict:
    """The stepping worker: small Steps with a few pages free, then evicting Steps with none; operator calls."""
    client = await MemdClient.attach(host.address, name="stepper", block_size=BLOCK_SIZE, map_memory=False)
    admin = MemdAdmin(host.address, timeout_s=600.0)
    out: dict = {}
    try:
        stats = await admin.stats()
        spare = 8
        # Ballast: a running sequence of nearly every free page (one Step of up to a million pages: its own
        # hold of memd's loop is not the probe's, so holds are read around it).
        ballast = await client.step(Open(tokens.take(1), reserve=(stats.free_blocks - spare) * BLOCK_SIZE - 1))
        windows = [await asyncio.to_thread(host.metrics)]

        turn = itertools.count()

        async def small() -> list[float]:
            opened = await client.step(Open(tokens.take(BLOCK_SIZE), tenant=f"t{next(turn) % TENANTS}"))
            t0 = time.perf_counter()
            await client.step(Park(opened[0].seq_id, commit_to=BLOCK_SIZE))
            t1 = time.perf_counter()
            await client.step(Free(opened[0].seq_id))
            return [t1 - t0, time.perf_counter() - t1]

        small_s: list[float] = []
        for _ in range(small_steps):
            small_s += await small()
        out["small_step_p50_ms"] = statistics.median(small_s) * 1e3
        out["small_step_p99_ms"] = percentile(small_s, 99) * 1e3

        # Operator calls while the Step probe runs: how long each took, and the worst Step meanwhile.
        for name, call in (("stats", None), ("snapshot", ["snapshot", "-o", str(host.work / "snap.msgpack")]),
                           ("tenants", ["tenants"])):
            started = time.perf_counter()
            if call is None:
                for _ in range(5):
                    await admin.stats()
                out["stats_ms"] = (time.perf_counter() - started) / 5 * 1e3
                continue
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "memd.memctl", "--address", host.address, "--timeout", "600", *call,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            done = asyncio.ensure_future(proc.wait())
            during: list[float] = []
            while not done.done():
                during += await small()
            if proc.returncode != 0:
                err = (await proc.stderr.read()).decode() if proc.stderr else ""
                raise RuntimeError(f"memctl {name} failed: {err.strip()}")
            out[f"{name}_s"] = time.perf_counter() - started
            out[f"{name}_max_step_ms"] = max(during) * 1e3 if during else 0.0

        # The pool full: each new session's Step must evict a parked one (the coldest).
        stats = await admin.stats()
        windows.append(await asyncio.to_thread(host.metrics))
        await client.step(Open(tokens.take(1), reserve=stats.free_blocks * BLOCK_SIZE - 1))
        windows.append(await asyncio.to_thread(host.metrics))
        before = sum(v for k, v in (await admin.stats()).counters.items() if k.startswith("evictions_"))
        evict_s, lags = [], []
        n = SESSION_PAGES * BLOCK_SIZE
        for i in range(evicting_steps):
            ids = tokens.take(n)
            t0 = time.perf_counter()
            opened = await client.step(Open(ids, session_id=f"new{i}", tenant=f"t{i % TENANTS}"))
            evict_s.append(time.perf_counter() - t0)
            sent = time.monotonic()
            await client.step(Park(opened[0].seq_id, commit_to=n))
            arrived = events.arrival(ids[0])
            if arrived is not None:
                lags.append(arrived - sent)
        after = sum(v for k, v in (await admin.stats()).counters.items() if k.startswith("evictions_"))
        out["evicting_step_p50_ms"] = statistics.median(evict_s) * 1e3
        out["evicting_step_p99_ms"] = percentile(evict_s, 99) * 1e3
        out["evicting_steps"], out["evictions"] = evicting_steps, int(after - before)
        out["events_seen"] = len(lags)
        out["events_lag_p50_ms"] = statistics.median(lags) * 1e3 if lags else None
        out["events_lag_p99_ms"] = percentile(lags, 99) * 1e3 if lags else None
        out["parked"] = int((await admin.stats()).sequences.get("parked", 0))
        windows.append(await asyncio.to_thread(host.metrics))
        out.update(loop_holds([(windows[0], windows[1]), (windows[2], windows[3])]))
        del ballast
    finally:
        await admin.close()
        await client.close()
    return out


async def first_step(host: Host, session: str) -> float:
    """A worker attaches to the restarted memd and resumes a parked session: seconds to that Step's answer."""
    started = time.perf_counter()
    client = await MemdClient.attach(host.address, name="returning", block_size=BLOCK_SIZE, map_memory=False)
    try:
        resumed = await client.step(Resume(session_id=session))
        if resumed[0].num_committed != SESSION_PAGES * BLOCK_SIZE:
            raise RuntimeError(f"session {session} came back with {resumed[0].num_committed} tokens")
        return time.perf_counter() - started
    finally:
        await client.close()


def run_size(work: Path, pages: int, sessions: int, small_steps: int, evicting_steps: int) -> dict:
    host = Host(work, pages, Path(tempfile.mkdtemp(prefix="memd-scale-", dir="/dev/shm")))
    write_quotas(work / "quotas.toml", pages)
    tokens = Tokens()
    out: dict = {"sessions": sessions, "pages": pages}
    try:
        out["start_s"] = host.start()
        empty = host.anon_bytes()
        events = EventWatch(host.events_port)
        try:
            started = time.perf_counter()
            asyncio.run(fill(host, sessions, tokens))
            out["fill_s"] = time.perf_counter() - started
            out["bytes_per_session"] = (host.anon_bytes() - empty) / sessions
            out.update(asyncio.run(probe(host, tokens, events, small_steps, evicting_steps)))
        finally:
            events.close()
        before = host.anon_bytes()
        host.kill()
        killed = time.perf_counter()
        host.start()
        out["recovery_ready_s"] = time.perf_counter() - killed
        out["recovery_first_step_s"] = out["recovery_ready_s"] + asyncio.run(first_step(host, "s1"))
        stats = asyncio.run(_stats(host))
        out["parked_after_restart"] = int(stats.sequences.get("parked", 0))     # s1 parked again: its worker left
        out["memory_after_restart_ratio"] = host.anon_bytes() / before
        out["loop_lag_max_after_restart_ms"] = host.metrics()["kvpool_memd_loop_lag_max_seconds"] * 1e3
        out["loop_lag_max_since_start_ms"] = out["loop_lag_max_after_restart_ms"]
    finally:
        host.stop()
        subprocess.run(["rm", "-rf", str(host.state)], check=False)
    return out


def loop_holds(windows: list[tuple[dict[str, float], dict[str, float]]]) -> dict:
    """memd's loop holds within the probe's windows (scrapes before and after each): how many passed 50 ms,
    and the smallest bucket bound every one of them stayed under."""
    name = "kvpool_memd_loop_lag_seconds"

    def delta(key: str) -> float:
        return sum(after.get(key, 0.0) - before.get(key, 0.0) for before, after in windows)

    count = delta(f"{name}_count")
    bounds = sorted({float(key.split('"')[1]) for _, after in windows for key in after
                     if key.startswith(f"{name}_bucket{{")})
    under = [bound for bound in bounds if delta(f'{name}_bucket{{le="{_le(bound)}"}}') == count]
    over_50 = count - delta(f'{name}_bucket{{le="0.05"}}')
    return {"loop_holds_over_50ms": int(over_50), "loop_lag_max_ms": under[0] * 1e3}


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes it in the label."""
    return "+Inf" if bound == float("inf") else repr(bound)


async def _stats(host: Host):
    async with MemdAdmin(host.address) as admin:
        return await admin.stats()


def bytes_per_page(work: Path, pages: int) -> float:
    """memd's anonymous memory per pool page: an empty memd of `pages` against one of 1,024."""
    sizes = []
    for n in (1024, pages):
        host = Host(work / f"empty-{n}", n, Path(tempfile.mkdtemp(prefix="memd-scale-", dir="/dev/shm")))
        host.work.mkdir(exist_ok=True)
        write_quotas(host.work / "quotas.toml", n)
        try:
            host.start()
            sizes.append(host.anon_bytes())
        finally:
            host.stop()
            subprocess.run(["rm", "-rf", str(host.state)], check=False)
    return (sizes[1] - sizes[0]) / (pages - 1024)


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,300000", help="parked sessions, one memd each")
    parser.add_argument("--pages", type=int, default=1 << 20, help="pool pages of 4 KiB")
    parser.add_argument("--small-steps", type=int, default=500)
    parser.add_argument("--evicting-steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="2k and 6k sessions in 64k pages (the suite's run)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.pages, args.small_steps, args.evicting_steps = "2000,6000", 1 << 16, 100, 40
    sizes = [int(s) for s in args.sizes.split(",")]
    if max(sizes) * SESSION_PAGES >= args.pages:
        parser.error(f"{max(sizes)} sessions of {SESSION_PAGES} pages do not fit {args.pages} pages")
    results: dict = {"host_cpu": cpu_model(), "cores": os.cpu_count(), "pages": args.pages, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        results["scale_bytes_per_page"] = bytes_per_page(Path(tmp), args.pages)
        for size in sizes:
            work = Path(tmp) / f"size-{size}"
            work.mkdir()
            results["sizes"][str(size)] = run_size(work, args.pages, size, args.small_steps, args.evicting_steps)
            if not args.json:
                print(f"{size} sessions: {json.dumps(results['sizes'][str(size)])}", file=sys.stderr)
    rows = results["sizes"]
    low, high = rows[str(min(sizes))], rows[str(max(sizes))]
    mid = rows.get("100000", high)
    results.update({
        "scale_step_p99_growth": high["small_step_p99_ms"] / low["small_step_p99_ms"],
        "scale_evict_step_p99_growth": high["evicting_step_p99_ms"] / low["evicting_step_p99_ms"],
        "scale_recovery_s": mid["recovery_first_step_s"],
        "scale_bytes_per_session": max(r["bytes_per_session"] for r in rows.values()),
        "scale_events_lag_p99_ms": max(r["events_lag_p99_ms"] or 0.0 for r in rows.values()),
        "scale_loop_lag_max_ms": max(r["loop_lag_max_ms"] for r in rows.values()),
    })
    if args.json:
        print(json.dumps(results))
    else:
        print(report(results, sizes))


def report(res: dict, sizes: list[int]) -> str:
    rows = res["sizes"]
    lines = [f"memd at scale: {res['pages']} pages of 4 KiB, 3-page parked sessions, {TENANTS} tenants; "
             f"{res['host_cpu']} ({res['cores']} cores)", ""]
    fields = [("small Step p50 / p99 (ms)", lambda r: f"{r['small_step_p50_ms']:.2f} / {r['small_step_p99_ms']:.2f}"),
              ("evicting Step p50 / p99 (ms)",
               lambda r: f"{r['evicting_step_p50_ms']:.2f} / {r['evicting_step_p99_ms']:.2f}"),
              ("memd bytes per parked session", lambda r: f"{r['bytes_per_session']:.0f}"),
              ("Stats (ms)", lambda r: f"{r['stats_ms']:.1f}"),
              ("memctl snapshot / tenants (s)", lambda r: f"{r['snapshot_s']:.2f} / {r['tenants_s']:.2f}"),
              ("KV-event lag p50 / p99 (ms)",
               lambda r: f"{r['events_lag_p50_ms']:.1f} / {r['events_lag_p99_ms']:.1f}"),
              ("loop holds over 50 ms; all under (ms)",
               lambda r: f"{r['loop_holds_over_50ms']}; {r['loop_lag_max_ms']:.0f}"),
              ("kill -9 -> READY / first Step (s)",
               lambda r: f"{r['recovery_ready_s']:.2f} / {r['recovery_first_step_s']:.2f}"),
              ("memory after restart / before", lambda r: f"{r['memory_after_restart_ratio']:.2f}")]
    lines.append(table([["parked sessions", *[f"{s:,}" for s in sizes]],
                        *[[name, *[fmt(rows[str(s)]) for s in sizes]] for name, fmt in fields]]))
    lines.append("")
    lines.append(f"memd bytes per pool page: {res['scale_bytes_per_page']:.1f}")
    for key in ("scale_step_p99_growth", "scale_evict_step_p99_growth", "scale_recovery_s",
                "scale_events_lag_p99_ms", "scale_loop_lag_max_ms"):
        lines.append(f"{key}: {res[key]:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
