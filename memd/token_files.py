"""memd's token files: the worker's (group-readable) and the admin's (owner-only), kept or written at start.

Apart from the access check that reads them (memd.access, which needs gRPC):
start-up writes them before the pool is allocated, so that a typo in a token
path fails memd before it allocates anything.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shared.tokens import TokenError, read_token


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
