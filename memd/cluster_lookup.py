"""Before a Step: what the cluster store holds for it — sessions this memd does not hold, prefixes it lacks.

A Step that continues a session this memd does not hold (its host was lost,
or a balancer sent the turn here) reads the session's record; an Open whose
leading blocks miss the local prefix cache reads the checksums of the next
ones. All of a Step's reads run at once, under one deadline; what they find
is handed to that Step alone (`RemoteLookups`), whose ops then fetch the
pages. A store that is slow or down costs a Step at most the deadline, once:
lookups then stop for a while (a line in the log says so), and the sessions
and prefixes are computed here — never an error to the worker.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from memd.cluster import LOOKUP_TIMEOUT_S, block_keys, parse_record, session_key, sum_key
from memd.kv_state import Worker
from memd.manager import KvManager
from memd.sequences import RemoteLookups, RemotePrefix, prefix_space, shareable_blocks
from shared.cluster_store import ClusterStore
from shared.ops import Op, Open

log = structlog.get_logger("memd.cluster")

BACKOFF_S = 10.0               # after a store that did not answer, no lookups for this long
HEALTH_EVERY_S = 1.0           # the client's own view of the master, asked at most this often


class Lookups:
    """`StepRunner.lookups`: called with each Step's worker and ops."""

    def __init__(self, manager: KvManager, store: ClusterStore) -> None:
        self.manager, self.store = manager, store
        self._quiet_until = self._checked_at = 0.0

    async def __call__(self, worker_id: int, ops: list[Op]) -> RemoteLookups:
        found = RemoteLookups()
        m = self.manager
        worker = m.workers.get(worker_id)
        if worker is None or time.monotonic() < self._quiet_until:
            return found
        opens = [op for op in ops if isinstance(op, Open)]
        unknown = sorted({op.session_id for op in opens if op.continue_session and op.session_id
                          and op.session_id not in m.sessions})
        jobs = [self._session(session, worker, found) for session in unknown]
        jobs += [self._prefix(op, worker, found) for op in opens
                 if not (op.continue_session and op.session_id in m.sessions)]
        if not jobs:
            return found
        try:
            await asyncio.wait_for(asyncio.gather(*jobs), LOOKUP_TIMEOUT_S)
            # Mooncake's reads say "nothing there" when the master is gone, too: ask it now and then.
            if time.monotonic() - self._checked_at > HEALTH_EVERY_S:
                self._checked_at = time.monotonic()
                if (code := await asyncio.wait_for(self.store.health(), LOOKUP_TIMEOUT_S)) != 0:
                    raise ConnectionError(f"health check returned {code}")
        except Exception as exc:
            self._quiet_until = time.monotonic() + BACKOFF_S
            m.counters["cluster_errors"] += 1
            log.warning(f"the cluster store did not answer: sessions and prefixes are computed here for "
                        f"{BACKOFF_S:g} s", error=str(exc) or type(exc).__name__)
        return found

    async def _session(self, session: str, worker: Worker, found: RemoteLookups) -> None:
        data = await self.store.get(session_key(session))
        remote = parse_record(data) if data else None
        if remote is None or (remote.model, remote.block_size) != (worker.model, worker.block_size):
            return
        found.sessions[session] = remote
        log.info("fetching a session another host published", session=session, blocks=len(remote.keys),
                 tokens=len(remote.token_ids))

    async def _prefix(self, op: Open, worker: Worker, found: RemoteLookups) -> None:
        """The published blocks that extend a new sequence's local prefix hits: their checksums, one read.

        As the prefix cache, the last token is left to compute.
        """
        m, bs = self.manager, worker.block_size
        tokens = op.token_ids
        limit = shareable_blocks(len(tokens), bs)
        space = prefix_space(worker.model, op.cache_salt or "")
        local = sum(1 for _ in m.pool.cached_run(m.hasher.walk(space, tokens, bs, 0, b"", limit)))
        if local >= limit:
            return
        keys = block_keys(space, tokens, bs, limit)[local:]
        sums = []
        for value in await self.store.get_many([sum_key(k) for k in keys]):
            if len(value) != 8 or not int.from_bytes(value, "little"):
                break
            sums.append(int.from_bytes(value, "little"))
        if sums:
            found.prefixes[id(op)] = RemotePrefix(local, keys[:len(sums)], sums)
