"""Runs a worker's Step to the end: room made, state committed, journaled, pages filled, evictions done.

No gRPC here (memd.service decodes and encodes around it), so the whole of
a Step can run in-process too. `KvManager.step` applies the ops all or
nothing. When the pool is short, cold PARKED sequences are evicted (or
swap-outs already in flight awaited) and the Step runs again, a few rounds at
most; only when nothing parked can make room is it refused (PoolExhausted:
the worker preempts its own). A committed Step is journaled before any page
is handed out, then its outcome is carried out in the order
memd.step_outcome describes. Pages a worker waits for (`wanted_blocks`) and
the free-block watermark start evictions that run on after the reply.

The eviction policy's periodic sweep (`police`) lives here too: it starts
the same swap-out tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog

from memd.errors import KvError, OpError, PoolExhausted
from memd.eviction import Evicted
from memd.journal import WriteAheadLog
from memd.manager import KvManager
from memd.page_copier import PageCopier
from memd.quotas import QuotaExceeded
from memd.sequences import EvictionReason, RemoteLookups, SeqState, SwapOut
from memd.step_outcome import StepOutcome
from shared.ops import Op

log = structlog.get_logger("memd")

# Evict-and-retry rounds of a Step that finds the pool short, before it is refused.
PRESSURE_ROUNDS = 8


class StepRunner:
    def __init__(self, manager: KvManager, copier: PageCopier, wal: WriteAheadLog | None = None) -> None:
        self.manager, self.copier, self.wal = manager, copier, wal
        self._swap_tasks: dict[SwapOut, asyncio.Task[bool]] = {}
        self._pressure = asyncio.Event()
        # Called whenever sequences changed state (a drain waits for that).
        self.on_change: Callable[[], None] = lambda: None
        # Called with every committed Step once its pages are filled (the cluster tier publishes parks).
        self.after_step: list[Callable[[StepOutcome], None]] = []
        # Awaited before a Step runs, with its worker and ops: what the cluster store holds for it.
        self.lookups: Callable[[int, list[Op]], Awaitable[RemoteLookups]] | None = None

    async def run(self, worker_id: int, ops: list[Op], lease: bytes | None = None,
                  wanted_blocks: int = 0) -> StepOutcome:
        """The Step, committed and done; KvError (journaled, counted) when it is refused."""
        m = self.manager
        try:
            remote = await self.lookups(worker_id, ops) if self.lookups is not None else None
            outcome = await self._run_making_room(worker_id, ops, lease, remote)
        except KvError:
            self.refused()
            raise
        self.persist()              # write-ahead: journaled before the worker may write a page it was given
        if not outcome.evictions and not self._behind_earlier(outcome) and self.copier.inline(outcome.effects):
            # Nothing to wait for (most decode Steps): done here, without a task and its turns of the loop.
            try:
                corrupt = self.copier.apply_inline(outcome.effects) if outcome.effects else []
            except BaseException:
                self._land(outcome, None)
                raise
            self._land(outcome, corrupt)
            self._observed(outcome)
        else:
            # The Step is committed: what follows must finish even if the caller is cancelled.
            await asyncio.shield(asyncio.ensure_future(self._after_commit(outcome)))
        if outcome.called_off:
            await self.settle()          # a reset answers with its sequence's slots back, not a copy later
        self.on_change()
        wanted = min(wanted_blocks, m.pool.num_blocks) - m.pool.num_free
        if wanted > 0:
            self.start(m.evictions.make_room(wanted, reason=EvictionReason.PRESSURE))
        if m.pool.num_free < m.evictions.watermark_blocks:
            self._pressure.set()
        return outcome

    def wake(self) -> None:
        """Sweep now rather than at the next tick (a quota changed)."""
        self._pressure.set()

    def refused(self) -> None:
        """A Step was refused (here, or by the servicer that could not decode it): counted; evictions made stand."""
        self.manager.counters["steps_refused"] += 1
        self.persist()

    async def _run_making_room(self, worker_id: int, ops: list[Op], lease: bytes | None,
                               remote: RemoteLookups | None = None) -> StepOutcome:
        for _ in range(PRESSURE_ROUNDS):
            try:
                return self.manager.step(worker_id, ops, lease, remote)
            except OpError as err:
                if isinstance(err.cause, QuotaExceeded):
                    await self._within_quota(err, err.cause, ops)
                    continue
                if not isinstance(err.cause, PoolExhausted):
                    raise
                short, evictions, named = err.cause.needed - err.cause.free, self.manager.evictions, self._named(ops)
                if evictions.reclaimable(named, enough=short) < short:
                    raise          # evicting would lose cached KV and still not make room
                evicted = evictions.make_room(short, reason=EvictionReason.PRESSURE, exclude=named)
                self.start(evicted)
                self.manager.counters["steps_waited_for_room"] += 1
                if self._swap_tasks:
                    await asyncio.wait(set(self._swap_tasks.values()), return_when=asyncio.FIRST_COMPLETED)
                elif not evicted.blocks_freed:
                    raise
        try:
            return self.manager.step(worker_id, ops, lease, remote)
        except OpError as err:
            if isinstance(err.cause, QuotaExceeded):
                self.manager.quotas.refusals[err.cause.key] += 1
            raise

    async def _within_quota(self, err: OpError, cause: QuotaExceeded, ops: list[Op]) -> None:
        """A Step would take a holder past its max: its own coldest parked sequences go (never another
        holder's), and the Step runs again once they have; refused (and counted) when they cannot make room."""
        evicted = self.manager.evictions.within_quota(cause.key, cause.usage - cause.limit,
                                                      reason=EvictionReason.QUOTA, exclude=self._named(ops))
        if evicted is None or not (evicted.jobs or evicted.dropped or self._swap_tasks):
            self.manager.quotas.refusals[cause.key] += 1
            raise err
        self.start(evicted)
        if self._swap_tasks:
            await asyncio.wait(set(self._swap_tasks.values()), return_when=asyncio.FIRST_COMPLETED)

    def _named(self, ops: list[Op]) -> frozenset[int]:
        """Sequences a Step names: pressure must not evict what the Step is about to use."""
        named = set()
        for op in ops:
            if seq_id := getattr(op, "seq_id", None):
                named.add(seq_id)
            if (session := getattr(op, "session_id", None)) and session in self.manager.sessions:
                named.add(self.manager.sessions[session])
        return frozenset(named)

    def _behind_earlier(self, outcome: StepOutcome) -> bool:
        """A sequence an earlier Step's copies still fill (its worker died waiting for a swap-in, and this is
        the retry): this Step's effects wait for those."""
        m = self.manager
        return any(m.filling(r.seq_id) and r.seq_id not in outcome.filling for r in outcome.results)

    async def _after_commit(self, outcome: StepOutcome) -> None:
        """Page effects, then what they free: swap slots read, prefix blocks now written, preemptions."""
        if self._behind_earlier(outcome):
            await self.copier.queued_effects_done()     # the copier is FIFO: this waits for those copies
        try:
            corrupt = await self.copier.apply(outcome.effects) if outcome.effects else []
        except BaseException:
            self._land(outcome, None)
            raise
        self._land(outcome, corrupt)
        if outcome.evictions:
            await self._evict_parked(outcome)
        self._observed(outcome)                   # here: shielded, so a cancelled caller skips none

    def _observed(self, outcome: StepOutcome) -> None:
        """A committed Step's effects landed: its observers (the cluster tier publishes what it parked) see it,
        whichever way it settled."""
        for observer in self.after_step:
            observer(outcome)

    def _land(self, outcome: StepOutcome, corrupt: list[int] | None) -> None:
        """The effects are done, `corrupt` the pages they found bad (None: they failed): the pages they filled
        join the prefix cache, the swap slots they read go free, and the journal learns of both."""
        m = self.manager
        try:
            if corrupt is not None:
                m.effects_landed(outcome, corrupt)
        finally:
            m.release_slots(outcome.read_slots)
            self.persist()

    async def _evict_parked(self, outcome: StepOutcome) -> None:
        """Preempted (or operator-revoked) sequences this Step parked: swap or drop them before the reply."""
        m, tasks = self.manager, []
        for eviction in outcome.evictions:
            if m.evictable(eviction.seq):
                m.revoked.pop(eviction.seq.seq_id, None)
                tasks += self.start(m.evictions.evict(eviction.seq, eviction.mode, eviction.reason))
        if tasks:
            await asyncio.gather(*tasks)
        for result in outcome.results:
            seq = m.seqs.get(result.seq_id)
            if seq is not None and result.state == "parked" and seq.state in (SeqState.SWAPPED, SeqState.DROPPED):
                result.state, result.num_blocks, result.first_block = seq.state.value, 0, 0

    def start(self, evicted: Evicted) -> list[asyncio.Task[bool]]:
        """Launch the copies of swap-outs the manager began; drops are already done."""
        self.persist()
        if evicted.dropped:
            log.info("dropped", seq_ids=evicted.dropped, blocks_freed=evicted.blocks_freed)
        tasks = []
        for job in evicted.jobs:
            task = asyncio.ensure_future(self._swap_out(job))
            self._swap_tasks[job] = task
            task.add_done_callback(lambda _task, job=job: self._swap_tasks.pop(job, None))
            tasks.append(task)
        return tasks

    async def settle(self) -> None:
        """Until every swap-out called off has stopped copying and given its slots back (a chunk's copy at most).

        What calls a swap-out off (a Free, a Resume, a drop) answers only then:
        the slots it let go are free when its caller hears back.
        """
        m = self.manager
        while pending := [self._swap_tasks[job] for job in m.stopping if job in self._swap_tasks]:
            await asyncio.wait(pending)

    async def _swap_out(self, job: SwapOut) -> bool:
        try:
            checksums = await self.copier.swap_out(list(zip(job.blocks, job.slots, strict=True)), job.ticket)
        except Exception:
            log.exception("swap-out failed; the sequence stays parked", seq=job.seq.seq_id)
            self.manager.evictions.abort_swap_out(job)
            return False
        if checksums is None:                 # called off: the sequence was resumed, freed or dropped
            self.manager.evictions.abort_swap_out(job)
            self.persist()
            return False
        job.checksums = checksums
        done = self.manager.evictions.finish_swap_out(job)
        self.persist()
        if done:
            log.info("swapped out", seq=job.seq.seq_id, blocks=len(job.slots), blocks_freed=job.blocks_freed,
                     reason=job.reason or "preempted")
        return done

    async def evict(self, evicted: Evicted) -> list[int]:
        """An operator's eviction: wait for its swap-outs; returns the sequences actually swapped out."""
        tasks = self.start(evicted)
        done = await asyncio.shield(asyncio.gather(*tasks))
        await self.settle()                   # a drop of a sequence being swapped out: its slots are back
        return [job.seq.seq_id for job, ok in zip(evicted.jobs, done, strict=True) if ok]

    async def police(self) -> None:
        """The eviction policy's periodic sweep (idle TTL, revocations, watermark), sooner when woken."""
        ttl = self.manager.evictions.idle_ttl_s
        tick = min(1.0, ttl / 4) if ttl else 1.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pressure.wait(), tick)   # a periodic sweep, or a wake-up
            self._pressure.clear()
            try:
                self.start(self.manager.evictions.sweep(time.monotonic()))
            except Exception:        # a bug must not silently end the policy: log it, sweep again
                log.exception("eviction sweep failed")

    def persist(self) -> None:
        """Journal what changed, if memd keeps a state directory.

        Called after every change and before any reply that hands out a page, so
        the journal never lags behind what a worker may have written.
        """
        if self.wal is not None:
            self.wal.flush(self.manager)
        else:
            self.manager.take_changes()      # no journal: nobody else would ever take them

    async def close(self) -> None:
        """Wait for swap copies and queued page effects: the pool must outlive them."""
        if self._swap_tasks:
            await asyncio.wait(set(self._swap_tasks.values()))
        self.copier.close()
        self.persist()

