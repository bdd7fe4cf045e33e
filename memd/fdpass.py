"""The side socket that hands the shm pool's file descriptors to attached workers.

A file descriptor cannot travel in a gRPC message, so Attach returns a one-time
token and the path of this Unix socket; the worker presents the token and
receives the pool's files (memfds, one or several) by SCM_RIGHTS. Tokens expire, and each works once: only a
worker that just attached gets the pool. Here, unlike on gRPC's socket, the
kernel says who is connecting (SO_PEERCRED): the pool goes only to memd's own
user, root, or a member of memd's group, whatever the socket file's mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import struct
import time
from pathlib import Path

import structlog

log = structlog.get_logger("memd.fdpass")

TOKEN_BYTES = 16
TOKEN_TTL_S = 60.0


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)      # Linux >= 4.13


def peer_groups(conn: socket.socket) -> set[int]:
    """The connecting process's supplementary groups, as the kernel recorded them at connect()."""
    size = 64 * 4
    while True:
        try:
            raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE and size < (1 << 18):
                size *= 4
                continue
            return set()
        return set(struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4]))


def trusted(uid: int, gid: int, groups: set[int]) -> bool:
    """memd's user, root, or a process in memd's group (primary or supplementary)."""
    return uid in (0, os.getuid()) or os.getgid() == gid or os.getgid() in groups


class FdServer:
    def __init__(self, path: Path, fds: list[int]) -> None:
        self.path = path
        self._fds = fds                       # the pool's files, in order (shared.pool_files)
        self._tokens: dict[bytes, float] = {}
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._handovers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o660)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.create_task(self._accept_loop(), name="fdpass")

    def issue(self) -> bytes:
        now = time.monotonic()
        for token in [t for t, deadline in self._tokens.items() if deadline < now]:
            del self._tokens[token]
        token = os.urandom(TOKEN_BYTES)
        self._tokens[token] = now + TOKEN_TTL_S
        return token

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:          # EMFILE, ECONNABORTED ...: keep serving
                log.warning("pool socket accept failed", error=str(exc))
                await asyncio.sleep(0.1)    # back off from a persistent error, do not spin
                continue
            task = asyncio.create_task(self._hand_over(conn))
            self._handovers.add(task)
            task.add_done_callback(self._handovers.discard)

    async def _hand_over(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            try:
                token = await asyncio.wait_for(self._read_token(conn), 5.0)
            except (TimeoutError, OSError):
                return
            pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))
            if not trusted(uid, gid, peer_groups(conn)):
                log.warning("pool handle refused", reason="peer is not memd's user or group", pid=pid, uid=uid,
                            gid=gid)
                with contextlib.suppress(OSError):
                    await loop.sock_sendall(conn, b"NO")     # the token stays good for the worker it was issued to
                return
            deadline = self._tokens.pop(token, None)
            try:
                if deadline is None or deadline < time.monotonic():
                    await loop.sock_sendall(conn, b"NO")
                    log.warning("pool handle refused", reason="unknown or expired token")
                    return
                socket.send_fds(conn, [b"OK"], self._fds)
                log.info("pool handle delivered", pid=pid, uid=uid)
            except OSError as exc:
                log.warning("pool handle not delivered", error=str(exc))

    @staticmethod
    async def _read_token(conn: socket.socket) -> bytes:
        loop, token = asyncio.get_running_loop(), b""
        while len(token) < TOKEN_BYTES:
            chunk = await loop.sock_recv(conn, TOKEN_BYTES - len(token))
            if not chunk:
                break
            token += chunk
        return token

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
