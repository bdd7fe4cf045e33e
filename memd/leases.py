"""Workers' leases: what memd tells each worker, when a worker is reclaimed, and operators' drains.

A worker holds its lease through a Session stream (memd.service speaks it):
heartbeats up, notices down. A worker whose heartbeats stop for the lease
timeout, or whose stream ends, is reclaimed: its sequences are parked and
the pages it may still write are fenced (memd.fences). One that said goodbye
finished its last pass first, so nothing of it is fenced.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import structlog

from memd.fences import FenceWatch
from memd.kv_state import Worker
from memd.manager import KvManager
from memd.sequences import SeqState
from memd.step_runner import StepRunner

log = structlog.get_logger("memd")


@dataclass(frozen=True, slots=True)
class Notice:
    """A message down a worker's Session stream."""

    event: str                  # "revoked", "drain", "undrain"
    reason: str
    seq_id: int = 0


def revocation(seq_id: int, mode: str) -> Notice:
    return Notice("revoked", f"evicted by an operator (memctl evict, {mode}): give the sequence up", seq_id)


class Leases:
    def __init__(self, manager: KvManager, runner: StepRunner, fences: FenceWatch, lease_timeout_s: float) -> None:
        self.manager, self.runner, self.fences = manager, runner, fences
        self.lease_timeout_s = lease_timeout_s
        # Per streaming worker: notices to send down its Session stream; None ends it (lease expired).
        self.outboxes: dict[int, asyncio.Queue[Notice | None]] = {}
        # Drains: of every worker (new ones included), or of some. A drain waits on _activity.
        self.drain_all = False
        self.draining: set[int] = set()
        self._activity: asyncio.Event | None = None
        runner.on_change = self.changed

    def open_stream(self, worker: Worker) -> asyncio.Queue[Notice | None]:
        """The worker's outbox, holding what it missed: revocations made before it streamed, a drain."""
        outbox = self.outboxes[worker.worker_id] = asyncio.Queue()
        for seq_id, mode in self.manager.revoked.items():
            if (seq := self.manager.seqs.get(seq_id)) is not None and seq.owner == worker.worker_id:
                outbox.put_nowait(revocation(seq_id, mode))
        if self.is_draining(worker.worker_id):
            outbox.put_nowait(Notice("drain", "memd is draining"))
        return outbox

    def close_stream(self, worker_id: int, reason: str) -> None:
        self.outboxes.pop(worker_id, None)
        self.reclaim(worker_id, reason)

    def tell(self, worker_id: int, notice: Notice) -> None:
        if (outbox := self.outboxes.get(worker_id)) is not None:
            outbox.put_nowait(notice)

    def reclaim(self, worker_id: int, reason: str) -> None:
        if worker_id not in self.manager.workers:
            return
        # A worker that said goodbye finished its last pass first; any other may still be in one.
        parked, freed = self.manager.reclaim(worker_id, fence=reason != "goodbye")
        self.fences.watch()
        self.runner.persist()
        self.draining.discard(worker_id)
        self.changed()
        log.info("worker reclaimed", worker=worker_id, reason=reason, parked=parked, freed=freed)

    async def reap_expired(self) -> None:
        """Reclaim workers whose heartbeats stopped; ends their stream if it is still open."""
        interval = min(1.0, self.lease_timeout_s / 4)
        while True:
            due = time.monotonic() + interval
            await asyncio.sleep(interval)     # a periodic sweep, not a wait for an event
            late = time.monotonic() - due
            if late > interval:
                # memd itself did not run (a starved or stopped process): the heartbeats of that
                # time may still sit unread on the sockets. Judge leases only once they were read.
                log.warning("memd's event loop stalled; lease checks wait a round", stalled_s=round(late, 3))
                continue
            for worker_id in self.manager.expired_workers(time.monotonic(), self.lease_timeout_s):
                self.reclaim(worker_id, "lease expired")
                outbox = self.outboxes.get(worker_id)
                if outbox is not None:
                    outbox.put_nowait(None)     # the stream handler ends the stream with a status

    # ---- drains --------------------------------------------------------

    def is_draining(self, worker_id: int) -> bool:
        return self.drain_all or worker_id in self.draining

    def running_on(self, worker_ids: list[int]) -> int:
        """Sequences these workers run, or preempted and mean to resume: what a drain waits for."""
        owners = set(worker_ids)
        return sum(1 for s in self.manager.seqs.values()
                   if (s.state is SeqState.RUNNING and s.owner in owners) or s.preempted_by in owners)

    async def drain(self, worker_id: int, *, undo: bool, wait_s: float) -> list[int]:
        """Stop (or resume) admitting on one worker (0: all); wait up to `wait_s` for what they run to end.

        Returns the workers the drain covered; the caller checked the arguments.
        """
        targets = [worker_id] if worker_id else list(self.manager.workers)
        if undo:
            if worker_id:
                self.draining.discard(worker_id)
            else:
                self.drain_all = False
                self.draining.clear()
        elif worker_id:
            self.draining.add(worker_id)
        else:
            self.drain_all = True
        event = "undrain" if undo else "drain"
        for target in targets:
            self.tell(target, Notice(event, f"an operator asked (memctl drain): {event}"))
        log.info(event, worker=worker_id or "all", running=self.running_on(targets))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not undo and self.running_on(targets) and (left := deadline - loop.time()) > 0:
            await self._changes(left)
        return targets

    def changed(self) -> None:
        """Sequences changed state: wake whoever waits for that (a drain)."""
        if self._activity is not None:
            self._activity.set()
            self._activity = None

    async def _changes(self, timeout_s: float) -> None:
        if self._activity is None:
            self._activity = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._activity.wait(), timeout_s)
