"""Run kvpool's command-line tools as their own processes, as an operator does.

`system_run` stands a folder in for /run, where clients look for the sockets
of memd.service and inferd@NAME when no address is named and the per-user
socket does not exist (shared.address.SYSTEM_RUN).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNDER_RUN = ("import sys; from pathlib import Path; from shared import address; "
             "address.SYSTEM_RUN = Path(sys.argv[1]); from {module} import main; sys.exit(main(sys.argv[2:]))")


async def run_cli(module: str, *args: str, env: dict[str, str] | None = None,
                  system_run: Path | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m module args...`."""
    argv = ["-m", module] if system_run is None else ["-c", UNDER_RUN.format(module=module), str(system_run)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, *args, cwd=ROOT, env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


def unit_host_env(tmp: Path) -> dict[str, str]:
    """Overrides that name no address (an empty variable counts as unset) and point the per-user runtime
    directory at an empty folder."""
    return {"MEMD_ADDRESS": "", "INFERD_ADDRESS": "", "RUNTIME_DIRECTORY": "",
            "XDG_RUNTIME_DIR": str(tmp / "user-runtime")}
