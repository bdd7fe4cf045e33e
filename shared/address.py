"""Where memd and inferd listen, and where their clients look for them.

Addresses are written as gRPC targets: ``unix:/run/memd/memd.sock`` (a bare
absolute path means the same) or ``host:port`` for TCP. A daemon started by
hand listens in a per-user runtime directory; one started by its systemd
unit in ``/run/memd`` or ``/run/inferd/NAME``. A client (memctl, inferctl)
named no address tries the per-user socket, then the unit's, so that
``sudo memctl stats`` on a systemd host finds memd.service.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc

ENV = {"memd": "MEMD_ADDRESS", "inferd": "INFERD_ADDRESS"}
# systemd's RuntimeDirectory= root: memd.service serves on SYSTEM_RUN/memd/memd.sock, inferd@NAME on
# SYSTEM_RUN/inferd/NAME/inferd.sock. A module constant so that tests can stand a folder in for /run.
SYSTEM_RUN = Path("/run")
UNIT_RUNNING = {"memd": "memd.service", "inferd": "exactly one inferd@NAME"}
# Trailing metadata on a status a kvpool daemon sends itself. gRPC also says UNAVAILABLE when no server
# answered at all, the code a draining or detached inferd refuses with: this key tells the two apart.
ANSWERED_KEY = "kvpool-answered"
ANSWERED = ((ANSWERED_KEY, "1"),)


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


def unit_socket(service: str) -> Path | None:
    """The socket of the systemd unit running `service` on this host, if one runs.

    Judged by the unit's runtime directory, which systemd makes at start and
    removes at stop; its socket may sit in a folder this user cannot search,
    and connecting then says so. inferd: only when a single worker runs, since
    picking one of several would be a guess.
    """
    if service == "memd":
        return SYSTEM_RUN / "memd" / "memd.sock" if os.path.isdir(SYSTEM_RUN / "memd") else None
    try:
        workers = [entry for entry in os.scandir(SYSTEM_RUN / "inferd") if entry.is_dir()]
    except OSError:
        return None
    return Path(workers[0].path) / "inferd.sock" if len(workers) == 1 else None


def connect_target(address: str | None, service: str = "memd") -> str:
    """Where a client calls: as `resolve`, but with no address named and no per-user socket, the unit's socket.

    Only clients fall back: a daemon given no --listen must not take over a
    socket path that belongs to another.
    """
    if address or os.environ.get(ENV[service]):
        return resolve(address, service)
    own = runtime_dir() / f"{service}.sock"
    if not os.path.exists(own) and (unit := unit_socket(service)) is not None:
        return f"unix:{unit}"
    return f"unix:{own}"


def answered(err: grpc.aio.AioRpcError) -> bool:
    """Whether the daemon itself sent this status (a refusal), rather than gRPC finding no one to ask."""
    return any(key == ANSWERED_KEY for key, _ in err.trailing_metadata() or ())


def not_reachable(service: str, target: str, details: str) -> str:
    """One sentence for an operator: where the client looked, gRPC's reason in its last words, the way out."""
    reason = details.rsplit(": ", 1)[-1].rstrip("]").strip()
    reason = reason[:1].lower() + reason[1:]
    if target == default_address(service) and unit_socket(service) is None:
        reason += f"; nor does {UNIT_RUNNING[service]} run"       # the unit's socket was tried too
    return f"{service} is not reachable at {target} ({reason}): give --address or set {ENV[service]}"


def unix_path(target: str) -> Path | None:
    """The socket file of a ``unix:`` target, None for TCP."""
    if target.startswith("unix://"):
        return Path(target[len("unix://"):])
    if target.startswith("unix:"):
        return Path(target[len("unix:"):])
    return None
