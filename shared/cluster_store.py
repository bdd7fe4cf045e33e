"""Mooncake Store, as memd and kvroute use it: threads of its own, so no call ever blocks an event loop.

The store (Mooncake's `mooncake_master` and its HTTP metadata server, run by
the operator) keeps objects replicated over the memory segments its clients
contribute. memd is one such client (`memd --cluster-master ...`): it puts
the pages of parked sessions from its pool straight into the store, and
fetches pages other hosts published straight into pool pages (the pool is
registered with the transfer engine, so nothing is copied through Python);
small records of the sessions live beside them. kvroute is a client that
contributes no memory and keeps only its session directory there. The client needs `kvpool[cluster]`
(`mooncake-transfer-engine-non-cuda` on CPU machines) and, even over TCP,
the libibverbs1, libnuma1 and librdmacm1 system libraries.
"""

from __future__ import annotations

import asyncio
import os
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger("kvpool.cluster")

INSTALL_HINT = ("pip install 'kvpool[cluster]' (mooncake-transfer-engine-non-cuda; on Debian also "
                "apt install libibverbs1 libnuma1 librdmacm1)")


PROBE_TIMEOUT_S = 3.0
FETCH_TIMEOUT_S = 10.0


JOIN_RETRY_S = (1.0, 30.0)     # a store down at start-up: tried again after 1 s, doubling up to 30 s


class ClusterError(RuntimeError):
    """The store cannot be used as configured: the daemon refuses to start, in one line."""


class StoreUnreachable(ClusterError):
    """The store did not answer: it may be down for now. memd serves without it and joins it once it answers."""


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The --cluster-* flags of memd and kvroute."""

    master: str                       # HOST:PORT of mooncake_master's RPC server
    metadata: str                     # URL of its HTTP metadata server, e.g. http://HOST:8080/metadata
    host: str = ""                    # this host's name for the transfer engine (default: the host name)
    segment_bytes: int = 256 << 20    # memory this client contributes to the store (kvroute: none)
    replicas: int = 2                 # copies of each object, on different clients' segments


class ClusterStore:
    """The Mooncake client; every call runs on threads of its own and returns its result to the loop."""

    def __init__(self, config: ClusterConfig, pool_base: int = 0, pool_bytes: int = 0, page_bytes: int = 0,
                 *, owner: str = "memd") -> None:
        """`pool_*`: memd's pool, registered for zero-copy page puts and gets; kvroute has none."""
        self.config = config
        self._pool, self._page_bytes = (pool_base, pool_bytes), page_bytes
        # Threads of their own for each kind of call: a lookup before a Step must not queue behind a large
        # publish, nor a fetch a Step's reply waits for behind either (a store that is down holds a call ~4 s).
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{owner}-cluster-lookup")
        self._publishes = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{owner}-cluster-publish")
        self._fetches = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{owner}-cluster-fetch")
        self._store: Any = None
        self._replicate: Any = None

    async def start(self) -> None:
        """Join the store: set the client up, contribute the segment, register the pool for zero-copy puts."""
        await self._call(self._lookups, self._setup)

    def _setup(self) -> None:
        os.environ.setdefault("GLOG_minloglevel", "1")        # Mooncake's own INFO lines flood memd's log
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
        except ImportError as exc:
            raise ClusterError(f"--cluster-master needs Mooncake Store's client ({exc}): {INSTALL_HINT}") from None
        c = self.config
        _probe(c.master, c.metadata)
        store = MooncakeDistributedStore()
        rc = store.setup(c.host or socket.gethostname(), c.metadata, c.segment_bytes, 16 << 20, "tcp", "",
                         c.master)
        if rc != 0:
            raise StoreUnreachable(f"cannot join the Mooncake store at {c.master} (metadata {c.metadata}): "
                                   f"setup returned {rc}; is mooncake_master running there?")
        base, size = self._pool
        if size and store.register_buffer(base, size) != 0:
            raise ClusterError("cannot register memd's pool with Mooncake's transfer engine")
        replicate = ReplicateConfig()
        replicate.replica_num = c.replicas
        # Soft-pinned: under memory pressure the store evicts unpinned objects first; a pin lasts the master's
        # -default_kv_soft_pin_ttl (30 min unless set; -allow_evict_soft_pinned_objects=false makes it strict).
        replicate.soft_pin_action = SoftPinAction.ENABLE
        self._store, self._replicate = store, replicate

    @property
    def joined(self) -> bool:
        return self._store is not None

    def _client(self) -> Any:
        """The joined client; a call before memd joined fails as one to a store that does not answer."""
        if self._store is None:
            raise ConnectionError("not joined to the Mooncake store yet")
        return self._store

    @staticmethod
    async def _call(pool: ThreadPoolExecutor, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def exists(self, keys: list[str]) -> list[bool]:
        """One batched existence check; an error reads as absent."""
        if not keys:
            return []
        found = await self._call(self._publishes, self._client().batch_is_exist, keys)
        return [rc == 1 for rc in found]

    async def put_pages(self, keys: list[str], pages: list[int]) -> list[int]:
        """Put pool pages under `keys` straight from the pool; one return code per key (0: stored)."""
        base, size = self._pool[0], self._page_bytes
        return await self._call(self._publishes, self._client().batch_put_from, keys,
                                [base + p * size for p in pages], [size] * len(pages), self._replicate)

    def get_pages(self, keys: list[str], pages: list[int]) -> list[bool]:
        """Fetch objects straight into pool pages (called from the page copier's thread); whole or not, per key.

        A store that does not answer in FETCH_TIMEOUT_S fetched nothing: the
        session is cut at its first page and computed here.
        """
        base, size = self._pool[0], self._page_bytes
        try:
            job = self._fetches.submit(self._client().batch_get_into, keys, [base + p * size for p in pages],
                                       [size] * len(pages))
            got = job.result(timeout=FETCH_TIMEOUT_S)
        except Exception as exc:
            log.warning("a fetch from the cluster store failed; those pages are computed here", pages=len(pages),
                        error=str(exc) or type(exc).__name__)
            return [False] * len(pages)
        return [n == size for n in got]

    async def put(self, key: str, value: bytes) -> int:
        """A small object (a record), replacing what the key held."""
        return await self._call(self._publishes, self._client().upsert, key, value, self._replicate)

    async def put_many(self, keys: list[str], values: list[bytes]) -> int:
        """Small objects (block checksums); a key already there keeps its value. 0 when all went well."""
        return await self._call(self._publishes, self._client().put_batch, keys, values, self._replicate) if keys else 0

    async def get_many(self, keys: list[str]) -> list[bytes]:
        """Small objects; b"" for a key the store does not hold."""
        if not keys:
            return []
        return [bytes(v) if v else b"" for v in await self._call(self._lookups, self._client().get_batch, keys)]

    async def get(self, key: str) -> bytes | None:
        data = await self._call(self._lookups, self._client().get, key)
        return bytes(data) if data else None

    async def remove(self, key: str) -> int:
        """Gone now, whatever lease a reader holds on it (a reset session, a torn page)."""
        return await self._call(self._publishes, self._client().remove, key, True)

    async def health(self) -> int:
        """Mooncake's health check: 0 healthy, 1 client closed, 2 master unreachable."""
        return await self._call(self._lookups, self._client().health_check)

    def close(self) -> None:
        """Once every call in flight returned (a put still reads the pool): leave the store."""
        for pool in (self._fetches, self._publishes, self._lookups):
            pool.shutdown(wait=True)
        if self._store is not None:
            try:
                self._store.close()
            except Exception as exc:
                log.warning("could not leave the Mooncake store cleanly", error=str(exc))


def _probe(master: str, metadata: str) -> None:
    """Fail in a second, in one line, where Mooncake's client would retry for a minute and a half."""
    host, _, port = master.rpartition(":")
    if not port.isdigit():
        raise ClusterError(f"--cluster-master {master!r} is not HOST:PORT")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise StoreUnreachable(f"cannot join the Mooncake store: no mooncake_master at {master} "
                               f"({exc.strerror or exc})") from None
    try:
        urllib.request.urlopen(f"{metadata}?key=kvpool-probe", timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        pass                              # it answered: a metadata server that has no such key
    except ValueError as exc:
        raise ClusterError(f"--cluster-metadata {metadata!r} is not a URL ({exc})") from None
    except OSError as exc:
        raise StoreUnreachable(f"cannot join the Mooncake store: its metadata server {metadata} does not answer "
                               f"({getattr(exc, 'reason', None) or exc})") from None
