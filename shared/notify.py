"""sd_notify without libsystemd: one datagram to $NOTIFY_SOCKET, or nothing.

systemd's readiness protocol is also a good readiness signal for tests, which
listen on a socket of their own and wait for READY=1 instead of polling.
"""

from __future__ import annotations

import os
import socket


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
