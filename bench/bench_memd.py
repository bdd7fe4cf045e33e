"""How fast memd's control plane is: the allocator, the Step RPC, worker reclaim.

    .venv/bin/python bench/bench_memd.py [--seconds 3] [--json]

Three questions, each answered by a real code path rather than a model of it:
1. What does the allocator cost with no RPC around it? `KvManager.step`
   (open a sequence of N blocks, free it) and the raw `BlockPool`.
2. How many decode Steps per second does one memd answer? Real client
   processes attach over the Unix socket; each Step carries 16 `Extend`s, one
   token per open sequence, so a page is allocated about once per Step. One
   client's rate and its anchor's (a bare grpc.aio echo server) take turns,
   three rounds each, so that what else the machine does weighs on both.
3. How soon after a worker dies does memd get its pages back? A worker is
   SIGKILLed; the clock stops when memd logs "worker reclaimed".

Then what would make memd's loop wait: the journal's flushes, operator calls
(memctl snapshot and check on a 1M-block pool, each Step's wait counted),
Python's full garbage collections as sessions come and go (Python's own
policy against memd's), and start-up to READY=1 (on /dev/shm, and on a tmpfs
mounted as the shipped mount unit mounts it, where this user may mount).

Client processes start together on a barrier, so their (slow: torch) imports
are outside every measured window. Nothing here sleeps to wait for anything.
"""

from __future__ import annotations

import argparse
import asyncio
import configparser
import contextlib
import gc
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import uvloop
import vllm_anchor
from scraped_metrics import scraped
from tables import table

from memd.host_pages import huge_pages
from memd.journal import WriteAheadLog
from memd.manager import KvManager
from memd.pool import BlockPool, FreeQueue
from memd.state_dir import Layout, StateDir
from shared.full_collections import FullCollections, freeze_long_lived
from shared.geometry import plan_pool
from shared.launch import free_port, spawn_ready
from shared.ops import Extend, Free, Open, Park
from shared.sizes import parse_size

POOL, PAGE, BLOCK_SIZE = "256MiB", "16KiB", 16
SEQS = 16                 # sequences per client: one Extend each per Step
MAX_SEQ_TOKENS = 1024     # a sequence is freed and reopened here, or earlier if the pool share is tight
BLOCKS_PER_SEQ = 64       # the in-process open/free cycle
START_TIMEOUT_S = 120.0   # spawning clients imports torch: seconds each on a small machine
ROUNDS = 3                # turns the Step rate and its anchors take (bench_step_rate)
_tags = [1]               # the next clients' first token range (decode_client): each client its own


# ---- 1. in-process allocator -------------------------------------------------

def bench_manager(seconds: float) -> float:
    """Blocks/s through a whole Step: journal, prefix lookup, effects; freed again in a second Step."""
    geometry = plan_pool(parse_size(POOL), block_bytes=parse_size(PAGE))
    manager = KvManager(geometry)
    worker = manager.attach("bench", os.getpid(), "default", BLOCK_SIZE, 0).worker_id
    prompt = list(range(BLOCKS_PER_SEQ * BLOCK_SIZE - 1))     # + reserve=1: exactly BLOCKS_PER_SEQ pages
    blocks, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        opened, = manager.step(worker, [Open(prompt, reserve=1)]).results
        manager.step(worker, [Free(opened.seq_id)])
        blocks += opened.num_blocks
    return blocks / elapsed


def bench_allocator(runs: int, repeats: int, quick: bool) -> dict:
    """Allocate 16 blocks, `runs` times, then free those runs: memd's `BlockPool` against vLLM's.

    Both are the allocator of a serving engine with the same policy (uncached
    blocks reused first, LIFO; cached ones least recently freed first); vLLM's
    (`BlockPool.get_new_blocks` / `free_blocks` over `FreeKVCacheBlockQueue`)
    comes from its published wheel and runs in this process, interleaved with
    memd's, in pools of 10k and 1M blocks. memd's also keeps what vLLM's does
    not: zero-on-reuse flags, checksums, access times. Alongside, the two free
    queues alone (vLLM's `popleft_n`/`append_n`, memd's `take_front`/`put_back`).
    The best of `repeats` rounds, per call.
    """
    try:
        vllm = vllm_anchor.load(vllm_anchor.wheel())
    except RuntimeError as exc:
        if not quick:
            raise
        return {"vllm_unavailable": str(exc)}
    out: dict = {"vllm": vllm_anchor.VERSION, "pools": []}
    for num_blocks in ((10_000,) if quick else (10_000, 1_000_000)):
        cases = _allocators(vllm, num_blocks)
        best = {name: [float("inf"), float("inf")] for name in cases}
        for _ in range(repeats):
            for name, (take, give) in cases.items():
                alloc_us, free_us = _alloc_free_round(take, give, runs)
                best[name] = [min(best[name][0], alloc_us), min(best[name][1], free_us)]
        out["pools"].append({"blocks": num_blocks, **{f"{name}_alloc16_us": a for name, (a, _) in best.items()},
                             **{f"{name}_free16_us": f for name, (_, f) in best.items()}})
    worst = {key: max(p[f"kvpool_{key}_us"] / p[f"vllm_{key}_us"] for p in out["pools"])
             for key in ("alloc16", "free16")}
    out["alloc16_ratio_vs_vllm"], out["free16_ratio_vs_vllm"] = worst["alloc16"], worst["free16"]
    out["queue_ratio_vs_vllm"] = max((p["kvpool_queue_alloc16_us"] + p["kvpool_queue_free16_us"])
                                     / (p["vllm_queue_alloc16_us"] + p["vllm_queue_free16_us"]) for p in out["pools"])
    return out


def _allocators(vllm: SimpleNamespace, num_blocks: int) -> dict[str, tuple[Callable, Callable]]:
    """(take 16 blocks, give them back) of each allocator and queue measured, fresh, `num_blocks` each."""
    ours, queue = BlockPool(num_blocks), FreeQueue(num_blocks)
    theirs = vllm.BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE)
    their_queue = vllm.FreeKVCacheBlockQueue([vllm.KVCacheBlock(i) for i in range(num_blocks)])
    return {"kvpool": (lambda: ours.allocate_n(16)[0], ours.release_n),
            "vllm": (lambda: theirs.get_new_blocks(16), theirs.free_blocks),
            "kvpool_queue": (lambda: queue.take_front(16), queue.put_back),
            "vllm_queue": (lambda: their_queue.popleft_n(16), their_queue.append_n)}


def _alloc_free_round(take: Callable[[], list], give: Callable[[list], object], runs: int) -> tuple[float, float]:
    """µs per 16-block allocation and per free of one, garbage collection paused as `timeit` does."""
    gc.disable()
    try:
        started = time.perf_counter()
        taken = [take() for _ in range(runs)]
        middle = time.perf_counter()
        for blocks in taken:
            give(blocks)
        ended = time.perf_counter()
    finally:
        gc.enable()
    return (middle - started) / runs * 1e6, (ended - middle) / runs * 1e6


def bench_journal(parked: int, flushes: int) -> dict:
    """The longest a Step's journal flush takes with `parked` parked sessions, across journal rewrites.

    The journal (on tmpfs, as the unit keeps it) grows by one record per flush
    here (a decode token for one running request of up to MAX_SEQ_TOKENS) and is rewritten from the
    live state once it holds 4 records per sequence, a chunk of sequences per
    flush; the flushes that do so are timed apart from the others.
    In-process: a flush runs on memd's event loop, in the Step.
    """
    with _journaled(POOL) as (manager, worker, wal, new):
        for first in range(0, parked, 256):
            opened = manager.step(worker, [Open([i, i + 1, i + 2], session_id=f"s{i}")
                                           for i in range(first, min(first + 256, parked))]).results
            manager.step(worker, [Park(r.seq_id, commit_to=3) for r in opened])
        wal.checkpoint(manager)
        live, = manager.step(worker, [Open([1 << 30], reserve=1)]).results
        token = iter(range((1 << 30) + 1, 1 << 31))
        rewriting, other, collected, length = [], [], [], 1
        passes = FullCollections(freeze_after_s=float("inf"))    # counts full collections, freezes nothing
        gc.callbacks.append(passes)
        try:
            for _ in range(flushes):
                if length == MAX_SEQ_TOKENS:              # a finished request; the next one opens
                    manager.step(worker, [Free(live.seq_id)])
                    live, length = manager.step(worker, [Open([next(token)], reserve=1)]).results[0], 1
                manager.step(worker, [Extend(live.seq_id, append=[next(token)], commit_to=length, reserve=1)])
                length += 1
                during, seen = new.exists(), passes.count
                started = time.perf_counter()
                wal.flush(manager)
                took = time.perf_counter() - started
                (collected if passes.count != seen else rewriting if during or new.exists() else other).append(took)
        finally:
            gc.callbacks.remove(passes)
    if not rewriting:
        raise RuntimeError("the journal was never rewritten: too few flushes for the sequences")
    return {"parked": parked, "flushes": flushes, "rewriting_flushes": len(rewriting),
            "max_rewriting_flush_ms": max(rewriting) * 1e3, "max_other_flush_ms": max(other) * 1e3,
            "p50_flush_ms": statistics.median(rewriting + other) * 1e3, "collector_passes": len(collected),
            "max_collected_flush_ms": max(collected, default=0.0) * 1e3}


def bench_journal_context(contexts: tuple[int, ...]) -> list[dict]:
    """A decode Step's journal flush by context: 16 running sequences of `context` tokens, one token each a
    Step, each page's checksum sent once the page is full (as inferd sends them) or never (a worker of its own
    that does not), until the journal has been rewritten from the live state once. The flush runs on memd's
    event loop, in the Step: what it costs must not grow with the context, nor while the journal is rewritten
    (a record of a sequence copied into the new journal carries its whole history)."""
    return [_journal_context(context, sums) for sums in (True, False) for context in contexts]


def _journal_context(context: int, sums: bool) -> dict:
    with _journaled("4GiB") as (manager, worker, wal, new):
        opened = manager.step(worker, [Open(list(range(i << 20, (i << 20) + context)), reserve=1)
                                       for i in range(SEQS)]).results
        seq_ids = [r.seq_id for r in opened]
        known = {"sums_from": 0, "page_sums": [1 + i for i in range(context // BLOCK_SIZE)]} if sums else {}
        manager.step(worker, [Extend(s, commit_to=context, reserve=1, **known) for s in seq_ids])
        wal.checkpoint(manager)
        took, rewriting, length, rewrites = [], [], context, 0
        while not rewrites:
            length += 1
            filled = {"sums_from": length // BLOCK_SIZE - 1, "page_sums": [7]} \
                if sums and length % BLOCK_SIZE == 0 else {}
            manager.step(worker, [Extend(s, append=[length], commit_to=length, reserve=1, **filled)
                                  for s in seq_ids])
            during = new.exists()
            started = time.perf_counter()
            wal.flush(manager)
            (rewriting if during or new.exists() else took).append(time.perf_counter() - started)
            rewrites += during and not new.exists()
    return {"context": context, "page_sums": sums, "p50_flush_ms": statistics.median(took) * 1e3,
            "max_flush_ms": max(took) * 1e3, "rewriting_flushes": len(rewriting),
            "max_rewriting_flush_ms": max(rewriting) * 1e3}


@contextlib.contextmanager
def _journaled(pool: str) -> Iterator[tuple[KvManager, int, WriteAheadLog, Path]]:
    """A manager of a `pool` pool with one worker attached, and its journal on tmpfs (as the unit keeps it);
    also the path of the journal being rewritten, which exists while a rewrite is under way."""
    geometry = plan_pool(parse_size(pool), block_bytes=parse_size(PAGE))
    manager = KvManager(geometry)
    worker = manager.attach("bench", os.getpid(), "default", BLOCK_SIZE, 0).worker_id
    with tempfile.TemporaryDirectory(prefix="memd-bench-journal-", dir="/dev/shm") as where:
        wal = WriteAheadLog(StateDir(Path(where)), Layout("shm", geometry.num_blocks, geometry.block_bytes, 0),
                            fsync=False)
        try:
            yield manager, worker, wal, Path(where) / "journal.new"
        finally:
            wal.close()


def bench_full_collections(ctx: mp.context.SpawnContext, sessions: int) -> dict:
    """Python's full garbage collections while `sessions` sessions are opened and parked, half of them freed
    again as new ones come (a busy memd's churn), in a manager of a 1M-block pool: with Python's collector as
    it comes and with memd's policy (shared.full_collections), each in a fresh process of its own.

    In-process: a full collection pauses whatever thread runs it, and in memd
    that is the event loop while Steps wait. Both start as memd does, with
    start-up's objects frozen."""
    out = {"sessions": sessions}
    for policy in ("python", "memd"):
        results = ctx.Queue()
        proc = ctx.Process(target=full_collections_main, args=(policy, sessions, results))
        proc.start()
        out[policy] = results.get(timeout=600)
        proc.join()
    return out


def full_collections_main(policy: str, sessions: int, results: mp.Queue) -> None:
    manager = KvManager(plan_pool(parse_size("1GiB"), block_bytes=1024))
    worker = manager.attach("bench", os.getpid(), "default", BLOCK_SIZE, 0).worker_id
    if policy == "memd":
        counted = freeze_long_lived()
    else:
        gc.collect()
        gc.freeze()                                   # as memd after start-up
        counted = FullCollections(freeze_after_s=float("inf"))    # counts, never freezes
        gc.callbacks.append(counted)
    tokens, live = iter(range(1 << 30)), []
    started = time.perf_counter()
    for first in range(0, sessions, 64):
        opened = manager.step(worker, [Open([next(tokens) for _ in range(4 * BLOCK_SIZE)], reserve=1,
                                            session_id=f"s{i}") for i in range(first, min(sessions, first + 64))])
        manager.step(worker, [Park(o.seq_id, commit_to=4 * BLOCK_SIZE) for o in opened.results])
        live += [o.seq_id for o in opened.results]
        if len(live) > sessions // 2:
            manager.step(worker, [Free(seq_id) for seq_id in live[:64]])
            del live[:64]
    for seq_id in live:                               # every session freed: what stays is what leaked
        manager.step(worker, [Free(seq_id)])
    gc.collect()
    results.put({"full_collections": counted.count, "longest_ms": counted.longest_s * 1e3,
                 "collected": counted.collected, "rss_after_mib": _rss_bytes(os.getpid()) / 2**20,
                 "total_ms": counted.seconds * 1e3, "freezes": counted.freezes,
                 "seconds": time.perf_counter() - started})


# ---- client processes (spawned) ----------------------------------------------

def client_main(kind: str, address: str, index: int, nclients: int, seconds: float,
                barrier: mp.synchronize.Barrier, results: mp.Queue, tag: int = 0) -> None:
    """Entry point of a spawned client; every outcome, failure included, goes to `results`."""
    # On uvloop, as inferd runs its client of memd; the anchor's client alike.
    try:
        if kind == "decode":
            results.put(uvloop.run(decode_client(address, index, nclients, seconds, barrier, tag)))
        elif kind in ("echo", "echo_stream"):
            results.put(uvloop.run(echo_client(address, index, seconds, barrier, streamed=kind == "echo_stream")))
        else:
            uvloop.run(victim_client(address, index, results))
    except BaseException as exc:
        barrier.abort()                       # release the others rather than leave them waiting
        results.put({"index": index, "error": f"{type(exc).__name__}: {exc}"})


async def decode_client(address: str, index: int, nclients: int, seconds: float,
                        barrier: mp.synchronize.Barrier, tag: int) -> dict:
    """Decode Steps on SEQS sequences for `seconds`; returns steps done and each Step's latency.

    `tag` (under 256) picks its token ids: every client of a bench run gets one of its own."""
    from shared.client import MemdClient  # imports torch: in the child, before the barrier

    # The control plane is measured, not K/V writes: no need to map the pool.
    client = await MemdClient.attach(address, name=f"bench-{index}", block_size=BLOCK_SIZE, map_memory=False)
    share = client.geometry.num_blocks // nclients // SEQS     # pages one sequence may hold
    limit = min(MAX_SEQ_TOKENS, (share - 1) * BLOCK_SIZE - 1)
    # Token ids no other client of this bench used: no prefix-cache hits, every page is new.
    base = tag << 24
    token = iter(range(base, base + (1 << 24)))
    # Staggered prompts, so sequences reach `limit` (free, reopen) in different Steps.
    opened = await client.step(*[Open([next(token) for _ in range(32 + 53 * i)], reserve=1) for i in range(SEQS)])
    seq_ids = [r.seq_id for r in opened]
    lengths = [32 + 53 * i for i in range(SEQS)]                # tokens known; each Extend commits all but the newest
    await asyncio.to_thread(barrier.wait, START_TIMEOUT_S)       # the loop keeps heartbeating meanwhile
    latencies: list[float] = []
    start = time.perf_counter()
    deadline = start + seconds
    while (now := time.perf_counter()) < deadline:
        ops = []
        for i in range(SEQS):
            if seq_ids[i] == 0:
                ops.append(Open([next(token) for _ in range(32)], reserve=1))
            elif lengths[i] >= limit:
                ops.append(Free(seq_ids[i]))
            else:   # K/V of the last token written, one token sampled: the decode-step shape
                ops.append(Extend(seq_ids[i], append=[next(token)], commit_to=lengths[i], reserve=1))
        results = await client.step(*ops)
        latencies.append(time.perf_counter() - now)
        for i, (op, result) in enumerate(zip(ops, results, strict=True)):
            if isinstance(op, Free):
                seq_ids[i] = 0
            elif isinstance(op, Open):
                seq_ids[i], lengths[i] = result.seq_id, len(op.token_ids)
            else:
                lengths[i] += 1
    elapsed = time.perf_counter() - start
    await client.step(*[Free(s) for s in seq_ids if s])    # parked sequences would hold pages for the next run
    await client.close()
    return {"index": index, "steps": len(latencies), "elapsed": elapsed, "latencies": latencies}


# ---- the anchor: gRPC's floor on the same socket kind ------------------------

ECHO_METHOD = "/bench.Echo/Echo"
ECHO_STREAM_METHOD = "/bench.Echo/EchoStream"


def step_messages() -> tuple[bytes, bytes]:
    """A decode Step's request and reply as memd's clients send and receive them (packed): 16 Extends, 16
    results."""
    from shared.ops import OpResult
    from shared.packed_steps import pack_ops, pack_results
    from shared.rpc import memd_pb2 as pb

    request = pb.StepRequest(worker_id=3, lease=os.urandom(16), packed_ops=pack_ops(
        [Extend(1000 + i, append=[123_456], commit_to=700 + i, reserve=1) for i in range(SEQS)]))
    reply = pb.StepReply(free_blocks=12_345, packed_results=pack_results(
        [OpResult(1000 + i, "running", 45, [9_000 + i], 46, 700 + i) for i in range(SEQS)]))
    return request.SerializeToString(), reply.SerializeToString()


def echo_server_main(address: str, reply_size: int, ready: mp.synchronize.Event) -> None:
    """A bare grpc.aio server on uvloop, as memd runs, answering `reply_size` bytes: to unary calls, and to each
    message of a stream (as memd's Steps call)."""
    import grpc

    async def serve() -> None:
        reply = bytes(reply_size)

        async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return reply

        async def echo_stream(requests: AsyncIterator[bytes],
                              context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            async for _ in requests:
                yield reply

        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "EchoStream": grpc.stream_stream_rpc_method_handler(echo_stream)})])
        server.add_insecure_port(address)
        await server.start()
        ready.set()
        await server.wait_for_termination()

    uvloop.run(serve())


async def echo_client(address: str, index: int, seconds: float, barrier: mp.synchronize.Barrier,
                      streamed: bool = False) -> dict:
    """Calls back to back, as a worker's Steps, carrying a Step's bytes each way: one unary call each, or
    (`streamed`) one message each way on a stream, each answered before the next is sent."""
    import grpc

    request, _ = step_messages()
    async with grpc.aio.insecure_channel(address) as channel:
        if streamed:
            stream = channel.stream_stream(ECHO_STREAM_METHOD)()

            async def call(message: bytes) -> None:
                await stream.write(message)
                await stream.read()
        else:
            call = channel.unary_unary(ECHO_METHOD)
        await call(request)
        await asyncio.to_thread(barrier.wait, START_TIMEOUT_S)
        latencies: list[float] = []
        start = time.perf_counter()
        deadline = start + seconds
        while (now := time.perf_counter()) < deadline:
            await call(request)
            latencies.append(time.perf_counter() - now)
        return {"index": index, "steps": len(latencies), "elapsed": time.perf_counter() - start,
                "latencies": latencies}


def bench_step_rate(ctx: mp.context.SpawnContext, tmp: Path, memd_address: str, seconds: float,
                    rounds: int) -> dict[str, dict]:
    """One client's Steps on memd against the anchor: one client of a bare echo server in its own process, a
    call each ("echo") and on one stream as Steps ride ("echo_stream").

    The three take turns, `rounds` times (which goes first alternates), `seconds` each in all: whatever
    else the machine does meanwhile weighs on all of them alike. Each result pools its rounds, and
    says each round's rate.
    """
    address, ready = f"unix:{tmp / 'echo.sock'}", ctx.Event()
    server = ctx.Process(target=echo_server_main, args=(address, len(step_messages()[1]), ready), daemon=True)
    server.start()
    try:
        if not ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the echo server did not start")
        targets = {"step": ("decode", memd_address), "echo": ("echo", address),
                   "echo_stream": ("echo_stream", address)}
        runs: dict[str, list[dict]] = {name: [] for name in targets}
        for r in range(rounds):
            for name in (list(targets) if r % 2 == 0 else list(reversed(targets))):
                kind, at = targets[name]
                procs, replies = run_clients(ctx, kind, at, 1, seconds / rounds)
                for proc in procs:
                    proc.join()
                runs[name] += replies
        return {name: {**summarise_steps(1, [_pooled(replies)]),
                       "rounds_steps_per_s": [x["steps"] / x["elapsed"] for x in replies]}
                for name, replies in runs.items()}
    finally:
        server.kill()
        server.join()


def _pooled(replies: list[dict]) -> dict:
    """One client's rounds as one run: its Steps over its time, every latency."""
    return {"index": 0, "steps": sum(r["steps"] for r in replies), "elapsed": sum(r["elapsed"] for r in replies),
            "latencies": [x for r in replies for x in r["latencies"]]}


async def victim_client(address: str, index: int, results: mp.Queue) -> None:
    """Hold SEQS running sequences with committed tokens, say so, and wait to be killed."""
    from shared.client import MemdClient

    client = await MemdClient.attach(address, name=f"victim-{index}", block_size=BLOCK_SIZE, map_memory=False)
    first = (index * SEQS + 1) * 100                            # distinct prompts: no shared pages
    opened = await client.step(*[Open(list(range(first + 100 * i, first + 100 * (i + 1))), reserve=1)
                                 for i in range(SEQS)])
    await client.step(*[Extend(r.seq_id, commit_to=100, reserve=1) for r in opened])
    results.put({"index": index, "worker_id": client.worker_id, "pid": os.getpid()})
    await asyncio.Event().wait()           # heartbeats go on until SIGKILL


def run_clients(ctx: mp.context.SpawnContext, kind: str, address: str, n: int, seconds: float) \
        -> tuple[list[mp.Process], list[dict]]:
    """Spawn `n` clients and collect one message from each (the decode result, or 'ready')."""
    barrier, results = ctx.Barrier(n), ctx.Queue()
    first = _tags[0]
    _tags[0] += n
    if _tags[0] > 256:
        raise RuntimeError("the bench ran out of token ranges for its clients (256)")
    procs = [ctx.Process(target=client_main, args=(kind, address, i, n, seconds, barrier, results, first + i),
                         daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    replies: list[dict] = []
    deadline = time.monotonic() + START_TIMEOUT_S + seconds
    while len(replies) < n:
        try:
            replies.append(results.get(timeout=0.5))    # a poll period for "did one die", not a wait
        except queue.Empty:
            if dead := [p.pid for p in procs if p.exitcode not in (None, 0)]:
                raise RuntimeError(f"client process {dead[0]} died without reporting") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n - len(replies)} client(s) did not report in time") from None
    if errors := [r["error"] for r in replies if "error" in r]:
        raise RuntimeError(f"client failed: {errors[0]}")
    return procs, sorted(replies, key=lambda r: r["index"])


def summarise_steps(nclients: int, replies: list[dict]) -> dict:
    lat = sorted(x * 1e3 for r in replies for x in r["latencies"])
    per_client = [r["steps"] / r["elapsed"] for r in replies]
    total = sum(per_client)
    return {"clients": nclients, "steps_per_s": total, "steps_per_s_per_client": total / nclients,
            "ops_per_s": total * SEQS, "lat_mean_ms": statistics.fmean(lat),
            "lat_p50_ms": lat[len(lat) // 2], "lat_p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))]}


# ---- memd as a subprocess ----------------------------------------------------

class Memd:
    """memd on CPU shared memory; its JSON log lines arrive, time-stamped on receipt, in `events`."""

    def __init__(self, tmp: Path, pool: str = POOL, page: str = PAGE, name: str = "memd", *flags: str) -> None:
        self.address = f"unix:{tmp / f'{name}.sock'}"
        self.proc = spawn_ready(["memd", "--device", "cpu", "--pool-bytes", pool, "--block-bytes", page,
                                 "--listen", self.address, "--log-format", "json", *flags],
                                tmp, timeout_s=START_TIMEOUT_S, stderr=subprocess.PIPE)
        self.events: queue.Queue[tuple[float, dict]] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:      # drained always: a full pipe would stall memd
            try:
                self.events.put((time.monotonic(), json.loads(line)))
            except json.JSONDecodeError:
                pass

    def wait_for(self, event: str, timeout: float = 30.0, **fields: object) -> tuple[float, dict]:
        deadline = time.monotonic() + timeout
        while True:
            at, e = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            if e.get("event") == event and all(e.get(k) == v for k, v in fields.items()):
                return at, e

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def bench_reclaim(ctx: mp.context.SpawnContext, memd: Memd, trials: int) -> list[float]:
    """Kill-to-"worker reclaimed" in ms, one victim per trial (all started together, killed in turn)."""
    procs, ready = run_clients(ctx, "victim", memd.address, trials, 0.0)
    out = []
    for p, victim in zip(procs, ready, strict=True):
        killed = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        seen, _ = memd.wait_for("worker reclaimed", worker=victim["worker_id"])
        out.append((seen - killed) * 1e3)
        p.join()
    return out


def bench_operator_calls(tmp: Path, pool: str, sessions: int, quiet: int) -> dict:
    """The longest a Step waits while `memctl snapshot`, then `memctl check`, read every block of a `pool`
    of 1 KiB pages.

    The pool holds `sessions` parked sessions of 4 blocks each, as a busy
    memd does. The probe Steps (open a sequence, free it) run back to back
    from this process; memctl runs as an operator runs it, in its own
    process (the snapshot written to a file). `quiet` Steps before it, with
    nothing else going on, are the baseline: about as many as a snapshot
    meets, so the longest of each is drawn from as many. A Step's wait also
    counts the host's other processes (three on two cores here), so memd's
    own account is read too: how long the call held its loop at a time
    (kvpool_memd_operator_hold_seconds). memd's resident memory is read
    meanwhile, against its size before.
    """
    port = free_port()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    memd = Memd(tmp, pool, "1KiB", "memd-snapshot", "--state-dir", "none", "--metrics-port", str(port))
    try:
        out = asyncio.run(_operator_probe(memd, tmp, sessions, quiet, metrics_url))
        metrics = scraped(metrics_url)
        out["memd_full_collections"] = metrics["kvpool_memd_gc_full_collections_total"]
        out["memd_longest_full_collection_ms"] = metrics["kvpool_memd_gc_longest_full_collection_seconds"] * 1e3
        out["memd_full_collected"] = metrics["kvpool_memd_gc_full_collected_objects_total"]
        return out
    finally:
        memd.kill()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _operator_probe(memd: Memd, tmp: Path, sessions: int, quiet_steps: int, metrics_url: str) -> dict:
    from shared.client import MemdClient

    client = await MemdClient.attach(memd.address, name="probe", block_size=BLOCK_SIZE, map_memory=False)
    tokens = iter(range(1 << 30))
    for first in range(0, sessions, 256):
        opened = await client.step(*[Open([next(tokens) for _ in range(4 * BLOCK_SIZE)], reserve=1,
                                          session_id=f"s{i}") for i in range(first, min(sessions, first + 256))])
        await client.step(*[Park(o.seq_id, commit_to=4 * BLOCK_SIZE) for o in opened])

    async def one_step() -> float:
        started = time.perf_counter()
        opened = await client.step(Open([next(tokens) for _ in range(16)], reserve=1))
        await client.step(Free(opened[0].seq_id))
        return (time.perf_counter() - started) / 2

    quiet = [await one_step() for _ in range(quiet_steps)]
    out = {"blocks": client.geometry.num_blocks, "sessions": sessions, "quiet_max_step_ms": max(quiet) * 1e3,
           "quiet_p50_step_ms": statistics.median(quiet) * 1e3, "quiet_p99_step_ms": _p99(quiet) * 1e3,
           "quiet_steps_over_10ms": sum(wait > 0.010 for wait in quiet), "quiet_steps": len(quiet)}
    for call in (["snapshot", "-o", str(tmp / "snap.msgpack")], ["check"]):
        steady = _rss_bytes(memd.proc.pid)
        holds_before = await asyncio.to_thread(scraped, metrics_url)
        memctl = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "memd.memctl", "--address", memd.address, *call,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        started = time.perf_counter()
        done = asyncio.ensure_future(memctl.wait())
        during: list[float] = []
        peak = steady
        while not done.done():
            during.append(await one_step())
            if len(during) % 16 == 0:
                peak = max(peak, _rss_bytes(memd.proc.pid))
        seconds = time.perf_counter() - started
        err = (await memctl.stderr.read()).decode() if memctl.stderr else ""
        if memctl.returncode != 0:
            raise RuntimeError(f"memctl {call[0]} failed: {err.strip()}")
        out[call[0]] = {"seconds": seconds, "steps_during": len(during), "max_step_wait_ms": max(during) * 1e3,
                        "p99_step_wait_ms": _p99(during) * 1e3, "steps_over_10ms": sum(w > 0.010 for w in during),
                        "memd_rss_mib": steady / 2**20, "memd_rss_ratio": peak / steady,
                        **_holds(holds_before, await asyncio.to_thread(scraped, metrics_url))}
    await client.close()
    return out


def _holds(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """memd's holds of its loop between two scrapes: how many, and the bucket bound every one of them is under."""
    name = "kvpool_memd_operator_hold_seconds"
    count = after[f"{name}_count"] - before[f"{name}_count"]
    buckets = sorted((float(key.split('"')[1]), key) for key in after if key.startswith(f"{name}_bucket{{"))
    under = [bound for bound, key in buckets if after[key] - before.get(key, 0.0) == count]
    return {"memd_holds": count, "memd_longest_hold_under_ms": under[0] * 1e3}


def _p99(waits: list[float]) -> float:
    return statistics.quantiles(waits, n=100)[98] if len(waits) > 1 else max(waits)


def compile_bytecode() -> None:
    """kvpool's modules compiled, as an installed kvpool has them (pip compiles a wheel's at install).

    A checkout's are compiled by the first import that may write them, and
    where PYTHONDONTWRITEBYTECODE is set (this machine's environment sets it)
    by every import: ~0.1 s of each start-up here, which a memd installed and
    run by systemd never spends. (Under __pycache__, which git ignores.)"""
    packages = [location for name in ("memd", "shared")
                for location in importlib.util.find_spec(name).submodule_search_locations]  # type: ignore[union-attr]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *packages], check=True, stdout=subprocess.DEVNULL)


def bench_startup(tmp: Path, pool: str, state_parent: str = "/dev/shm") -> dict:
    """Seconds from exec to READY=1 for a `pool` CPU pool with the default swap tier: as the unit runs it
    (its state directory on tmpfs: /run there, `state_parent` here), again on the files it left (a restart),
    and with --state-dir none (a memfd).
    Which pages the kernel gave the state directory's files (4 KiB or 2 MiB) is reported beside it."""
    out: dict = {"state_parent": state_parent, "huge_pages": huge_pages(Path(state_parent) / "pool")}
    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="memd-bench-state-", dir=state_parent) as state:
        for label, flags in (("state_dir", ["--state-dir", state]), ("restart", ["--state-dir", state]),
                             ("no_state_dir", ["--state-dir", "none"])):
            started = time.perf_counter()
            proc = spawn_ready(["memd", "--device", "cpu", "--pool-bytes", pool, "--listen",
                                f"unix:{tmp / f'start-{label}.sock'}", "--log-format", "json", *flags],
                               tmp, timeout_s=START_TIMEOUT_S, stderr=subprocess.DEVNULL)
            out[label] = time.perf_counter() - started
            proc.terminate()
            proc.wait()
    return out


def bench_startup_on_the_shipped_mount(tmp: Path, pool: str) -> dict:
    """Seconds to READY=1 for a `pool` CPU pool with its state directory on a tmpfs mounted with the options of
    the mount unit kvpool ships (systemd/dev-shm-kvpool\\x2dmemd.mount: 2 MiB pages), this user for kvpool's.
    Needs the right to mount (root): without it, says why it did not run. Run after `bench_startup`, which
    compiled kvpool's modules."""
    unit = configparser.ConfigParser(interpolation=None)
    unit.read(Path(__file__).resolve().parent.parent / "systemd" / "dev-shm-kvpool\\x2dmemd.mount")
    options = unit["Mount"]["Options"].replace("uid=kvpool", f"uid={os.getuid()}") \
        .replace("gid=kvpool", f"gid={os.getgid()}")
    where = tmp / "shipped-mount"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        return {"options": options, "skipped": mounted.stderr.strip() or f"mount exited {mounted.returncode}"}
    try:
        started = time.perf_counter()
        proc = spawn_ready(["memd", "--device", "cpu", "--pool-bytes", pool, "--listen",
                            f"unix:{tmp / 'start-mount.sock'}", "--log-format", "json", "--state-dir",
                            str(where / "state")], tmp, timeout_s=START_TIMEOUT_S, stderr=subprocess.DEVNULL)
        seconds = time.perf_counter() - started
        proc.terminate()
        proc.wait()
        return {"options": options, "huge_pages": huge_pages(where / "state" / "pool"), "seconds": seconds}
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


# ---- report ------------------------------------------------------------------

def report(res: dict) -> str:
    g = res["geometry"]
    head = (f"memd bench: {res['cores']} cores, Python {res['python']}, pool {POOL} of {PAGE} pages "
            f"({g['num_blocks']} blocks, {BLOCK_SIZE} tokens/block), {res['seconds']:g} s per measurement")
    alloc = table([["in-process allocator", "blocks/s"],
                   [f"KvManager.step open {BLOCKS_PER_SEQ} blocks + free", f"{res['manager_blocks_per_s']:,.0f}"]])
    alloc += "\n\n" + allocator_table(res["allocator"])
    j = res["journal"]
    alloc += "\n\n" + table([["journal flush (one Step's)", "parked sessions", "flushes", "p50 ms",
                               "rewriting: flushes", "max ms", "others: max ms", "with a full GC: n", "max ms"],
                              ["one decode token each", f"{j['parked']:,}", f"{j['flushes']:,}",
                               f"{j['p50_flush_ms']:.3f}", f"{j['rewriting_flushes']:,}",
                               f"{j['max_rewriting_flush_ms']:.2f}", f"{j['max_other_flush_ms']:.2f}",
                               str(j["collector_passes"]), f"{j['max_collected_flush_ms']:.2f}"]])
    alloc += "\n\n" + table([[f"journal flush (one decode Step's, {SEQS} sequences)", "context tokens", "p50 ms",
                               "max ms", "rewriting: flushes", "max ms"]] +
                             [["page checksums sent as pages fill" if c["page_sums"] else "no page checksums sent",
                               f"{c['context']:,}", f"{c['p50_flush_ms']:.3f}",
                               f"{c['max_flush_ms']:.2f}", str(c["rewriting_flushes"]),
                               f"{c['max_rewriting_flush_ms']:.2f}"] for c in res["journal_by_context"]])
    rows = [["Step RPC (16 Extend/Step)", "steps/s", "per client", "ops/s", "mean ms", "p50 ms", "p99 ms"]]
    for s in res["step_rpc"]:
        rows.append([f"{s['clients']} client process{'es' if s['clients'] > 1 else ''}",
                     f"{s['steps_per_s']:,.0f}", f"{s['steps_per_s_per_client']:,.0f}", f"{s['ops_per_s']:,.0f}",
                     f"{s['lat_mean_ms']:.3f}", f"{s['lat_p50_ms']:.3f}", f"{s['lat_p99_ms']:.3f}"])
    for label, e in (("anchor: bare grpc.aio echo, a call each, 1 client", res["echo"]),
                     ("anchor: the same on one stream (as Steps ride)", res["echo_stream"])):
        rows.append([label, f"{e['steps_per_s']:,.0f}", f"{e['steps_per_s']:,.0f}", "",
                     f"{e['lat_mean_ms']:.3f}", f"{e['lat_p50_ms']:.3f}", f"{e['lat_p99_ms']:.3f}"])
    by_round = res["step_rate_ratio_vs_echo_rounds"]
    rows.append(["1 client / echo, a call each", f"{res['step_rate_ratio_vs_echo']:.2f}x",
                 f"rounds {min(by_round):.2f}-{max(by_round):.2f}x" if len(by_round) > 1 else "", "", "", "", ""])
    rows.append(["1 client / echo on one stream", f"{res['step_rate_ratio_vs_stream_echo']:.2f}x", "", "", "", "", ""])
    ms = res["reclaim_ms"]
    reclaim = table([["worker reclaim (SIGKILL -> log)", "trials", "min ms", "median ms", "max ms"],
                     ["running worker, 16 sequences", str(len(ms)), f"{min(ms):.2f}",
                      f"{statistics.median(ms):.2f}", f"{max(ms):.2f}"]])
    op = res["operator"]
    calls = [["operator call (memctl, its own process)", "blocks", "parked sessions", "seconds", "Steps meanwhile",
             "longest Step ms", "p99 ms", "over 10 ms", "memd's loop held: times", "each under ms", "memd RSS MiB",
              "peak / steady"]]
    for name, what in (("snapshot", "snapshot, every block, to a file"), ("check", "check, every invariant")):
        o = op[name]
        calls.append([what, f"{op['blocks']:,}", f"{op['sessions']:,}", f"{o['seconds']:.2f}", str(o["steps_during"]),
                     f"{o['max_step_wait_ms']:.1f}", f"{o['p99_step_wait_ms']:.2f}", str(o["steps_over_10ms"]),
                     f"{o['memd_holds']:,.0f}", f"{o['memd_longest_hold_under_ms']:g}", f"{o['memd_rss_mib']:.0f}",
                     f"{o['memd_rss_ratio']:.2f}x"])
    calls.append(["quiet (before)", "", "", "", str(op["quiet_steps"]),
                  f"{op['quiet_max_step_ms']:.1f} (p50 {op['quiet_p50_step_ms']:.2f})",
                  f"{op['quiet_p99_step_ms']:.2f}", str(op["quiet_steps_over_10ms"]), "", "", "", ""])
    calls.append([f"memd's full garbage collections meanwhile: {op['memd_full_collections']:.0f} "
                  f"(unreachable objects found: {op['memd_full_collected']:.0f})", "", "", "", "",
                  f"longest {op['memd_longest_full_collection_ms']:.1f}", "", "", "", "", "", ""])
    snapshot = table(calls)
    fc = res["full_collections"]
    snapshot += "\n\n" + table(
        [[f"full garbage collections, {fc['sessions']:,} sessions opened (half freed again)", "collections",
          "longest ms", "total ms", "frozen after", "RSS MiB, all freed"]] +
        [[label, str(fc[key]["full_collections"]), f"{fc[key]['longest_ms']:.1f}", f"{fc[key]['total_ms']:.0f}",
          str(fc[key]["freezes"]), f"{fc[key]['rss_after_mib']:.0f}"]
         for key, label in (("python", "anchor: Python's collector as it comes"),
                            ("memd", "memd's policy (shared.full_collections)"))])
    start, shipped = res["startup"], res["startup_shipped_mount"]
    startup = table([[f"start-up to READY=1, {start['pool']} pool, default swap tier", "seconds"],
                     [f"state directory on tmpfs (as the unit): {start['state_parent']}, "
                      f"{'2 MiB' if start['huge_pages'] else '4 KiB'} pages", f"{start['state_dir']:.2f}"],
                     ["the same again: a restart on the files it left", f"{start['restart']:.2f}"],
                     ["--state-dir none", f"{start['no_state_dir']:.2f}"],
                     ["on a tmpfs mounted as kvpool's mount unit mounts it"
                      + (f" ({'2 MiB' if shipped['huge_pages'] else '4 KiB'} pages)" if "seconds" in shipped else ""),
                      f"{shipped['seconds']:.2f}" if "seconds" in shipped else f"not run: {shipped['skipped']}"]])
    return "\n\n".join([head, alloc, table(rows), reclaim, snapshot, startup])


def allocator_table(a: dict) -> str:
    if "vllm_unavailable" in a:
        return f"allocator vs vLLM: skipped ({a['vllm_unavailable']})"
    rows = [["16 blocks, µs per call", "pool blocks", "kvpool", f"vLLM {a['vllm']}", "ratio"]]
    for p in a["pools"]:
        for what, ours, theirs in (("BlockPool allocate", "kvpool_alloc16", "vllm_alloc16"),
                                   ("BlockPool free", "kvpool_free16", "vllm_free16"),
                                   ("free queue take", "kvpool_queue_alloc16", "vllm_queue_alloc16"),
                                   ("free queue give back", "kvpool_queue_free16", "vllm_queue_free16")):
            rows.append([what, f"{p['blocks']:,}", f"{p[ours + '_us']:.2f}", f"{p[theirs + '_us']:.2f}",
                         f"{p[ours + '_us'] / p[theirs + '_us']:.2f}x"])
    return table(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="length of each measurement (default: 3)")
    p.add_argument("--clients", type=int, default=8, help="client processes of the concurrent run (default: 8)")
    p.add_argument("--reclaim-trials", type=int, default=3, help="workers killed, one at a time (default: 3)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    p.add_argument("--quick", action="store_true", help="a short smoke run: checks the bench still runs")
    p.add_argument("--state-parent", default="/dev/shm",
                   help="tmpfs for the start-up run's state directory (default: /dev/shm; one mounted "
                        "huge=within_size measures memd on 2 MiB pages)")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.clients, args.reclaim_trials = 0.3, 2, 1
    geometry = plan_pool(parse_size(POOL), block_bytes=parse_size(PAGE))
    res: dict = {"cores": os.cpu_count(), "python": sys.version.split()[0], "seconds": args.seconds,
                 "geometry": {"num_blocks": geometry.num_blocks, "block_bytes": geometry.block_bytes}}
    res["manager_blocks_per_s"] = bench_manager(args.seconds)
    res["journal"] = bench_journal(1_000 if args.quick else 10_000, 24_000 if args.quick else 60_000)
    res["journal_max_rewrite_flush_ms"] = res["journal"]["max_rewriting_flush_ms"]
    res["journal_by_context"] = bench_journal_context((256,) if args.quick else (256, 4096, 32768))
    res["allocator"] = bench_allocator(100 if args.quick else 500, 3 if args.quick else 30, args.quick)
    res.update({k: v for k, v in res["allocator"].items() if k.endswith("_ratio_vs_vllm")})
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="memd-bench-") as tmp:
        memd = Memd(Path(tmp))
        try:
            rates = bench_step_rate(ctx, Path(tmp), memd.address, args.seconds, 1 if args.quick else ROUNDS)
            procs, replies = run_clients(ctx, "decode", memd.address, args.clients, args.seconds)
            for proc in procs:
                proc.join()
            res["step_rpc"] = [rates["step"], summarise_steps(args.clients, replies)]
            res["reclaim_ms"] = bench_reclaim(ctx, memd, args.reclaim_trials)
            res["echo"], res["echo_stream"] = rates["echo"], rates["echo_stream"]
            res["step_rate_ratio_vs_echo"] = res["step_rpc"][0]["steps_per_s"] / res["echo"]["steps_per_s"]
            res["step_rate_ratio_vs_stream_echo"] = \
                res["step_rpc"][0]["steps_per_s"] / res["echo_stream"]["steps_per_s"]
            res["step_rate_ratio_vs_echo_rounds"] = [
                a / b for a, b in zip(rates["step"]["rounds_steps_per_s"], rates["echo"]["rounds_steps_per_s"],
                                      strict=True)]
        finally:
            memd.kill()
        res["operator"] = bench_operator_calls(Path(tmp), "100MiB" if args.quick else "1GiB",
                                               512 if args.quick else 10_000, 200 if args.quick else 4_000)
        res["snapshot_1m_max_step_wait_ms"] = res["operator"]["snapshot"]["max_step_wait_ms"]
        res["snapshot_1m_memd_hold_under_ms"] = res["operator"]["snapshot"]["memd_longest_hold_under_ms"]
        res["check_1m_memd_hold_under_ms"] = res["operator"]["check"]["memd_longest_hold_under_ms"]
        res["check_1m_max_step_wait_ms"] = res["operator"]["check"]["max_step_wait_ms"]
        res["snapshot_memd_rss_ratio"] = res["operator"]["snapshot"]["memd_rss_ratio"]
        res["full_collections"] = bench_full_collections(ctx, 10_000 if args.quick else 100_000)
        res["full_collection_longest_ms"] = res["full_collections"]["memd"]["longest_ms"]
        pool = "512MiB" if args.quick else "8GiB"
        res["startup"] = {"pool": pool, **bench_startup(Path(tmp), pool, args.state_parent)}
        res["startup_shipped_mount"] = bench_startup_on_the_shipped_mount(Path(tmp), pool)
        if not args.quick:
            res["start_8gib_seconds"] = res["startup"]["state_dir"]
            if "seconds" in res["startup_shipped_mount"]:
                res["start_8gib_seconds_shipped_mount"] = res["startup_shipped_mount"]["seconds"]
    print(report(res))
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
