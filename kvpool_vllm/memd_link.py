"""memd as a synchronous engine sees it: an attachment held by a thread of its own, re-made when memd comes back.

vLLM calls its connector from plain threads (the scheduler's, a worker's)
and must never wait long on a store that is gone. So the connector's
MemdClient lives on an asyncio loop in a daemon thread: the engine's
thread hands it a coroutine and waits at most `timeout_s` for the answer.
While memd is unreachable or restarting the link is down: calls raise
`MemdDown` at once (the connector answers 0 hits and drops saves), a
warning is logged once per outage and counted, and the thread attaches
again with a growing backoff; each new attachment gets a new `epoch`, so
state kept under an old one (memd's sequence ids) is known to be gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import structlog

from shared.client import MemdClient, MemdError

log = structlog.get_logger("kvpool.vllm")
T = TypeVar("T")

BACKOFF_S = (0.2, 5.0)          # first and longest wait between two attach attempts


class MemdDown(Exception):
    """memd cannot be asked now (unreachable, restarting, or too slow to answer)."""


@dataclass(frozen=True, slots=True)
class AttachSpec:
    """What the link attaches as: memd's address, the engine's K/V namespace, its block geometry, its name."""

    address: str | None
    model: str
    block_size: int
    bytes_per_token: int
    name: str
    map_memory: bool = False


@dataclass(slots=True)
class LinkCounters:
    outages: int = 0            # times the link went down
    attaches: int = 0
    calls_failed: int = 0       # calls that found memd down or failed on the way
    extra: dict[str, int] = field(default_factory=dict)


class MemdLink:
    """An attachment to memd kept by a background thread; `call` runs a coroutine on it from any thread."""

    def __init__(self, spec: AttachSpec, timeout_s: float = 5.0,
                 on_attach: Callable[[MemdClient, int], None] | None = None) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.on_attach = on_attach
        self.counters = LinkCounters()
        self.epoch = 0                       # which attachment: a new one after every outage
        self.client: MemdClient | None = None
        self._loop = asyncio.new_event_loop()
        self._up = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kvpool-memd-{spec.name}", daemon=True)
        self._thread.start()

    @property
    def up(self) -> bool:
        return self._up.is_set()

    def wait_up(self, timeout_s: float) -> bool:
        return self._up.wait(timeout_s)

    def call(self, make: Callable[[MemdClient], Awaitable[T]], timeout_s: float | None = None) -> tuple[T, int]:
        """`make(client)` awaited on the link's loop; returns (its result, the epoch it ran in).

        MemdDown if the link is down or memd did not answer in time (the link is then let go and re-made);
        MemdError as memd refused it (the link stays up)."""
        client, epoch = self.client, self.epoch
        if client is None or not self._up.is_set():
            self.counters.calls_failed += 1
            raise MemdDown("memd is not attached")
        future: Future[T] = asyncio.run_coroutine_threadsafe(self._guarded(make, client), self._loop)
        try:
            return future.result(self.timeout_s if timeout_s is None else timeout_s), epoch
        except FutureTimeout:
            future.cancel()
            self.counters.calls_failed += 1
            self._lost(epoch, "memd did not answer in time")
            raise MemdDown("memd did not answer in time") from None
        except MemdError as err:
            if err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                self.counters.calls_failed += 1
                self._lost(epoch, str(err))
                raise MemdDown(str(err)) from None
            raise

    async def _guarded(self, make: Callable[[MemdClient], Awaitable[T]], client: MemdClient) -> T:
        return await make(client)

    def _lost(self, epoch: int, why: str) -> None:
        """The attachment of `epoch` is gone: the thread lets it go and attaches again."""
        if epoch == self.epoch and self._up.is_set():
            self._up.clear()
            self._loop.call_soon_threadsafe(self._wake.set)
            log.warning("memd unreachable: the vLLM connector goes on without it (0 hits, saves skipped) and "
                        "attaches again by itself", name=self.spec.name, why=why)

    def close(self) -> None:
        self._stopping = True
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._wake.set)
        self._thread.join(timeout=10)

    # ---- the thread ----------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._wake = asyncio.Event()
        try:
            self._loop.run_until_complete(self._hold())
        finally:
            self._loop.close()

    async def _hold(self) -> None:
        backoff, announced = BACKOFF_S[0], False
        while not self._stopping:
            try:
                client = await MemdClient.attach(self.spec.address, model=self.spec.model,
                                                 block_size=self.spec.block_size,
                                                 bytes_per_token=self.spec.bytes_per_token, name=self.spec.name,
                                                 map_memory=self.spec.map_memory)
            except (MemdError, OSError, RuntimeError) as err:
                if isinstance(err, MemdError) and err.code == grpc.StatusCode.INVALID_ARGUMENT:
                    log.error("memd refused the vLLM connector's attachment; it serves without memd",
                              name=self.spec.name, why=err.message)
                    return
                if not announced:
                    log.warning("memd unreachable; the vLLM connector attaches again by itself",
                                name=self.spec.name, error=str(err))
                    announced = True
                await self._pause(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])
                continue
            backoff, announced = BACKOFF_S[0], False
            self.epoch += 1
            self.client = client
            self.counters.attaches += 1
            if self.on_attach is not None:
                self.on_attach(client, self.epoch)
            self._wake.clear()
            self._up.set()
            log.info("attached to memd", name=self.spec.name, model=self.spec.model, worker=client.worker_id,
                     epoch=self.epoch)
            lease = asyncio.ensure_future(client.lease_lost.wait())
            woken = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait({lease, woken}, return_when=asyncio.FIRST_COMPLETED)
            for task in (lease, woken):
                task.cancel()
            if self._up.is_set():
                self._up.clear()
                if not self._stopping:
                    log.warning("memd lease lost: the vLLM connector goes on without memd and attaches again",
                                name=self.spec.name)
            if not self._stopping:
                self.counters.outages += 1
            self.client = None
            with contextlib.suppress(Exception):
                await client.close()

    async def _pause(self, seconds: float) -> None:
        """The backoff between attach attempts, cut short by close()."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()
