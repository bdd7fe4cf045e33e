"""memd's start-up, up to its pool's pages being allocated: then memd.daemon is imported and serves.

Start-up order matters: size the pool, allocate all of it (fail fast), listen,
and only then say READY=1 (systemd) — a worker that sees memd ready can attach.
Allocating a large CPU pool's pages is the kernel's work, on threads of their
own (`allocate_memory`), and most of start-up: ~1.5 s of an 8 GiB pool's ~2 s
to READY on this 2-core machine. So this module imports only what reading
the state directory and allocating need, and the modules memd serves with
(gRPC, the manager, metrics) are imported while the pages are allocated.
Both cores are busy allocating by then, so that gains less than the imports
took (median READY 2.09 s before, 2.04 s after, 12 runs each, interleaved).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from pathlib import Path

import structlog
import uvloop

from memd.journal import Recovered
from memd.memory import (
    PoolMemory,
    ShmMemory,
    allocate_pool,
    available_host_memory,
    kept_file,
    pool_kept,
    resolve_device,
)
from memd.settings import Settings
from memd.startup_plan import Startup, StartupError
from memd.state_dir import TMPFS, Layout, StateDir, StateError, boot_id
from memd.swap import SwapMemory
from memd.swap_tier import allocate_swap
from memd.token_files import Credentials, provision, remove_if_ours
from shared import address as addr
from shared.geometry import PoolGeometry
from shared.pool_files import stripe_sizes
from shared.sizes import format_size
from shared.unix_socket import SocketPathError, claim

log = structlog.get_logger("memd")
MAX_UNIX_PATH = 108        # sun_path, including the terminating NUL
NO_STATE = Path("none")    # --state-dir none


def run(args: argparse.Namespace, geometry: PoolGeometry) -> None:
    """Start memd and serve until SIGTERM. What a start that fails made goes: the token files it wrote, and
    the state directory's files it made (all of them if it never served)."""
    target = addr.resolve(args.listen)
    sock_path = prepare_socket(target)
    credentials = credentials_for(args, sock_path)
    try:
        settings = Settings.from_args(args)
        device = resolve_device(args.device)
        layout = Layout("shm" if device == "cpu" else "cuda", geometry.num_blocks, geometry.block_bytes,
                        settings.swap_slots(geometry))
        startup = Startup(args, geometry, settings, device, layout, target, sock_path, credentials)
        # No automatic collection while start-up builds what lives as long as memd (a host's worth of recovered
        # sessions): each would walk all of it again. The start-up's end freezes it and turns them back on.
        gc.disable()
        state, found = open_state(args, sock_path, layout)
        recovering = found is not None
        try:
            with contextlib.ExitStack() as stack:
                memory, swap = allocate_memory(device, geometry, layout, state, stack)
                from memd.daemon import serve_pool  # imported while the kernel allocates the pool's pages
                serving = serve_pool(startup, state, found, memory, swap)
                found = None                # serve_pool lets go of it once adopted
                uvloop.run(serving)
        except BaseException:
            if state is not None and not recovering and not state.served:
                state.forget()          # what a start that never served made: it holds memory and nothing else
            elif state is not None and not state.served:
                state.remove_new()      # the files it made anew, beside the journal before it (kept)
            raise
    finally:                          # token files we wrote go with us, also when start-up fails
        for path, token, kept in ((credentials.worker_file, credentials.worker, args.token_file),
                                  (credentials.admin_file, credentials.admin, args.admin_token_file)):
            if kept is None:
                remove_if_ours(path, token)


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


def allocate_memory(device: str, geometry: PoolGeometry, layout: Layout, state: StateDir | None,
                    stack: contextlib.ExitStack) -> tuple[PoolMemory, SwapMemory | None]:
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
    if keep_files and (fs := state.filesystem()) not in TMPFS:
        # Correct either way, but the pool's pages written back to a disk cost I/O for nothing, and the files
        # (pool and swap tier) stay on that disk after memd stops, for the next memd to reopen.
        held = geometry.pool_bytes + swap_slots * geometry.block_bytes
        log.warning("the state directory is not on tmpfs: the kernel writes the pool's pages back to its disk, "
                    "and its files stay there after memd stops (remove the directory once memd is stopped); "
                    "use a directory under /run or /dev/shm, or --state-dir none", state_dir=str(state.path),
                    filesystem=fs, holds=format_size(held))
    return memory, swap
