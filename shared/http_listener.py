"""The HTTP listener inferd's API and kvroute share: a socket bound up front and uvicorn on the daemon's own loop.

The socket is bound before the daemon says READY=1, so a taken port fails
start-up in one line. uvicorn leaves the process's signals to the daemon,
which stops it (finishing the exchanges in flight, for a few seconds at most).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

GRACE_S = 5.0           # how long a stop waits for exchanges in flight (streams) before closing them


class HttpListenError(RuntimeError):
    """The address cannot be served; the message says why in one line."""


def bind_http(text: str, flag: str = "--http") -> socket.socket:
    """A listening socket on HOST:PORT, [IPv6]:PORT or :PORT (all interfaces)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise HttpListenError(f"{flag} {text!r}: expected HOST:PORT")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, int(port)), family=family, backlog=1024)
    except OSError as exc:
        raise HttpListenError(f"cannot serve HTTP on {text}: {exc.strerror or exc}") from None


def address_of(sock: socket.socket) -> str:
    """HOST:PORT as clients write it (the port the kernel chose for :0)."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EmbeddedServer(uvicorn.Server):
    """uvicorn serving an ASGI app on the running loop; the daemon owns the process's signals, not uvicorn."""

    def __init__(self, app: Any, *, own_headers: bool = True) -> None:
        """`own_headers=False`: no Date or Server header of uvicorn's (a proxy passes on its upstream's)."""
        super().__init__(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, loop="none",
                                        timeout_graceful_shutdown=GRACE_S, server_header=own_headers,
                                        date_header=own_headers))

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
