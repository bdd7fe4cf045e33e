"""How long memd's event loop was held: the one number that says whether something stalls every Step.

Everything memd does runs on one loop, so any pass that walks what memd
holds (every session, every page) delays every Step queued behind it. A
task that asks to wake every `TICK_S` and notes how late it woke measures
exactly that, whatever held the loop: a sweep, an operator call, a full
garbage collection, a journal rewrite. Its figures are memd's metrics
`kvpool_memd_loop_lag_seconds` (a histogram) and
`kvpool_memd_loop_lag_max_seconds` (the longest since start); a hold past
`WARN_S` is also logged, once per hold.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("memd")

TICK_S = 0.02          # a wake-up every 20 ms: ~50 cheap timer callbacks a second
WARN_S = 0.25          # a hold this long is worth a log line of its own


class LoopLag:
    """The loop's lateness, observed by `watch` (a task for memd's lifetime)."""

    def __init__(self) -> None:
        self.max_s = 0.0
        self.observe: Callable[[float], None] = lambda lag: None     # memd's histogram, once metrics are served

    async def watch(self) -> None:
        while True:
            due = time.monotonic() + TICK_S
            await asyncio.sleep(TICK_S)          # a periodic probe: what is measured is how late it wakes
            lag = max(0.0, time.monotonic() - due)
            self.max_s = max(self.max_s, lag)
            self.observe(lag)
            if lag > WARN_S:
                log.warning("memd's event loop was held", held_s=round(lag, 3))
