"""sd_notify without libsystemd: one datagram to $NOTIFY_SOCKET, or nothing.

systemd's readiness protocol is also a good readiness signal for tests, which
listen on a socket of their own and wait for READY=1 instead of polling.

The watchdog pings come from the event loop itself: a loop that stalls (a
blocking call, a deadlock) stops pinging, and systemd restarts the daemon.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable


def notify(*lines: str) -> bool:
    """Send ``READY=1``, ``STATUS=...``, ``WATCHDOG=1`` ...; False when not under a notifier."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]          # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(path)
            sock.sendall("\n".join(lines).encode())
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between pings when systemd watches this process (half of $WATCHDOG_USEC), else None."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid.isdigit() and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


async def keep_watchdog(interval: float, status: Callable[[], str] | None = None) -> None:
    """Ping WATCHDOG=1 (with a fresh STATUS= line) every `interval` seconds, from the event loop."""
    while True:
        notify("WATCHDOG=1", *([f"STATUS={status()}"] if status else []))
        await asyncio.sleep(interval)        # the ping period: a loop that stalls misses it
