"""memd serving: its parts wired over the memory memd.startup allocated, gRPC, READY=1, until SIGTERM.

Imported while the kernel allocates the pool's pages (memd.startup).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from pathlib import Path

import grpc
import structlog
import zmq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from memd.access import AccessControl
from memd.assembly import Parts, assemble, new_manager
from memd.cluster import ClusterTier
from memd.cluster_lookup import Lookups
from memd.fdpass import FdServer
from memd.host_pages import huge_pages
from memd.interceptors import MEMD_SERVICE, RpcCounter, SerializedReplies
from memd.journal import Recovered, WriteAheadLog
from memd.kv_events import KvEvents
from memd.loop_lag import LoopLag
from memd.manager import KvManager
from memd.memory import PoolMemory, ShmMemory
from memd.metrics import MemdMetrics
from memd.quotas import QuotaError, Quotas
from memd.recovery import restore
from memd.scrub import Scrubber
from memd.service import MemdService
from memd.startup_plan import Startup, StartupError
from memd.state_copy import Pacer
from memd.state_dir import Layout, StateDir
from memd.swap import SwapMemory
from memd.token_files import Credentials
from shared import address as addr
from shared.cluster_store import ClusterConfig, ClusterError, ClusterStore
from shared.decoding import RequestDecoder
from shared.full_collections import freeze_long_lived
from shared.kv_event_endpoints import replay_beside
from shared.metrics_http import MetricsPortError
from shared.notify import keep_watchdog, notify, watchdog_interval
from shared.rpc import memd_pb2_grpc as pb_grpc
from shared.sizes import format_size

log = structlog.get_logger("memd")
SLOW_SMALL_PAGES_BYTES = 4 << 30     # a pool in 4 KiB pages this large takes over a second to allocate


def pool_status(manager: KvManager) -> str:
    """The STATUS= line systemctl status shows: pool use, swap use, sequences."""
    total, free = manager.geometry.num_blocks, manager.pool.num_free
    swap = f", swap {manager.swap.num_slots - manager.swap.num_free}/{manager.swap.num_slots}" if manager.swap else ""
    states = ", ".join(f"{n} {state}" for state, n in manager.state_counts().items() if n)
    return (f"pool {100 * (total - free) / total:.0f}% used ({total - free}/{total} blocks){swap}; "
            f"{len(manager.workers)} worker(s); sequences: {states or 'none'}")


async def serve_pool(startup: Startup, state: StateDir | None, found: Recovered | None, memory: PoolMemory,
                     swap: SwapMemory | None) -> None:
    """Recover, listen, say READY=1 once the pool's pages are allocated, serve until SIGTERM; everything opened
    is closed in reverse (the memory after all of it: memd.startup)."""
    args, geometry, settings, layout = startup.args, startup.geometry, startup.settings, startup.layout
    async with contextlib.AsyncExitStack() as stack:
        manager = new_manager(geometry, settings)
        try:
            manager.quotas = Quotas.load(args.quotas, state.path if state is not None else None,
                                         geometry.num_blocks)
        except QuotaError as exc:
            raise StartupError(str(exc)) from None
        wal = open_journal(args, state, layout, manager, memory, swap, found, stack)
        fd_server = await start_fd_server(memory, startup.sock_path, stack)
        parts = assemble(manager, settings, memory, swap, wal, fd_server)
        if args.cluster_master:
            await pages_allocated(memory)                   # the store registers the pool's pages
            await join_cluster(args, memory, parts, stack)   # left after the copier's fetches are done
        stack.push_async_callback(parts.runner.close)       # queued copies land before the pool goes
        stack.callback(parts.scrubber.close)
        if found is not None and getattr(memory, "reopened", False):
            await pages_allocated(memory)
            check_reopened(parts.scrubber)
        del found                  # the journal as read, every record's token ids a list of ints: adopted now
        stack.callback(parts.fences.close)
        lag = LoopLag()
        if args.metrics_port:         # before anything runs: a taken port fails start-up cleanly
            metrics = MemdMetrics(parts.service, asyncio.get_running_loop())
            try:
                metrics.serve(args.metrics_port, args.metrics_host)
            except MetricsPortError as exc:
                raise StartupError(str(exc)) from None
            parts.service.step_seconds = metrics.step_seconds
            Pacer.observe = metrics.operator_holds.observe
            lag.observe, metrics.loop_lag = metrics.loop_lag_seconds.observe, lag
        events = open_kv_events(args, manager, parts, stack)          # a taken port fails start-up too
        target, health_servicer = await start_server(parts.service, startup.credentials, startup.target,
                                                     startup.sock_path, stack)
        # What start-up made (modules, the recovered state) lives as long as memd: out of the collector's way,
        # so a full collection walks only what came after (it walked every import, tens of ms on the loop);
        # and what lives on later, once a long full collection finds it.
        freeze_long_lived()
        await pages_allocated(memory)          # the pool whole before READY=1, as the pool promises
        parts.fences.watch()                            # pages the workers of the memd before may still write
        tasks = [asyncio.create_task(parts.leases.reap_expired(), name="reaper"),
                 asyncio.create_task(parts.runner.police(), name="eviction-policy"),
                 asyncio.create_task(lag.watch(), name="loop-lag")]
        if args.scrub_interval:
            tasks.append(asyncio.create_task(scrub_every(parts.scrubber, args.scrub_interval, args.scrub_rate),
                                             name="scrub"))
        if (interval := watchdog_interval()) is not None:
            tasks.append(asyncio.create_task(keep_watchdog(interval, lambda: pool_status(manager)), name="watchdog"))
        stack.push_async_callback(_cancel, tasks)
        if events is not None:
            events.start()
        huge = huge_pages(state.pool if state is not None else None) if memory.backend == "shm" else None
        if huge is False and geometry.pool_bytes >= SLOW_SMALL_PAGES_BYTES:
            log.info("the pool is in 4 KiB pages, which the kernel allocates one at a time (seconds before READY "
                     "for a pool this size): a state directory on a tmpfs mounted with huge=within_size takes "
                     "2 MiB pages, allocated in a fraction of that (kvpool's dev-shm-kvpool\\x2dmemd.mount mounts "
                     "one at /dev/shm/kvpool-memd)", pool=format_size(geometry.pool_bytes))
        log.info("memd ready", listen=target, backend=memory.backend, device=memory.device,
                 num_blocks=geometry.num_blocks, block_bytes=geometry.block_bytes,
                 bytes_per_token=geometry.bytes_per_token, block_size=geometry.block_size,
                 pool=format_size(geometry.pool_bytes), lease_timeout_s=args.lease_timeout,
                 swap=format_size(layout.swap_slots * geometry.block_bytes) if swap else "off",
                 swap_locked="locking in the background" if swap is not None and swap.locked is None
                 else getattr(swap, "locked", None), idle_ttl_s=args.idle_ttl,
                 state_dir=str(state.path) if state is not None else "none",
                 swap_non_temporal="x86_non_temporal_threshold" in os.environ.get("GLIBC_TUNABLES", ""),
                 pool_pages=None if huge is None else "2 MiB" if huge else "4 KiB",
                 pool_files=len(getattr(memory, "stripes", ())) or None,
                 metrics=f"http://{args.metrics_host}:{args.metrics_port}/metrics" if args.metrics_port else "off",
                 kv_events=events.endpoint if events is not None else "off")
        if state is not None:
            state.served = True
        stop = stop_on_signals()              # before READY=1: a SIGTERM right after it must stop memd cleanly
        notify("READY=1", f"STATUS=pool {format_size(geometry.pool_bytes)}, {geometry.num_blocks} blocks, "
                          f"listening on {target}")
        await stop.wait()
        log.info("memd stopping")
        notify("STOPPING=1")
        await health_servicer.enter_graceful_shutdown()


def open_kv_events(args: argparse.Namespace, manager: KvManager, parts: Parts,
                   stack: contextlib.AsyncExitStack) -> KvEvents | None:
    """--kv-events: bind the publisher (and its replay socket); its batches follow every committed Step."""
    if not args.kv_events:
        return None
    replay = args.kv_events_replay or replay_beside(args.kv_events)
    try:
        events = KvEvents(manager, args.kv_events, replay, args.kv_events_topic)
    except zmq.ZMQError as exc:
        raise StartupError(f"cannot publish KV events on {args.kv_events} (replay {replay}): {exc}") from None
    stack.push_async_callback(events.close)
    parts.runner.after_step.append(events.after_step)
    return events


async def join_cluster(args: argparse.Namespace, memory: PoolMemory, parts: Parts,
                       stack: contextlib.AsyncExitStack) -> None:
    """--cluster-master: join the Mooncake store; parked sessions are published to it from now on.

    A store that does not answer yet does not keep memd from serving: it is an
    optional, remote tier, and one that dies later costs only a recompute too.
    memd starts without it and joins it in the background (memd.cluster).
    """
    if not args.cluster_metadata:
        raise StartupError("--cluster-master needs --cluster-metadata (the store's HTTP metadata server URL)")
    if not isinstance(memory, ShmMemory):
        raise StartupError("the cluster tier serves CPU (shared-memory) pools for now; use --device cpu")
    config = ClusterConfig(args.cluster_master, args.cluster_metadata, args.cluster_host, args.cluster_segment,
                           args.cluster_replicas)
    store = ClusterStore(config, memory.base, memory.size, parts.manager.geometry.block_bytes)
    tier = ClusterTier(parts.manager, store)
    try:
        joined = await tier.join()
    except ClusterError as exc:
        store.close()
        raise StartupError(str(exc)) from None
    stack.push_async_callback(tier.close)
    parts.runner.after_step.append(tier.after_step)      # before it is joined: each park counts an error
    parts.service.cluster_status = tier.status

    def looking_up() -> None:
        parts.runner.lookups = Lookups(parts.manager, store)
        parts.runner.copier.remote = store
        log.info("joined the cluster store", master=config.master, metadata=config.metadata,
                 segment=format_size(config.segment_bytes), replicas=config.replicas)

    if joined:
        looking_up()
    else:
        tier.join_later(looking_up)


def check_reopened(scrubber: Scrubber) -> None:
    """Pages reopened from the state directory are checked before anyone may resume them."""
    report = scrubber.check_reopened()
    if report.pages:
        log.info("checked the reopened pages", pages=report.pages, failed=len(report.failures),
                 seconds=round(report.seconds, 3))


async def scrub_every(scrubber: Scrubber, interval_s: float, rate_mb_s: float) -> None:
    """--scrub-interval: a scrub pass every `interval_s` seconds, at `rate_mb_s`."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await scrubber.scrub(rate_mb_s * 1e6)
        except Exception:                   # one failed pass must not end the periodic scrubbing
            log.exception("a periodic scrub failed; the next one runs on time")


async def pages_allocated(memory: PoolMemory) -> None:
    """Every page of the pool allocated; PoolMemoryError (memd does not start) if not. (The swap file's come
    after them, and nothing before READY=1 waits for those: a swap copy does.)"""
    await asyncio.to_thread(memory.allocated)


def open_journal(args: argparse.Namespace, state: StateDir | None, layout: Layout, manager: KvManager,
                 memory: PoolMemory, swap: SwapMemory | None, found: Recovered | None,
                 stack: contextlib.AsyncExitStack) -> WriteAheadLog | None:
    """Adopt what the memd before left (if its files were reopened), then start a fresh journal."""
    if state is None:
        return None
    if found is not None:
        restored = restore(found, pool_kept=getattr(memory, "reopened", False),
                           swap_kept=getattr(swap, "reopened", False), num_blocks=layout.num_blocks,
                           num_slots=layout.swap_slots)
        manager.adopt(restored.sequences, found.max_seq_id + 1, restored.fences, restored.slot_checksums,
                      restored.block_checksums)
        log.info("recovered the sequences of the memd before", state_dir=str(state.path),
                 sequences=restored.by_state, dropped=restored.dropped, discarded=restored.discarded,
                 fenced={pid: len(b) for pid, b in restored.fences.items()},
                 torn_record=found.torn, previous_pid=found.header.get("pid"))
    wal = WriteAheadLog(state, layout, fsync=args.journal_fsync == "always")
    try:
        if found is not None and resumable(found, layout, state):
            wal.resume(manager, found, restored.changed)
        else:
            wal.checkpoint(manager)
    except OSError as exc:
        raise StartupError(f"cannot write the journal in {state.path}: {exc.strerror}") from None
    state.unmark_new()
    stack.callback(wal.close)
    return wal


def resumable(found: Recovered, layout: Layout, state: StateDir) -> bool:
    """Whether the journal found describes the pool and swap tier memd reopened, in this memd's format: then
    memd goes on appending to it, else it writes a fresh one before it serves."""
    if any(state.made_new(what).exists() for what in ("pool", "swap")):
        return False
    now = layout.header()
    return all(found.header.get(key) == now[key] for key in ("format", "version", "backend", "num_blocks",
                                                             "block_bytes", "swap_slots", "boot_id"))


async def start_fd_server(memory: PoolMemory, sock_path: Path | None,
                          stack: contextlib.AsyncExitStack) -> FdServer | None:
    """The side socket that hands the pool's memfd to workers (shm only), up before the first Attach."""
    if memory.backend != "shm":
        return None
    fd_path = Path(f"{sock_path}.fd") if sock_path else addr.runtime_dir() / f"memd-{os.getpid()}.fd"
    fd_path.parent.mkdir(mode=0o700, exist_ok=True)      # beside the socket, or kvpool's runtime directory
    fd_server = FdServer(fd_path, memory.fds)  # type: ignore[attr-defined]
    await fd_server.start()
    stack.push_async_callback(fd_server.close)
    return fd_server


async def start_server(service: MemdService, credentials: Credentials, target: str, sock_path: Path | None,
                       stack: contextlib.AsyncExitStack) -> tuple[str, health.aio.HealthServicer]:
    """Listen with access control, health and reflection; returns the address listened on."""
    server = grpc.aio.server(interceptors=[AccessControl(credentials), RpcCounter(service.rpcs),
                                           RequestDecoder(iterated=frozenset({"Steps"})), SerializedReplies()],
                             options=[
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 256 << 20),
        ("grpc.so_reuseport", 0),
    ])
    pb_grpc.add_MemdServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [MEMD_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        port = server.add_insecure_port(target)
    except RuntimeError:
        raise StartupError(f"cannot listen on {target}") from None
    if sock_path is None and target.endswith(":0"):
        target = f"{target[:-2]}:{port}"          # report the port the kernel chose
    await server.start()
    if sock_path is not None:
        os.chmod(sock_path, 0o660)
        stack.callback(_unlink, sock_path)
    stack.push_async_callback(server.stop, 2.0)
    for name in ("", MEMD_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return target, health_servicer


def stop_on_signals() -> asyncio.Event:
    """Set on SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
