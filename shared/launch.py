"""Start a kvpool daemon as a child process and wait for its READY=1.

For demos and benchmarks: the child gets a NOTIFY_SOCKET of ours, exactly as
systemd would give it, so "ready" means what it means in production.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a daemon's --http or --metrics-port."""
    return free_ports(1)[0]


def free_port_pair() -> int:
    """A port P on 127.0.0.1 with P + 1 free as well: memd's --kv-events and the replay socket beside it."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe, socket.socket() as beside:
            try:
                probe.bind(("127.0.0.1", port))
                beside.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise OSError("no two free ports side by side on 127.0.0.1")


def free_ports(count: int) -> list[int]:
    """`count` different free ports: each probe stays bound until all are picked, or the kernel may hand the
    same port out twice (a Mooncake master given one port for its RPC and its metadata server failed so)."""
    with contextlib.ExitStack() as probes:
        ports = []
        for _ in range(count):
            probe = probes.enter_context(socket.socket())
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
        return ports


class LaunchError(RuntimeError):
    """The daemon exited or stayed silent instead of becoming ready."""


def held_to(cpus: set[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` that holds a child and every thread it starts to `cpus` (None: no hold)."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def spawn_ready(argv: list[str], workdir: Path, *, timeout_s: float = 120.0,
                stderr: int | None = None, cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
    """`python -m argv...`; returns once it sent READY=1 on a notify socket in `workdir`.

    `cpus`: the only cores it and every thread it starts may run on (a bench gives two systems the same)."""
    notify_path = workdir / f"notify-{argv[0]}-{len(list(workdir.glob('notify-*')))}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ready:
        ready.bind(str(notify_path))
        ready.settimeout(1.0)
        proc = subprocess.Popen([sys.executable, "-m", *argv], stderr=stderr,
                                env={**os.environ, "NOTIFY_SOCKET": str(notify_path)},
                                preexec_fn=held_to(cpus))
        waited = 0.0
        while True:
            try:
                if b"READY=1" in ready.recv(4096).split(b"\n"):
                    return proc
            except TimeoutError:
                waited += 1.0           # the receive timeout only lets us notice an exit
                if proc.poll() is not None or waited >= timeout_s:
                    proc.kill()
                    raise LaunchError(f"{argv[0]} did not become ready (exit code {proc.poll()})") from None
