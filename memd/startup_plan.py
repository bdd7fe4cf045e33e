"""What memd's start-up settles before it allocates anything, and how a start fails: shared by the start-up
(memd.startup) and the daemon it then runs (memd.daemon), which imports nothing of the start-up itself."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from memd.settings import Settings
from memd.state_dir import Layout
from memd.token_files import Credentials
from shared.geometry import PoolGeometry


class StartupError(RuntimeError):
    """memd cannot start as configured; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class Startup:
    """What start-up settled before allocating anything: flags, pool plan, address, tokens."""

    args: argparse.Namespace
    geometry: PoolGeometry
    settings: Settings
    device: str                     # "cpu" or "cuda[:N]", resolved
    layout: Layout
    target: str                     # the address to listen on
    sock_path: Path | None          # its Unix socket, if it is one
    credentials: Credentials
