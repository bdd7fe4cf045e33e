"""memd and Python's garbage collector: long-lived state kept out of full collections, and no automatic
collection while an operator call's copy of memd's state lives.

Long-lived state. A full (oldest generation) collection walks every object
it tracks, on whichever thread allocated last: on memd's event loop while
workers' Steps wait. Parked sessions are such objects (a sequence and its
lists): with Python's defaults a full collection took 159-180 ms in a
process holding 50k of them, and one comes every quarter more long-lived
objects. memd freezes (`gc.freeze`) what a long full collection leaves
alive: what survived one is what lives on, and frozen objects are not
walked again, yet are still freed by their reference counts as soon as
nothing holds them (a freed session goes as before). Only a frozen object
that later becomes part of an unreachable cycle is never freed. memd's state
holds no cycles; the cycles a serving memd makes are gRPC's lookup of each
new call's handler, three small objects per call (a worker's Steps ride one
call, its stream; a memctl command is one), so a freeze leaks those of the
calls starting at that instant at most. And a short full collection, one
that found little alive, freezes nothing: long ones come once per thousands
of new sessions. Full collections also come after 3 of the middle
generation's, not 10, so each walks less. 100k sessions opened (half freed
again) in bench_memd's full-collections run: longest full collection
159-180 ms as Python comes, 14-15 ms with the freeze alone, 5-7.5 ms with
both (`FullCollections` counts and times them for memd's metrics).

Operator calls. A snapshot's or check's copy (memd.state_copy) holds a row per sequence:
10k parked sessions make 10k objects that outlive two young collections,
reach the oldest generation and so trigger a full collection, which walks
every live sequence on the event loop (16-20 ms with 10k sessions on a
2-core host) while workers' Steps wait. The copy is freed by reference
counts when the call ends, and memd's own state holds no cycles, so the automatic
collections simply wait for the call: acyclic garbage is still freed at
once, only cyclic garbage waits. A call that never ends (a stuck client)
holds them back for `MAX_PAUSE_S` at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["FREEZE_AFTER_S", "FULL_EVERY", "MAX_PAUSE_S", "FullCollections", "collections_paused",
           "freeze_long_lived"]

MAX_PAUSE_S = 120.0
FREEZE_AFTER_S = 0.002      # a full collection at least this long freezes what it left alive
FULL_EVERY = 3              # the oldest generation's threshold: middle-generation collections per full one

_holders = 0
_paused_by_us = False
_deadline: asyncio.TimerHandle | None = None


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No automatic collection until every holder has left (or `MAX_PAUSE_S` after the first came)."""
    global _holders, _paused_by_us, _deadline
    if _holders == 0 and gc.isenabled():
        gc.disable()
        _paused_by_us = True
        with contextlib.suppress(RuntimeError):            # no running loop: no deadline needed
            _deadline = asyncio.get_running_loop().call_later(MAX_PAUSE_S, _resume)
    _holders += 1
    try:
        yield
    finally:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            _resume()


def _resume() -> None:
    global _holders, _paused_by_us, _deadline
    if _deadline is not None:
        _deadline.cancel()
        _deadline = None
    if _paused_by_us:
        _paused_by_us = False
        _holders = 0                        # a late holder's exit changes nothing now
        gc.enable()


@dataclass(slots=True, eq=False)
class FullCollections:
    """Python's full collections in this process: counted, timed, and what a long one left alive frozen.

    A `gc.callbacks` entry. It runs inside the collector, on whichever thread
    triggered it, so it only sets plain numbers (no lock: a lock the
    interrupted code holds would deadlock it); memd's metrics read them."""

    count: int = 0
    seconds: float = 0.0
    longest_s: float = 0.0
    freezes: int = 0
    collected: int = 0          # unreachable objects they found: cycles, which a frozen object in one would leak
    freeze_after_s: float = FREEZE_AFTER_S
    _started: float = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        took = now - self._started
        self.count += 1
        self.seconds += took
        self.longest_s = max(self.longest_s, took)
        self.collected += info["collected"]
        if took >= self.freeze_after_s:
            gc.freeze()
            self.freezes += 1


full_collections = FullCollections()


def freeze_long_lived() -> FullCollections:
    """From now on in this process: a long full collection freezes its survivors, and full collections come
    every `FULL_EVERY` middle-generation ones. Called once start-up's own objects are frozen."""
    if full_collections not in gc.callbacks:
        gc.callbacks.append(full_collections)
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_EVERY)
    return full_collections
