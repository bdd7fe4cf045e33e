"""memd's copy threads give way to its event loop.

Swap copies, page effects and scrubs run on threads so the loop stays free
for Steps; but on a host with few cores those threads and the loop share
them, and a Step that arrives while a copy runs waited for the kernel to
give the loop its turn. These threads run at a lower priority (a higher
nice value) than the loop: a Step wakes the loop at once, and the copies
still have every idle cycle.
"""

from __future__ import annotations

import os
import threading

import structlog

log = structlog.get_logger("memd.background")

BACKGROUND_NICE = 10         # relative to memd's own (at most 19): by the kernel's nice weights, ~9x their share


def give_way() -> None:
    """A thread initializer: this thread runs BACKGROUND_NICE below memd's priority (Linux: per thread)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
    except OSError as exc:                   # a seccomp filter or odd kernel: the copies run as they are
        log.debug("could not lower a copy thread's priority", error=str(exc))
