"""Where memd listens: a Unix socket in a per-user runtime directory by default.

Addresses are written as gRPC targets: ``unix:/run/memd/memd.sock`` (a bare
absolute path means the same) or ``host:port`` for TCP.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = {"memd": "MEMD_ADDRESS", "inferd": "INFERD_ADDRESS"}


def runtime_dir() -> Path:
    """systemd's RuntimeDirectory=, else $XDG_RUNTIME_DIR/kvpool, else /tmp/kvpool-UID."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "kvpool"
    return Path(f"/tmp/kvpool-{os.getuid()}")


def default_address(service: str = "memd") -> str:
    return f"unix:{runtime_dir() / f'{service}.sock'}"


def resolve(address: str | None, service: str = "memd") -> str:
    """The gRPC target for an address given by flag, by MEMD_ADDRESS (INFERD_ADDRESS), or neither."""
    address = address or os.environ.get(ENV[service]) or default_address(service)
    if address.startswith("/"):
        return f"unix:{address}"
    return address


def unix_path(target: str) -> Path | None:
    """The socket file of a ``unix:`` target, None for TCP."""
    if target.startswith("unix://"):
        return Path(target[len("unix://"):])
    if target.startswith("unix:"):
        return Path(target[len("unix:"):])
    return None
