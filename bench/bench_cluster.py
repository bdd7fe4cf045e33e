"""Two hosts behind kvroute: what the cluster tier and session affinity are worth to a multi-turn chat load.

    .venv/bin/python bench/bench_cluster.py [--quick] [--json] [--users 8] [--turns 4] [--think 1.0]

Two hosts (a memd + inferd each, `--threads 1`) on this machine, the CPU tiny
model, N users chatting at once through the official `openai` client; every
turn resends the conversation with its `X-Session-Id` and streams the reply.
Four runs, each on fresh daemons:

- **kvroute + store**: memd joins a Mooncake Store (`mooncake_master` from
  kvpool[cluster]), clients talk to one kvroute (session affinity, prefix and
  load placement);
- **kvroute, no store**: the same routing, the directory in kvroute's memory,
  memd keeps KV on its own host;
- **session hash, no store**: what a balancer with sticky sessions does: every
  turn of a session goes to the host its `X-Session-Id` hashes to, straight
  to its inferd;
- **round robin, no store**: what a plain balancer does: each request goes to
  the next host, counted over all requests in the order they are sent.

Then the host that served the most sessions' last turns is killed (its memd
and inferd, SIGKILL) and each of those sessions takes one more turn, one at a
time, on the other host: with the
store its KV is fetched from there; without, kvroute's sessions are computed
again from scratch (so are the balancers'). Reported: turn >= 2 TTFT p50/p99 and the share of prompt
tokens served from cache, per run; the after-the-kill turns' TTFT and cache
share; and the store's fetch bandwidth (Mooncake's batch_get_into of objects
held on memd's segments into a registered buffer, 64 KiB pages and 1 MiB
objects) against a plain TCP copy of the same bytes over loopback between two
processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from bench_http_chat import QUESTIONS, chat_load_args, pct
from tables import table

from inferd.tiny import CORPUS, make_tiny_model
from shared.launch import free_port, free_ports, spawn_ready

FULL = {"users": 8, "turns": 4, "think_s": 1.0, "max_tokens": 24, "corpus": 4, "fetch_mib": 64,
        "model": {"arch": "llama", "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096, "seed": 0}}
QUICK = {"users": 3, "turns": 2, "think_s": 0.0, "max_tokens": 4, "corpus": 1, "fetch_mib": 4,
         "model": {"arch": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512, "seed": 0}}
MODES = ("kvroute + store", "kvroute, no store", "session hash, no store", "round robin, no store")
MASTER = Path(sys.executable).parent / "mooncake_master"
MODEL = "tiny"


@dataclass
class Run:
    mode: str
    ttft_later: list[float] = field(default_factory=list)
    prompt_later: int = 0
    cached_later: int = 0
    ttft_moved: list[float] = field(default_factory=list)     # after a host died: its sessions' next turns
    prompt_moved: int = 0
    cached_moved: int = 0
    fetch: dict[str, float] | None = None                     # the store's fetch bandwidth (kvroute + store)


@dataclass
class Session:
    number: int
    messages: list[dict[str, str]]
    served_by: str = ""


class Cluster:
    """Daemons of one run; `kill_host` is the failure the run measures."""

    def __init__(self, work: Path, model_dir: Path, with_store: bool, with_router: bool) -> None:
        self.work, self.model_dir = work, model_dir
        self.with_store, self.with_router = with_store, with_router
        self.procs: list[subprocess.Popen[bytes]] = []
        self.hosts: list[list[subprocess.Popen[bytes]]] = []
        self.workers: list[str] = []
        self.router = ""
        self.store_flags: list[str] = []
        self.log = open(work / "daemons.log", "a")      # noqa: SIM115 (closed in stop)

    def start(self) -> None:
        if self.with_store:
            rpc, meta, metrics = free_ports(3)
            self.procs.append(subprocess.Popen(
                [str(MASTER), f"-rpc_port={rpc}", "-enable_http_metadata_server=true",
                 f"-http_metadata_server_port={meta}", f"-metrics_port={metrics}"],
                stdout=subprocess.DEVNULL, stderr=self.log.fileno()))
            _await_port(rpc)
            _await_port(meta)
            self.store_flags = ["--cluster-master", f"127.0.0.1:{rpc}", "--cluster-metadata",
                                f"http://127.0.0.1:{meta}/metadata", "--cluster-host", "127.0.0.1"]
        for number in range(2):
            memd_addr, port = f"unix:{self.work / f'memd-{number}.sock'}", free_port()
            memd = spawn_ready(["memd", "--device", "cpu", "--model", str(self.model_dir), "--block-size", "16",
                                "--pool-bytes", "128MiB", "--listen", memd_addr, "--log-format", "json",
                                *(self.store_flags + ["--cluster-segment", "256MiB"] if self.with_store else [])],
                               self.work, stderr=self.log.fileno())
            inferd = spawn_ready(["inferd", "serve", "--model", str(self.model_dir), "--memd", memd_addr,
                                  "--listen", f"unix:{self.work / f'inferd-{number}.sock'}", "--threads", "1",
                                  "--http", f"127.0.0.1:{port}", "--served-model-name", MODEL, "--log-format", "json"],
                                 self.work, stderr=self.log.fileno())
            self.hosts.append([inferd, memd])
            self.procs += [memd, inferd]
            self.workers.append(f"http://127.0.0.1:{port}")
        if self.with_router:
            port = free_port()
            self.procs.append(spawn_ready(["kvroute", "--http", f"127.0.0.1:{port}", "--log-format", "json",
                                           *[f for url in self.workers for f in ("--worker", url)],
                                           *self.store_flags], self.work, stderr=self.log.fileno()))
            self.router = f"http://127.0.0.1:{port}"

    def kill_host(self, number: int) -> None:
        for proc in self.hosts[number]:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.log.close()


def _await_port(port: int, timeout_s: float = 30.0) -> None:
    """mooncake_master has no readiness signal of its own: its port accepting is it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


async def turn(clients: dict[str, openai.AsyncOpenAI], url: str, session: Session, shape: dict[str, Any]
               ) -> tuple[float, Any]:
    """One streamed turn sent to `url`; (TTFT, usage). Records who served it and appends the reply."""
    started = time.perf_counter()
    first, reply, usage = None, "", None
    async with clients[url].chat.completions.with_streaming_response.create(
            model=MODEL, messages=session.messages, max_tokens=shape["max_tokens"], temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"X-Session-Id": session_header(session)}) as response:
        session.served_by = response.headers.get("x-kvroute-worker", url)
        async for chunk in await response.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            text = "".join(c.delta.content or "" for c in chunk.choices)
            if text and first is None:
                first = time.perf_counter() - started
            reply += text
    session.messages.append({"role": "assistant", "content": reply})
    assert first is not None and usage is not None
    return first, usage


def session_header(session: Session) -> str:
    return f"user-{session.number}"


async def load(cluster: Cluster, run: Run, shape: dict[str, Any], balancer: str) -> None:
    urls = [cluster.router] if cluster.router else cluster.workers
    clients = {url: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) for url in urls}
    for url in cluster.workers:                       # torch's first pass on each worker is not a turn's cost
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as warm:
            await warm.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "warm up"}],
                                               max_tokens=2)
    sessions = [Session(n, [{"role": "system", "content": f"You are assistant number {n}.\n" +
                             CORPUS * shape["corpus"]}]) for n in range(shape["users"])]

    sent = itertools.count()

    def host(session: Session) -> str:
        """kvroute (one URL), or the balancer's pick: by the session's hash, or the next host over all requests."""
        if balancer == "session hash":
            return urls[zlib.crc32(session_header(session).encode()) % len(urls)]
        return urls[next(sent) % len(urls)]

    async def user(session: Session) -> None:
        for number in range(shape["turns"]):
            if number and shape["think_s"]:
                await asyncio.sleep(shape["think_s"])        # the user reads and types: think time, not a wait
            session.messages.append({"role": "user", "content": QUESTIONS[(session.number + number) % 6]})
            url = host(session)
            ttft, usage = await turn(clients, url, session, shape)
            if number:
                run.ttft_later.append(ttft)
                run.prompt_later += usage.prompt_tokens
                run.cached_later += usage.prompt_tokens_details.cached_tokens
    await asyncio.gather(*[user(s) for s in sessions])

    await asyncio.sleep(2.0)        # memd publishes a parked session within about a second: let the last ones land
    if cluster.with_store:
        run.fetch = await asyncio.to_thread(fetch_bandwidth, cluster, shape["fetch_mib"])
    busier = max((0, 1), key=lambda n: sum(s.served_by == cluster.workers[n] for s in sessions))
    cluster.kill_host(busier)
    moved = [s for s in sessions if s.served_by == cluster.workers[busier]]
    survivor = cluster.router or cluster.workers[1 - busier]
    for session in moved:                             # one at a time: the fetch or recompute alone
        session.messages.append({"role": "user", "content": "One more thing."})
        ttft, usage = await turn(clients, survivor, session, shape)
        run.ttft_moved.append(ttft)
        run.prompt_moved += usage.prompt_tokens
        run.cached_moved += usage.prompt_tokens_details.cached_tokens
    for client in clients.values():
        await client.close()


def run_mode(mode: str, model_dir: Path, work: Path, shape: dict[str, Any]) -> Run:
    work = work / f"run-{MODES.index(mode)}"          # fresh sockets and state directories: nothing recovered
    work.mkdir()
    cluster = Cluster(work, model_dir, with_store="+ store" in mode, with_router=mode.startswith("kvroute"))
    run = Run(mode)
    try:
        cluster.start()
        asyncio.run(load(cluster, run, shape, mode.split(",")[0]))
    finally:
        cluster.stop()
    return run


def fetch_bandwidth(cluster: Cluster, mib: int) -> dict[str, float]:
    """The store's fetch bandwidth for memd's pages (64 KiB) and for 1 MiB objects, and a TCP copy's."""
    out = {f"store_{kib}k_gib_s": store_fetch(cluster, mib, kib << 10) for kib in (64, 1024)}
    return out | {"tcp_gib_s": tcp_copy(mib << 20) / 2**30, "mib": mib}


def store_fetch(cluster: Cluster, mib: int, size: int) -> float:
    """GiB/s of `size`-byte objects read from the store into a registered buffer, 64 per batch.

    Measured while both hosts live: for a host's -client_ttl (10 s) after it
    dies, the master may still pick its segment for a new object's replica.
    """
    os.environ.setdefault("GLOG_minloglevel", "2")
    import ctypes

    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    page = size
    count = (mib << 20) // page
    master, metadata = cluster.store_flags[1], cluster.store_flags[3]
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", metadata, 0, 64 << 20, "tcp", "", master) == 0
    buffer = (ctypes.c_char * (count * page))()
    base = ctypes.addressof(buffer)
    assert client.register_buffer(base, count * page) == 0
    keys = [f"bench/fetch/{size}/{i}" for i in range(count)]
    batch = 64
    replicate = ReplicateConfig()
    replicate.replica_num = 1
    for start in range(0, count, batch):          # held on the surviving memd's segment, as a page would be
        part = keys[start:start + batch]
        rc = client.batch_put_from(part, [base + (start + i) * page for i in range(len(part))], [page] * len(part),
                                   replicate)
        assert all(r == 0 for r in rc), rc
    started = time.perf_counter()
    for start in range(0, count, batch):
        part = keys[start:start + batch]
        got = client.batch_get_into(part, [base + (start + i) * page for i in range(len(part))], [page] * len(part))
        assert all(n == page for n in got), got
    store_s = time.perf_counter() - started
    for start in range(0, count, batch):
        for key in keys[start:start + batch]:
            client.remove(key, True)
    client.close()
    return count * page / store_s / 2**30


def tcp_copy(total: int) -> float:
    """Bytes/s of one process sending `total` bytes to this one over loopback TCP (what a plain fetch would do)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        sender = subprocess.Popen([sys.executable, "-c", (
            "import socket,sys\n"
            f"s=socket.create_connection(('127.0.0.1',{port}))\n"
            f"data=bytes({1 << 20})\n"
            f"for _ in range({total >> 20}): s.sendall(data)\n"
            "s.close()\n")])
        conn, _ = server.accept()
        received, view = 0, memoryview(bytearray(total))
        started = time.perf_counter()
        with conn:
            while received < total:
                n = conn.recv_into(view[received:])
                if not n:
                    break
                received += n
        seconds = time.perf_counter() - started
        sender.wait()
    return received / seconds


def summary(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ttft_later_p50_ms": 1000 * pct(run.ttft_later, 50), "ttft_later_p99_ms": 1000 * pct(run.ttft_later, 99),
        "cached_share_later": run.cached_later / run.prompt_later if run.prompt_later else 0.0,
        "moved_sessions": len(run.ttft_moved),
        "ttft_moved_p50_ms": 1000 * pct(run.ttft_moved, 50),
        "cached_share_moved": run.cached_moved / run.prompt_moved if run.prompt_moved else 0.0}
    if run.fetch is not None:
        out["fetch"] = run.fetch
    return out


def main() -> int:
    args, shape = chat_load_args(__doc__, FULL, QUICK)
    if not MASTER.exists():
        print(f"bench_cluster needs kvpool[cluster] ({MASTER} is missing)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-cluster-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "tiny", **shape["model"])
        try:
            runs = {mode: summary(run_mode(mode, model_dir, work, shape)) for mode in MODES}
        except (subprocess.SubprocessError, OSError, openai.OpenAIError, AssertionError) as exc:
            print(f"bench failed: {exc!r}", file=sys.stderr)
            with contextlib.suppress(OSError):
                for log in work.glob("run-*/daemons.log"):
                    print(f"--- {log}\n" + "".join(log.read_text().splitlines(True)[-15:]), file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"shape": {k: v for k, v in shape.items() if k != "model"}, "runs": runs}, indent=2))
        return 0
    print(f"{shape['users']} users x {shape['turns']} turns, think {shape['think_s']} s, {shape['max_tokens']} "
          f"tokens per reply, two hosts on one machine (CPU tiny model)\n")
    rows = [["", "TTFT turn>=2 p50", "p99", "cached (turn>=2)", "a host killed: next turns", "TTFT p50", "cached"]]
    for mode, r in runs.items():
        rows.append([mode, f"{r['ttft_later_p50_ms']:.1f} ms", f"{r['ttft_later_p99_ms']:.1f} ms",
                     f"{100 * r['cached_share_later']:.0f}%", str(r["moved_sessions"]),
                     f"{r['ttft_moved_p50_ms']:.1f} ms", f"{100 * r['cached_share_moved']:.0f}%"])
    print(table(rows))
    fetch = runs[MODES[0]]["fetch"]
    print(f"\nfetch from the store ({fetch['mib']} MiB, batches of 64 objects): {fetch['store_64k_gib_s']:.2f} GiB/s "
          f"in 64 KiB pages, {fetch['store_1024k_gib_s']:.2f} GiB/s in 1 MiB objects; a plain TCP copy on "
          f"loopback: {fetch['tcp_gib_s']:.2f} GiB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
