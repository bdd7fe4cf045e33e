"""Who may call memd, checked before any handler runs.

Every Memd call presents a token (shared.tokens). The worker token, readable
by memd's group, admits workers and read-only tools; the admin token, readable
by memd's user only, also admits the calls that change or reveal other
tenants' state: Snapshot, Evict, Drain, Scrub. A refused call reaches no handler, so
it changes nothing. Health checks and reflection stay open: probes and
grpcurl need no secret, and they reveal none.

Inside the worker role, each attachment's lease secret (AttachReply.lease)
keeps a worker to its own sequences; that check lives in the manager.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from memd.interceptors import MEMD_SERVICE
from shared.rpc import memd_pb2 as pb
from shared.tokens import TOKEN_ENV, TOKEN_FILE_ENV, TOKEN_KEY, TokenError, read_token

log = structlog.get_logger("memd")

ADMIN_METHODS = frozenset({"Snapshot", "Evict", "Drain", "Scrub"})
# How each method streams, (requests, replies): a refusal must be a handler of the same kind.
_KINDS = {m.name: (m.client_streaming, m.server_streaming)
          for m in pb.DESCRIPTOR.services_by_name["Memd"].methods}


class AccessError(RuntimeError):
    """memd cannot set up its credentials; the message says why in one line."""


@dataclass(frozen=True)
class Credentials:
    worker: str
    admin: str
    worker_file: Path
    admin_file: Path


def provision(worker_file: Path, admin_file: Path, *, keep_worker: bool, keep_admin: bool) -> Credentials:
    """Read a token file the operator named (`keep_*`) when it exists, else write a fresh one.

    Fresh tokens are written at every start, so a stale file from a crashed
    memd never admits anyone; clients read the file again when they attach.
    """
    return Credentials(_token(worker_file, 0o640, keep_worker), _token(admin_file, 0o600, keep_admin),
                       worker_file, admin_file)


def _token(path: Path, mode: int, keep: bool) -> str:
    """A kept file must be ours (or root's) and no more open than `mode`; a new one is written safely."""
    try:
        if keep and path.exists():
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode) or info.st_uid not in (os.getuid(), 0):
                raise AccessError(f"{path} must be a plain file owned by memd's user (or root)")
            if stat.S_IMODE(info.st_mode) & ~mode:
                raise AccessError(f"{path} is open to more users than it should be: chmod {mode:o} {path}")
            return read_token(path)
        if not path.parent.is_dir():         # made by no one but the operator: a typo must not become a directory
            raise AccessError(f"cannot write the token file {path}: the directory {path.parent} does not exist")
        folder = path.parent.lstat()
        if folder.st_uid not in (os.getuid(), 0) or folder.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise AccessError(f"{path.parent} must belong to memd's user and be writable by it alone")
        token = secrets.token_hex(32)
        fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)     # O_EXCL: no planted link
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), mode)          # whatever the umask says
            f.write(token + "\n")
        os.replace(staging, path)
        return token
    except (OSError, TokenError) as exc:
        raise AccessError(f"cannot set up the token file {path}: {getattr(exc, 'strerror', None) or exc}") from None


def remove_if_ours(path: Path, token: str) -> None:
    """At exit: a newer memd may have written its own token there since; leave that one."""
    try:
        if read_token(path) == token:
            path.unlink()
    except (OSError, TokenError):
        pass


def _deny(code: grpc.StatusCode, message: str, method: str) -> grpc.RpcMethodHandler:
    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[_KINDS.get(method, (False, False))](refuse)


class AccessControl(grpc.aio.ServerInterceptor):
    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials

    def role(self, token: str | bytes | None) -> str | None:
        if not isinstance(token, str):
            return None
        if hmac.compare_digest(token.encode(), self.credentials.admin.encode()):
            return "admin"
        if hmac.compare_digest(token.encode(), self.credentials.worker.encode()):
            return "worker"
        return None

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        service, _, method = details.method.lstrip("/").rpartition("/")
        if service != MEMD_SERVICE:
            return await continuation(details)
        token = next((v for k, v in details.invocation_metadata or () if k == TOKEN_KEY), None)
        role = self.role(token)
        c = self.credentials
        if role is None:
            reason = "no token" if token is None else "a wrong token"
            log.warning("call refused", method=method, reason=reason)
            hint = (f"members of memd's group read it from {c.worker_file}, or set ${TOKEN_ENV} / ${TOKEN_FILE_ENV}"
                    if token is None else "memd writes new tokens at every start: read the file again")
            return _deny(grpc.StatusCode.UNAUTHENTICATED, f"{method} with {reason}: {hint}", method)
        if method in ADMIN_METHODS and role != "admin":
            log.warning("call refused", method=method, reason="not an admin")
            return _deny(grpc.StatusCode.PERMISSION_DENIED,
                         f"{method} needs the admin token ({c.admin_file}, readable by memd's user only)", method)
        return await continuation(details)
