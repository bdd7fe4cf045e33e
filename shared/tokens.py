"""memd's credentials as clients find them: a token in a file only the right people can read.

gRPC does not tell a server who is at the other end of a Unix socket (no
SO_PEERCRED), so memd writes two random tokens next to its socket and every
call presents one in the ``kvpool-token`` metadata:

- ``memd.sock.token`` (0640, memd's group): workers (Attach, and with it
  the pool; Session, Step) and the read-only Stats and Check;
- ``memd.sock.admin-token`` (0600, memd's user): also Snapshot, Evict and Drain.

A client reads the file next to the socket it calls; ``$KVPOOL_TOKEN`` or
``$KVPOOL_TOKEN_FILE`` take precedence (over TCP they are the only way).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from shared import address as addr

TOKEN_KEY = "kvpool-token"
TOKEN_ENV, TOKEN_FILE_ENV = "KVPOOL_TOKEN", "KVPOOL_TOKEN_FILE"


class TokenError(RuntimeError):
    """A token file named by the operator cannot be read; the message says which."""


def token_files(target: str) -> tuple[Path, Path] | None:
    """(worker token, admin token) files next to a Unix socket; None for TCP."""
    sock = addr.unix_path(target)
    if sock is None:
        return None
    return Path(f"{sock}.token"), Path(f"{sock}.admin-token")


def read_token(path: Path) -> str:
    token = path.read_text().strip()
    if not token:
        raise TokenError(f"{path} is empty")
    return token


def find_token(target: str, *, admin: bool = False, environ: Mapping[str, str] | None = None) -> str | None:
    """The token to present to memd at `target`; `admin` prefers the admin token when this user can read it."""
    environ = os.environ if environ is None else environ
    if environ.get(TOKEN_ENV):
        return environ[TOKEN_ENV].strip()
    if environ.get(TOKEN_FILE_ENV):
        path = Path(environ[TOKEN_FILE_ENV])
        try:
            return read_token(path)
        except OSError as exc:
            raise TokenError(f"cannot read ${TOKEN_FILE_ENV} {path}: {exc.strerror}") from None
    files = token_files(target)
    if files is None:
        return None
    for path in (files[1], files[0]) if admin else (files[0],):
        try:
            return read_token(path)
        except (OSError, TokenError):
            continue            # not there, or not ours to read: the next, or none (memd then says what it needs)
    return None


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_KEY, token),) if token else ()
