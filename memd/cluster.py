"""The cluster tier: a parked session's K/V published to Mooncake Store, where any host's memd finds it.

When a session's turn ends (its sequence parks), memd publishes it in the
background, without delaying any Step: its full blocks under content keys
(an unkeyed BLAKE2b chain over the model fingerprint and the token ids, the
same on every host, so a system prompt a thousand sessions share is stored
once), then a record of the session: its token ids, block keys and the
blocks' checksums (the worker's, so a host that fetches them checks what it
got). A session reset or freed removes its record; blocks age out by the
store's own eviction. A store that is slow or down costs only the publish:
the session stays here, and a line in the log says so. A store that is
down when memd starts is the same: memd serves without it, with
`memctl stats` saying why it is unreachable, and joins it in the background
(`join`, with back-off; one log line each time the reason changes).

A Step that continues a session this memd does not hold (its host was lost,
or a balancer sent the turn elsewhere) first looks its record up in the
store (`records_for`); the Step then makes it PARKED here with fresh pages
that its effects fill straight from the store (`Fetch`, run by the page
copier like a swap-in, off the event loop) and check against the record's
checksums before the worker hears back. A page that is gone or not intact
cuts the session there; the worker computes the rest.

Publishing reads the pool pages while Steps go on. A page with a checksum is
not written until memd hands it out again, which clears the checksum on the
event loop; a page whose checksum changed by the time its put returned is
taken out of the store again, never left there torn.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from array import array
from collections.abc import Callable

import msgpack
import structlog

from memd.manager import KvManager
from memd.sequences import RemoteSession, SeqState, prefix_space
from memd.step_outcome import StepOutcome
from shared.cluster_store import JOIN_RETRY_S, ClusterError, ClusterStore, StoreUnreachable

log = structlog.get_logger("memd.cluster")

KEY_PREFIX = "kvpool/v1"
RECORD_VERSION = 1
HEALTH = {1: "the client is closed", 2: "mooncake_master does not answer"}
LOOKUP_TIMEOUT_S = 2.0         # a Step's reads of the store before it runs (and memctl stats' health check)


def block_keys(model: str, token_ids: list[int], block_size: int, count: int) -> list[str]:
    """Store keys of the first `count` full blocks: the same tokens under the same model, the same key anywhere."""
    keys, parent = [], b""
    for i in range(count):
        h = hashlib.blake2b(digest_size=20)
        h.update(parent)
        h.update(model.encode())
        h.update(b"\0")
        h.update(array("I", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        parent = h.digest()
        keys.append(f"{KEY_PREFIX}/block/{parent.hex()}")
    return keys


def session_key(session_id: str) -> str:
    return f"{KEY_PREFIX}/session/{session_id}"


def sum_key(block_key: str) -> str:
    """Where a published block's checksum lives (8 bytes): a prefix fetch checks the page against it."""
    return block_key.replace("/block/", "/sum/", 1)


def parse_record(data: bytes) -> RemoteSession | None:
    """A session record, checked field by field; None for anything else (never trusted as it is)."""
    try:
        r = msgpack.unpackb(data, raw=False)
        remote = RemoteSession(str(r["model"]), int(r["block_size"]), [int(t) for t in r["tokens"]],
                               [str(k) for k in r["keys"]], [int(c) for c in r["checksums"]], str(r.get("salt", "")),
                               str(r.get("tenant", "")), float(r.get("retain_until", 0.0)))
    except Exception:
        return None
    if r.get("v") != RECORD_VERSION or remote.block_size <= 0 or len(remote.keys) != len(remote.checksums) \
            or len(remote.keys) * remote.block_size > len(remote.token_ids) \
            or any(not 0 <= t < 2**32 for t in remote.token_ids) or not all(0 < c < 2**64 for c in remote.checksums) \
            or not 0 <= remote.retain_until < math.inf:
        return None
    # The keys must be those of these tokens: K/V is never taken for tokens it was not computed for.
    if remote.keys != block_keys(prefix_space(remote.model, remote.salt), remote.token_ids, remote.block_size,
                                 len(remote.keys)):
        return None
    return remote


class ClusterTier:
    """Publishes parked sessions (one publish at a time per session) and forgets reset ones."""

    def __init__(self, manager: KvManager, store: ClusterStore) -> None:
        self.manager, self.store = manager, store
        self.block_bytes = manager.geometry.block_bytes
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()                 # parked again (or freed) while its last job ran
        self.unreachable = ""                         # why the store could not be joined yet ("" once it was)
        self._joining: asyncio.Task[None] | None = None

    async def join(self) -> bool:
        """Join the store now; False if it does not answer (then `join_later` keeps trying). ClusterError for
        a store that cannot be used as configured (memd refuses to start)."""
        try:
            await self.store.start()
        except StoreUnreachable as exc:
            self._unreachable(str(exc))
            return False
        self.unreachable = ""
        return True

    def join_later(self, joined: Callable[[], None]) -> None:
        """Keep trying, with back-off, until the store answers; then `joined()` (memd looks sessions up there)."""
        self._joining = asyncio.create_task(self._join_later(joined), name="cluster-join")

    async def _join_later(self, joined: Callable[[], None]) -> None:
        delay, most = JOIN_RETRY_S
        while True:
            await asyncio.sleep(delay)           # back-off between tries: nothing signals that a store came up
            try:
                if await self.join():
                    joined()
                    return
            except ClusterError as exc:          # it answered, but cannot take this memd: no use trying again
                self._unreachable(str(exc))
                log.error("the cluster store cannot be joined; memd serves this host's sessions alone",
                          error=str(exc))
                return
            delay = min(2 * delay, most)

    def _unreachable(self, why: str) -> None:
        if why != self.unreachable:
            log.warning("the cluster store is unreachable; memd serves this host's sessions alone and joins it "
                        "when it answers", error=why)
        self.unreachable = why

    async def status(self) -> str:
        """For `memctl stats`: whether the store answers now."""
        if not self.store.joined:
            return f"unreachable: {self.unreachable or 'not joined yet'}"
        try:
            code = await asyncio.wait_for(self.store.health(), LOOKUP_TIMEOUT_S)
        except TimeoutError:
            return f"unreachable: the store did not answer in {LOOKUP_TIMEOUT_S:g} s"
        return "reachable" if code == 0 else f"unreachable: {HEALTH.get(code, f'health check returned {code}')}"

    def after_step(self, outcome: StepOutcome) -> None:
        """Called with every committed Step: parked sessions are published, freed ones taken back."""
        m = self.manager
        for result in outcome.results:
            if result.state == SeqState.PARKED.value:
                seq = m.seqs.get(result.seq_id)
                if seq is not None and seq.session_id:
                    self._soon(seq.session_id)
        for session in outcome.freed_sessions:
            self._soon(session)

    def _soon(self, session: str) -> None:
        """One job at a time per session; what it does is decided when it runs (publish if held, else forget)."""
        if session in self._tasks:
            self._again.add(session)
            return
        self._tasks[session] = asyncio.create_task(self._run(session), name=f"cluster:{session}")

    async def _run(self, session: str) -> None:
        try:
            while True:
                held = session in self.manager.sessions
                try:
                    await (self._publish(session) if held else self._forget(session))
                except Exception as exc:   # the store is slow or down: the session stays local, nothing fails
                    self.manager.counters["cluster_errors"] += 1
                    log.warning("the cluster store did not take a change; the session stays on this host",
                                session=session, publish=held, error=str(exc) or type(exc).__name__)
                if session not in self._again:
                    break
                self._again.discard(session)
        finally:
            self._tasks.pop(session, None)

    async def _publish(self, session: str) -> None:
        m = self.manager
        seq = m.seqs.get(m.sessions.get(session, 0))
        if seq is None or seq.state is not SeqState.PARKED:
            return
        # All of it taken now: the session may be resumed, rewound or freed while the store is busy.
        bs, model, salt, tokens = seq.block_size, seq.model, seq.salt, list(seq.token_ids)
        pages = list(seq.block_ids[:seq.num_full_blocks])
        sums = [m.pool.checksum[p] for p in pages]
        if 0 in sums:
            pages, sums = pages[:sums.index(0)], sums[:sums.index(0)]    # only what can be checked on arrival
        keys = block_keys(prefix_space(model, salt), tokens, bs, len(pages))
        present = await self.store.exists(keys)
        todo = [i for i, there in enumerate(present) if not there]
        codes = await self.store.put_pages([keys[i] for i in todo], [pages[i] for i in todo])
        for i, code in zip(todo, codes, strict=True):
            torn = code == 0 and m.pool.checksum[pages[i]] != sums[i]   # handed out while it was read
            if torn:
                await self.store.remove(keys[i])                        # never left there
            present[i] = code == 0 and not torn
        stored = [i for i in todo if present[i]]
        if await self.store.put_many([sum_key(keys[i]) for i in stored],
                                     [sums[i].to_bytes(8, "little") for i in stored]) != 0:
            m.counters["cluster_errors"] += 1
        m.counters["cluster_puts"] += len(stored)
        m.counters["cluster_bytes_out"] += len(stored) * self.block_bytes
        m.counters["cluster_errors"] += sum(1 for code in codes if code != 0)
        upto = present.index(False) if False in present else len(present)
        record = {"v": RECORD_VERSION, "model": model, "block_size": bs, "tokens": tokens,
                  "keys": keys[:upto], "checksums": sums[:upto], "salt": salt, "tenant": seq.tenant,
                  "retain_until": seq.retain_until}
        if await self.store.put(session_key(session), msgpack.packb(record)) != 0:
            raise RuntimeError("the store refused the session record")
        log.info("published a session to the cluster store", session=session, blocks=upto,
                 new_blocks=len(stored), tokens=len(tokens))

    async def _forget(self, session: str) -> None:
        await self.store.remove(session_key(session))
        log.info("removed a session from the cluster store", session=session)

    async def close(self) -> None:
        tasks = list(self._tasks.values()) + ([self._joining] if self._joining is not None else [])
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.store.close()
