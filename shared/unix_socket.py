"""Taking over a daemon's Unix socket path: only from a daemon that is gone.

Binding a Unix socket needs the path free, so a daemon removes the file
first. Removed while another daemon still listens there, that daemon keeps
running — attached to memd, holding its lease — but no client can reach it
again. A socket that answers a connect is therefore refused; only one that
refuses it (left by a daemon that died) is cleared.

A typo in a path must not become a directory tree either: the socket's
directory must exist, but for kvpool's own runtime directory
(shared/address.py), which is made here, without parents.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from shared import address as addr


class SocketPathError(RuntimeError):
    """The socket path cannot be taken; the message says why in one line."""


def claim(path: Path, program: str) -> None:
    """Make `path` free to bind, or raise SocketPathError: another `program` listens there, or it is no socket."""
    try:
        if path.parent == addr.runtime_dir():
            path.parent.mkdir(mode=0o700, exist_ok=True)
        elif not path.parent.is_dir():
            raise SocketPathError(f"cannot listen on {path}: the directory {path.parent} does not exist")
        if not (path.exists() or path.is_symlink()):
            return
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketPathError(f"{path} exists and is not a socket; refusing to replace it")
        if answers(path):
            raise SocketPathError(f"another {program} is already listening on {path}")
        path.unlink()                        # left by a daemon that died
    except FileNotFoundError as exc:
        raise SocketPathError(f"cannot listen on {path}: {exc.strerror}: {exc.filename}") from None
    except PermissionError as exc:
        raise SocketPathError(f"cannot use {path}: {exc.strerror}") from None


def answers(path: Path) -> bool:
    """Whether a process accepts connections on the socket `path` now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(os.fspath(path))
        except OSError:
            return False
    return True
