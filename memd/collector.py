"""Python's automatic garbage collections held back while an operator call's copy of memd's state lives.

(What a long full collection leaves alive is frozen out of later ones:
shared.full_collections, which memd installs once start-up is done.)

A snapshot's or check's copy (memd.state_copy) holds a row per sequence: 10k
parked sessions make 10k objects that outlive two young collections,
reach the oldest generation and so trigger a full collection, which walks
every live sequence on the event loop, longer the more sessions are
parked, while workers' Steps wait. The copy is freed by reference
counts when the call ends, and memd's own state holds no cycles, so the automatic
collections simply wait for the call: acyclic garbage is still freed at
once, only cyclic garbage waits. A call that never ends (a stuck client)
holds them back for `MAX_PAUSE_S` at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator

__all__ = ["MAX_PAUSE_S", "collections_paused"]

MAX_PAUSE_S = 120.0

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
