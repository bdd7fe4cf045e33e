"""Which worker holds a session: a directory in the cluster store, so kvroutes agree and a restart forgets nothing.

An entry is a small object under `kvroute/v1/session/<hash of model and
session id>` naming the worker's URL and when the entry expires (`--session-ttl`;
each turn renews it once past half its life). An entry past its time is not
followed: the session is placed like a new one and its KV, parked in memd or
published to the store, is found from wherever it lands. Of the store's entry
and the one this kvroute holds, the later-expiring wins (the newer turn).

A session reset through kvroute (DELETE /v1/sessions/NAME) leaves a
tombstone: an entry naming no worker, expiring after a whole TTL, so it is
later than any entry another kvroute still holds for the session and wins
over it; the session's next turn is placed like a new one's.

Writes happen beside the answer, never before it. A store that does not
answer within DEADLINE_S, or refuses a write, is left alone for BACK_OFF_S
(one log line per such window), and this kvroute routes by what it saw itself
meanwhile; an entry newer here than in the store (written while the store was
away, or lost by a restarted master) is written again when it is next read.
Without a store (no --cluster-master) that memory is the whole directory,
shared with no one.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import msgpack
import structlog

from shared.cluster_store import ClusterStore

log = structlog.get_logger("kvroute.directory")

T = TypeVar("T")
DEADLINE_S = 1.0
BACK_OFF_S = 10.0
REMEMBERED = 100_000        # entries this kvroute keeps in memory, newest first


@dataclass(frozen=True, slots=True)
class Entry:
    worker: str
    expires: float
    stored: bool = False     # the store has it (as far as this kvroute knows)


def entry_key(model: str, session: str) -> str:
    digest = hashlib.blake2b(f"{model}\0{session}".encode(), digest_size=16).hexdigest()
    return f"kvroute/v1/session/{digest}"


class SessionDirectory:
    def __init__(self, store: ClusterStore | None, ttl_s: float, *, back_off_s: float = BACK_OFF_S,
                 deadline_s: float = DEADLINE_S) -> None:
        self.store, self.ttl_s, self.back_off_s, self.deadline_s = store, ttl_s, back_off_s, deadline_s
        self.seen: dict[str, Entry] = {}          # what this kvroute read or wrote last, per key
        self.errors = 0
        self._quiet_until = 0.0
        self._writes: set[asyncio.Task[None]] = set()

    async def lookup(self, model: str, session: str) -> str | None:
        """The worker the session was last sent to, while its entry lives."""
        key = entry_key(model, session)
        held = self.seen.get(key)
        if self._store_answers():
            stored = _parse(await self._ask(self.store.get(key), "read"))          # type: ignore[union-attr]
            if stored is not None and (held is None or stored.expires >= held.expires):
                held = stored
                self._remember(key, stored)
            elif held is not None and held.expires > time.time() and self._store_answers():
                self._write_soon(key, held)    # newer here: written while the store was away, or it lost the entry
        return held.worker if held is not None and held.expires > time.time() and held.worker else None

    def forget_soon(self, model: str, session: str) -> None:
        """The session was reset: no worker holds it now (a tombstone, written beside the answer)."""
        key = entry_key(model, session)
        entry = Entry("", time.time() + self.ttl_s)
        self._remember(key, entry)
        if self._store_answers():
            self._write_soon(key, entry)

    def record_soon(self, model: str, session: str, worker: str) -> None:
        """The session is served by `worker` now; written unless the entry says so for half its life still."""
        key = entry_key(model, session)
        now = time.time()
        held = self.seen.get(key)
        if held is not None and held.worker == worker and held.stored and held.expires - now > self.ttl_s / 2:
            return
        entry = Entry(worker, now + self.ttl_s)
        self._remember(key, entry)
        if self._store_answers():
            self._write_soon(key, entry)

    async def drain(self) -> None:
        """Writes in flight finished (at stop, and for tests)."""
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    def _write_soon(self, key: str, entry: Entry) -> None:
        task = asyncio.create_task(self._write(key, entry))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, key: str, entry: Entry) -> None:
        value = msgpack.packb({"worker": entry.worker, "expires": entry.expires})
        rc = await self._ask(self.store.put(key, value), "write")                  # type: ignore[union-attr]
        if rc is not None and rc != 0:
            self._failed("write", f"the store refused it ({rc})")
        elif rc == 0 and self.seen.get(key) == entry:
            self.seen[key] = Entry(entry.worker, entry.expires, stored=True)

    def _remember(self, key: str, entry: Entry) -> None:
        self.seen.pop(key, None)
        self.seen[key] = entry
        if len(self.seen) > REMEMBERED:
            del self.seen[next(iter(self.seen))]

    def _store_answers(self) -> bool:
        return self.store is not None and time.monotonic() >= self._quiet_until

    async def _ask(self, call: Awaitable[T], what: str) -> T | None:
        try:
            return await asyncio.wait_for(call, self.deadline_s)
        except Exception as exc:
            self._failed(what, str(exc) or type(exc).__name__)
            return None

    def _failed(self, what: str, why: str) -> None:
        self.errors += 1
        if time.monotonic() >= self._quiet_until:             # one line per window, however many calls failed
            log.warning(f"could not {what} the session directory in the cluster store: routing by this kvroute's "
                        f"own memory for {self.back_off_s:.0f} s", error=why)
        self._quiet_until = time.monotonic() + self.back_off_s


def _parse(data: bytes | None) -> Entry | None:
    if not data:
        return None
    try:
        record = msgpack.unpackb(data)
        entry = Entry(str(record["worker"]), float(record["expires"]), stored=True)
    except Exception:
        return None
    return entry if math.isfinite(entry.expires) else None
