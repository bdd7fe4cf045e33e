"""memd: flags, start-up, signals, readiness.

Start-up order matters: size the pool, allocate all of it (fail fast), listen,
and only then say READY=1 (systemd) — a worker that sees memd ready can attach.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from memd.access import AccessControl, AccessError, Credentials, provision, remove_if_ours
from memd.cluster import ClusterTier
from memd.cluster_lookup import Lookups
from memd.fdpass import FdServer
from memd.host_pages import huge_pages
from memd.interceptors import MEMD_SERVICE, RpcCounter, SerializedReplies
from memd.journal import Recovered, WriteAheadLog
from memd.manager import KvManager
from memd.memory import (
    PoolMemory,
    PoolMemoryError,
    ShmMemory,
    allocate_pool,
    available_host_memory,
    kept_file,
    pool_kept,
    resolve_device,
)
from memd.metrics import MemdMetrics
from memd.recovery import restore
from memd.scrub import Scrubber
from memd.service import MemdService
from memd.state import TMPFS, Layout, StateDir, StateError, boot_id
from memd.swap import SwapMemory, allocate_swap
from memd.wiring import Parts, Policy, new_manager, wire
from shared import address as addr
from shared.cluster_store import ClusterConfig, ClusterError, ClusterStore
from shared.command_line import Ignored, Parser, entry_point
from shared.config import Layers, add_config_flags
from shared.decoding import RequestDecoder
from shared.flag_types import byte_size, count, number, port, seconds, seconds_or_zero
from shared.geometry import GeometryError, PoolGeometry, plan_pool, read_model_shape
from shared.logs import configure
from shared.metrics_http import MetricsPortError
from shared.notify import keep_watchdog, notify, watchdog_interval
from shared.pool_files import stripe_sizes
from shared.rpc import memd_pb2_grpc as pb_grpc
from shared.sizes import format_size, parse_size
from shared.unix_socket import SocketPathError, claim

log = structlog.get_logger("memd")
MAX_UNIX_PATH = 108        # sun_path, including the terminating NUL
NO_STATE = Path("none")    # --state-dir none
SLOW_SMALL_PAGES_BYTES = 4 << 30     # a pool in 4 KiB pages this large takes over a second to allocate


class StartupError(RuntimeError):
    """memd cannot start as configured; the message says why in one line."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="memd", description="kvpool's KV block pool daemon.", version=True)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    p.add_argument("--pool-bytes", type=byte_size(), default=parse_size("256MiB"),
                   help="memory for KV pages, e.g. 64MiB, 20GiB (default: 256MiB)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--block-bytes", type=byte_size(), help="bytes of one page (default: 64KiB)")
    size.add_argument("--model", type=Path, help="Hugging Face model dir: derive the page from its config.json")
    p.add_argument("--block-size", type=count(), default=16, help="tokens per block with --model (default: 16)")
    p.add_argument("--dtype", help="KV dtype with --model (default: the config's torch_dtype)")
    p.add_argument("--listen", help=f"unix:PATH or HOST:PORT (default: {addr.default_address()})")
    p.add_argument("--lease-timeout", type=seconds, default=10.0,
                   help="seconds without heartbeats before a worker is reclaimed (default: 10)")
    p.add_argument("--heat-decay", type=number(above=0, at_most=1), default=0.9,
                   help="heat factor per interval, in (0, 1] (default: 0.9)")
    p.add_argument("--heat-interval", type=seconds, default=10.0, help="seconds per heat decay (default: 10)")
    p.add_argument("--swap-ratio", type=number(at_least=0), default=0.3,
                   help="host swap tier as a fraction of the pool, allocated and locked at start-up (default: 0.3)")
    p.add_argument("--disable-swap", action="store_true", help="no swap tier: evicted sequences are dropped")
    p.add_argument("--idle-ttl", type=seconds_or_zero, default=300.0,
                   help="drop parked and swapped sequences idle this many seconds; 0 = never (default: 300)")
    p.add_argument("--free-watermark", type=number(at_least=0, below=1), default=0.02,
                   help="keep this fraction of blocks free by evicting cold parked sequences (default: 0.02)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="never share blocks between sequences by content: every new sequence computes its whole "
                        "prompt (a session's parked history is still resumed); for measuring what the cache is worth")
    p.add_argument("--token-file", type=Path,
                   help="the worker token (group-readable): kept if it exists, else written; required with TCP "
                        "(default: a fresh one at every start, next to the socket: SOCKET.token)")
    p.add_argument("--admin-token-file", type=Path,
                   help="the admin token (owner-only), as --token-file (default: SOCKET.admin-token)")
    p.add_argument("--state-dir", type=Path,
                   help="where the pool file, swap file and journal live, so parked sessions outlive a memd crash "
                        "or restart; put it on tmpfs; 'none' = keep nothing (default: SOCKET.state beside a Unix "
                        "socket, none on TCP)")
    p.add_argument("--journal-fsync", default="never", choices=["never", "always"],
                   help="fsync the journal after every change: only worth it on a disk, not on tmpfs (default: never)")
    p.add_argument("--scrub-interval", type=seconds_or_zero, default=0.0,
                   help="check every parked, cached and swapped page against its checksum this often, in "
                        "seconds, as memctl scrub does; 0 = only when asked (default: 0)")
    p.add_argument("--scrub-rate", type=number(above=0), default=200.0,
                   help="MB/s a periodic scrub hashes at most (default: 200)")
    cluster = p.add_argument_group("cluster tier (Mooncake Store; needs kvpool[cluster])")
    cluster.add_argument("--cluster-master", metavar="HOST:PORT",
                         help="join the Mooncake store whose mooncake_master listens here: parked sessions are "
                              "published to it (default: off, this host only)")
    cluster.add_argument("--cluster-metadata", metavar="URL",
                         help="the store's HTTP metadata server, e.g. http://HOST:8080/metadata (required with "
                              "--cluster-master)")
    cluster.add_argument("--cluster-host", default="",
                         help="this host's name or address for the store's transfer engine (default: the host name)")
    cluster.add_argument("--cluster-segment", type=byte_size(), default=parse_size("256MiB"),
                         help="memory this memd contributes to the store (default: 256MiB)")
    cluster.add_argument("--cluster-replicas", type=count(), default=2,
                         help="copies of each object, on different hosts' segments (default: 2)")
    p.add_argument("--metrics-port", type=port, default=0,
                   help="serve Prometheus metrics over HTTP on this port; 0 = off (default: 0)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port (default: 127.0.0.1)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    add_config_flags(p, "MEMD")
    return p


# Settings that do nothing in some company: memd says so at start rather than leave the operator guessing.
IGNORED = (
    Ignored("block_size", "it sizes the page from --model (with --block-bytes each worker says its own)",
            without="model"),
    Ignored("dtype", "it sizes the page from --model", without="model"),
    Ignored("swap_ratio", "--disable-swap leaves no swap tier", alongside="disable_swap"),
    Ignored("scrub_rate", "it paces the periodic scrub, which --scrub-interval turns on", without="scrub_interval"),
    Ignored("metrics_host", "metrics are off without --metrics-port", without="metrics_port"),
    *(Ignored(flag, "the cluster tier is off without --cluster-master", without="cluster_master")
      for flag in ("cluster_metadata", "cluster_host", "cluster_segment", "cluster_replicas")),
)


def plan(args: argparse.Namespace) -> PoolGeometry:
    if args.model is not None:
        shape = read_model_shape(args.model, args.dtype)
        return plan_pool(args.pool_bytes, shape=shape, block_size=args.block_size)
    return plan_pool(args.pool_bytes, block_bytes=args.block_bytes or parse_size("64KiB"))


def prepare_socket(target: str) -> Path | None:
    """The Unix socket to listen on, free to bind (shared/unix_socket.py); None for TCP."""
    path = addr.unix_path(target)
    if path is None:
        return None
    if len(os.fsencode(f"{path}.fd")) >= MAX_UNIX_PATH:
        raise StartupError(f"socket path {path} is too long for a Unix socket (with .fd, under {MAX_UNIX_PATH} bytes)")
    try:
        claim(path, "memd")
    except SocketPathError as exc:
        raise StartupError(str(exc)) from None
    return path


def credentials_for(args: argparse.Namespace, sock_path: Path | None) -> Credentials:
    """Token files: the operator's (kept), or fresh ones next to the Unix socket. TCP needs the operator's."""
    if sock_path is None and (args.token_file is None or args.admin_token_file is None):
        raise StartupError("listening on TCP needs --token-file and --admin-token-file: clients on other hosts "
                           "present a copy of the token ($KVPOOL_TOKEN_FILE)")
    worker = args.token_file or Path(f"{sock_path}.token")
    admin = args.admin_token_file or Path(f"{sock_path}.admin-token")
    return provision(worker, admin, keep_worker=args.token_file is not None,
                     keep_admin=args.admin_token_file is not None)


def pool_status(manager: KvManager) -> str:
    """The STATUS= line systemctl status shows: pool use, swap use, sequences."""
    total, free = manager.geometry.num_blocks, manager.pool.num_free
    swap = f", swap {manager.swap.num_slots - manager.swap.num_free}/{manager.swap.num_slots}" if manager.swap else ""
    states = ", ".join(f"{n} {state}" for state, n in manager.state_counts().items() if n)
    return (f"pool {100 * (total - free) / total:.0f}% used ({total - free}/{total} blocks){swap}; "
            f"{len(manager.workers)} worker(s); sequences: {states or 'none'}")


@dataclass(frozen=True, slots=True)
class Startup:
    """What start-up settled before allocating anything: flags, pool plan, address, tokens."""

    args: argparse.Namespace
    geometry: PoolGeometry
    policy: Policy
    device: str                     # "cpu" or "cuda[:N]", resolved
    layout: Layout
    target: str                     # the address to listen on
    sock_path: Path | None          # its Unix socket, if it is one
    credentials: Credentials


async def serve(args: argparse.Namespace, geometry: PoolGeometry) -> None:
    target = addr.resolve(args.listen)
    sock_path = prepare_socket(target)
    credentials = credentials_for(args, sock_path)
    try:
        policy = Policy.from_args(args)
        device = resolve_device(args.device)
        layout = Layout("shm" if device == "cpu" else "cuda", geometry.num_blocks, geometry.block_bytes,
                        policy.swap_slots(geometry))
        await run_pool(Startup(args, geometry, policy, device, layout, target, sock_path, credentials))
    finally:                          # token files we wrote go with us, also when start-up fails
        for path, token, kept in ((credentials.worker_file, credentials.worker, args.token_file),
                                  (credentials.admin_file, credentials.admin, args.admin_token_file)):
            if kept is None:
                remove_if_ours(path, token)


def open_state(args: argparse.Namespace, sock_path: Path | None, layout: Layout) -> tuple[StateDir | None,
                                                                                     Recovered | None]:
    """The state directory, locked, and what the memd before this one left in it.

    A journal that cannot be read, or pool and swap files without one, are
    removed (logged): they cannot be trusted, and they hold memory.
    """
    path = args.state_dir
    if path is None and sock_path is not None:
        path = Path(f"{sock_path}.state")
    if path is None or path == NO_STATE:
        return None, None
    state = StateDir(path)
    state.lock()
    try:
        found = state.read()
    except StateError as exc:
        state.discard(str(exc))
        return state, None
    if found is None:
        state.discard("pool files without a journal")
        return state, None
    h = found.header
    # Pages on a disk may have outlived the machine, half written: another boot's are not reopened either.
    files_usable = layout.backend == "shm" and h.get("boot_id") == boot_id()
    sizes = stripe_sizes(layout.num_blocks * layout.block_bytes)
    if not files_usable or state.made_new("pool").exists() or (h.get("backend"), h.get("num_blocks"),
                                                                 h.get("block_bytes")) != \
            (layout.backend, layout.num_blocks, layout.block_bytes):
        state.remove_pool()              # another pool now, or files the journal never saw: no pages of its
    else:                                # before memd counts the memory it needs: an older memd's one file goes
        state.keep_pool(sizes)
    if not files_usable or state.made_new("swap").exists() or (h.get("swap_slots"), h.get("block_bytes")) != \
            (layout.swap_slots, layout.block_bytes):
        with contextlib.suppress(FileNotFoundError):
            state.swap.unlink()
    # What this start makes anew is not the found journal's until its own journal is written (open_journal).
    if layout.backend == "shm":
        if not pool_kept(state.pool, layout.num_blocks, layout.block_bytes):
            state.mark_new("pool")
        if layout.swap_slots and not kept_file(state.swap, layout.swap_slots * layout.block_bytes):
            state.mark_new("swap")
    return state, found


def check_room(state: StateDir, needed: int) -> None:
    """The pool and swap files must fit their file system (a /run tmpfs is often 10-20% of RAM)."""
    have = sum(p.stat().st_size for p in (*state.pool_files(), state.swap) if p.exists())
    memory = available_host_memory()
    if memory is not None and needed - have > memory:
        return                                   # allocating says it better: the host has not the memory
    st = os.statvfs(state.path)
    free = st.f_bavail * st.f_frsize
    if needed - have > free - (16 << 20):      # and room for the journal
        raise StartupError(f"the state directory {state.path} has {format_size(free)} free; the pool and swap tier "
                           f"need {format_size(needed)}: give its file system room (tmpfs size=), point --state-dir "
                           "at a directory of memd's own on /dev/shm, or use --state-dir none")


async def run_pool(startup: Startup) -> None:
    state, found = open_state(startup.args, startup.sock_path, startup.layout)
    try:
        await serve_pool(startup, state, found)
    except BaseException:
        if state is not None and found is None and not state.served:
            state.forget()          # what a start that never served made: it holds memory and nothing else
        elif state is not None and not state.served:
            state.remove_new()      # the files it made anew, beside the journal before it (kept)
        raise


async def serve_pool(startup: Startup, state: StateDir | None, found: Recovered | None) -> None:
    """Allocate, recover, listen, say READY=1, serve until SIGTERM; everything opened is closed in reverse."""
    args, geometry, policy, device, layout = startup.args, startup.geometry, startup.policy, startup.device, \
        startup.layout
    async with contextlib.AsyncExitStack() as stack:
        memory, swap = allocate_memory(device, geometry, layout, state, stack)
        manager = new_manager(geometry, policy)
        wal = open_journal(args, state, layout, manager, memory, swap, found, stack)
        fd_server = await start_fd_server(memory, startup.sock_path, stack)
        parts = wire(manager, policy, memory, swap, wal, fd_server)
        if args.cluster_master:
            await pages_allocated(memory)                   # the store registers the pool's pages
            await join_cluster(args, memory, parts, stack)   # left after the copier's fetches are done
        stack.push_async_callback(parts.runner.close)       # queued copies land before the pool goes
        stack.callback(parts.scrubber.close)
        if found is not None and getattr(memory, "reopened", False):
            await pages_allocated(memory)
            check_reopened(parts.scrubber)
        stack.callback(parts.fences.close)
        if args.metrics_port:         # before anything runs: a taken port fails start-up cleanly
            metrics = MemdMetrics(parts.service, asyncio.get_running_loop())
            metrics.serve(args.metrics_port, args.metrics_host)
            parts.service.step_seconds = metrics.step_seconds
        target, health_servicer = await start_server(parts.service, startup.credentials, startup.target,
                                                     startup.sock_path, stack)
        await pages_allocated(memory)          # the pool whole before READY=1, as the pool promises
        parts.fences.watch()                            # pages the workers of the memd before may still write
        tasks = [asyncio.create_task(parts.leases.reap_expired(), name="reaper"),
                 asyncio.create_task(parts.runner.police(), name="eviction-policy")]
        if args.scrub_interval:
            tasks.append(asyncio.create_task(scrub_every(parts.scrubber, args.scrub_interval, args.scrub_rate),
                                             name="scrub"))
        if (interval := watchdog_interval()) is not None:
            tasks.append(asyncio.create_task(keep_watchdog(interval, lambda: pool_status(manager)), name="watchdog"))
        stack.push_async_callback(_cancel, tasks)
        huge = huge_pages(state.pool if state is not None else None) if memory.backend == "shm" else None
        if huge is False and geometry.pool_bytes >= SLOW_SMALL_PAGES_BYTES:
            log.info("the pool is in 4 KiB pages, which the kernel allocates one at a time (seconds before READY "
                     "for a pool this size): a state directory on a tmpfs mounted with huge=within_size takes "
                     "2 MiB pages, allocated in a fraction of that", pool=format_size(geometry.pool_bytes))
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
                 metrics=f"http://{args.metrics_host}:{args.metrics_port}/metrics" if args.metrics_port else "off")
        if state is not None:
            state.served = True
        stop = stop_on_signals()              # before READY=1: a SIGTERM right after it must stop memd cleanly
        # What start-up made (modules, the recovered state) lives as long as memd: out of the collector's way,
        # so a full collection walks only what came after (it walked every import, tens of ms on the loop).
        gc.collect()
        gc.freeze()
        notify("READY=1", f"STATUS=pool {format_size(geometry.pool_bytes)}, {geometry.num_blocks} blocks, "
                          f"listening on {target}")
        await stop.wait()
        log.info("memd stopping")
        notify("STOPPING=1")
        await health_servicer.enter_graceful_shutdown()


async def join_cluster(args: argparse.Namespace, memory: PoolMemory, parts: Parts,
                       stack: contextlib.AsyncExitStack) -> None:
    """--cluster-master: join the Mooncake store; parked sessions are published to it from now on."""
    if not args.cluster_metadata:
        raise StartupError("--cluster-master needs --cluster-metadata (the store's HTTP metadata server URL)")
    if not isinstance(memory, ShmMemory):
        raise StartupError("the cluster tier serves CPU (shared-memory) pools for now; use --device cpu")
    config = ClusterConfig(args.cluster_master, args.cluster_metadata, args.cluster_host, args.cluster_segment,
                           args.cluster_replicas)
    store = ClusterStore(config, memory.base, memory.size, parts.manager.geometry.block_bytes)
    try:
        await store.start()
    except ClusterError as exc:
        store.close()
        raise StartupError(str(exc)) from None
    tier = ClusterTier(parts.manager, store)
    parts.runner.after_step.append(tier.after_step)
    parts.runner.lookups = Lookups(parts.manager, store)
    parts.runner.copier.remote = store
    parts.service.cluster_status = tier.status
    stack.push_async_callback(tier.close)
    log.info("joined the cluster store", master=config.master, metadata=config.metadata,
             segment=format_size(config.segment_bytes), replicas=config.replicas)


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


def allocate_memory(device: str, geometry: PoolGeometry, layout: Layout, state: StateDir | None,
                    stack: contextlib.AsyncExitStack) -> tuple[PoolMemory, SwapMemory | None]:
    """The pool and swap tier, all of it (fail fast); in the state directory's files where there is one.

    A shm pool's pages are allocated on threads of their own (its files side
    by side) while start-up goes on (the journal, the sockets), and memd waits
    for them before READY=1 (`pages_allocated`): an 8 GiB pool is ~3 s of a
    core of the kernel's page bookkeeping here. A swap file's pages come
    after the pool's, READY=1 does not wait for them, a swap copy does.
    """
    swap_slots = layout.swap_slots
    keep_files = state is not None and layout.backend == "shm"
    if keep_files:
        check_room(state, geometry.pool_bytes + swap_slots * geometry.block_bytes)
    memory = allocate_pool(device, geometry.num_blocks, geometry.block_bytes, state.pool if keep_files else None,
                           background=True)
    stack.callback(memory.close)
    swap = allocate_swap(memory, swap_slots, geometry.block_bytes,
                         state.swap if keep_files else None) if swap_slots else None
    if swap is not None:
        stack.callback(swap.close)
    if isinstance(memory, ShmMemory):
        stack.callback(memory.allocation.cancel)    # first: a stop mid-allocation waits for no more of it
    if keep_files and (fs := state.filesystem()) not in TMPFS and geometry.pool_bytes >= 1 << 30:
        # Correct either way, but a large pool's pages written back to a disk cost I/O for nothing.
        log.warning("the state directory is not on tmpfs: the kernel writes the pool's pages back to its "
                    "disk; use a directory under /run or /dev/shm", state_dir=str(state.path), filesystem=fs)
    return memory, swap


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
        wal.checkpoint(manager)
    except OSError as exc:
        raise StartupError(f"cannot write the journal in {state.path}: {exc.strerror}") from None
    state.unmark_new()
    stack.callback(wal.close)
    return wal


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


@entry_point("memd")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    layers = Layers(parser, "MEMD")
    args = parser.parse_args(argv)
    if (done := layers.settle(args, "memd", IGNORED)) is not None:
        return done
    configure(args.log_level, args.log_format)
    try:
        geometry = plan(args)
        uvloop.run(serve(args, geometry))
    except (GeometryError, PoolMemoryError, StartupError, MetricsPortError, AccessError, StateError) as exc:
        print(f"memd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
