"""gRPC servicer: decode a request, call the manager, encode the reply.

No policy lives here (that is memd.eviction): this layer runs what the
manager decides — page effects and swap copies off the event loop, the
policy's periodic sweep — and is the one place that maps the manager's typed
errors (memd.errors) to gRPC status codes.

A Step that finds the pool short does not fail at once: memd evicts cold
PARKED sequences (or waits for swap-outs already in flight) and runs the
Step again, a few rounds at most. Only when nothing parked can make room
does the worker hear RESOURCE_EXHAUSTED — then it preempts its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog
from prometheus_client import Histogram

from memd.errors import InvalidArgument, KvError, OpError, PoolExhausted
from memd.eviction import Evicted
from memd.fdpass import FdServer
from memd.manager import Effect, KvManager, StepOutcome
from memd.memory import PoolMemory
from memd.sequences import SeqState, SwapOut
from memd.state import WriteAheadLog
from memd.swap import SwapMemory, run_effects
from shared.logs import enabled
from shared.ops import Op
from shared.rpc import memd_pb2 as pb
from shared.rpc import memd_pb2_grpc as pb_grpc
from shared.wire import FREE_BLOCKS_KEY, OP_INDEX_KEY, WireError, encode_handle, op_from_proto, result_to_proto

log = structlog.get_logger("memd")

# Effects larger than this run off the event loop, so other workers' Steps
# are answered while a big page copy is in flight.
INLINE_EFFECT_BYTES = 1 << 20
# Evict-and-retry rounds of a Step that finds the pool short, before it is refused.
PRESSURE_ROUNDS = 8


async def _abort(context: grpc.aio.ServicerContext, err: KvError, free_blocks: int | None = None) -> None:
    metadata = []
    if isinstance(err, OpError):
        metadata.append((OP_INDEX_KEY, str(err.index)))
    if free_blocks is not None:
        metadata.append((FREE_BLOCKS_KEY, str(free_blocks)))
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(getattr(grpc.StatusCode, err.code), str(err))


def _revocation(seq_id: int, mode: str) -> pb.SessionDown:
    return pb.SessionDown(event="revoked", seq_id=seq_id,
                          reason=f"evicted by an operator (memctl evict, {mode}): give the sequence up")


class MemdService(pb_grpc.MemdServicer):
    def __init__(self, manager: KvManager, memory: PoolMemory, fd_server: FdServer | None, *,
                 lease_timeout_s: float, generation: int, swap: SwapMemory | None = None,
                 wal: WriteAheadLog | None = None) -> None:
        self.manager = manager
        self.wal = wal
        self.memory = memory
        self.swap = swap
        self.fd_server = fd_server
        self.lease_timeout_s = lease_timeout_s
        self.generation = generation
        self.started = time.monotonic()
        # Per streaming worker: revocations to send down its Session stream; None ends it (lease expired).
        self._outbox: dict[int, asyncio.Queue[pb.SessionDown | None]] = {}
        # One thread, first in first out, and nothing inline while it has work:
        # the effects of successive Steps land on the pages in Step order.
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memd-pages")
        self._busy_pages: Counter[int] = Counter()      # pages that queued effects still touch
        # Swap-outs: long copies on a thread of their own, so Steps' small effects never queue behind them.
        self._swapper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memd-swap")
        self._swap_tasks: set[asyncio.Task[bool]] = set()
        self._pressure = asyncio.Event()
        self.step_seconds: Histogram | None = None         # Prometheus, when --metrics-port is on
        self.rpcs: Counter[str] = Counter()                 # calls per method (RpcCounter counts them)
        # Drains: of every worker (new ones included), or of some. Drain waits on _activity.
        self.drain_all = False
        self.draining: set[int] = set()
        self._activity: asyncio.Event | None = None
        self._pidfds: dict[int, int] = {}      # fenced workers' processes (watch_fences)

    # ---- workers -------------------------------------------------------

    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachReply:
        try:
            worker = self.manager.attach(request.name, request.pid, request.model, request.block_size,
                                         request.bytes_per_token)
        except KvError as err:
            await _abort(context, err)
        if worker.pid in self.manager.fences:
            self.lift(worker.pid, "it attached again: its last pass is over")
        handle = self.memory.export()
        if self.fd_server is not None:
            handle |= {"socket": str(self.fd_server.path), "token": self.fd_server.issue()}
        g = self.manager.geometry
        log.info("worker attached", worker=worker.worker_id, name=worker.name, pid=worker.pid,
                 model=worker.model, block_size=worker.block_size)
        return pb.AttachReply(
            worker_id=worker.worker_id,
            geometry=pb.Geometry(backend=self.memory.backend, num_blocks=g.num_blocks, block_bytes=g.block_bytes,
                                 pool_bytes=g.pool_bytes, block_size=worker.block_size,
                                 bytes_per_token=request.bytes_per_token or g.bytes_per_token,
                                 generation=self.generation),
            pool_handle=encode_handle(handle), lease_timeout_s=self.lease_timeout_s, lease=worker.lease)

    async def Session(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        try:
            worker = self.manager.worker(first.worker_id, first.lease)
        except KvError as err:
            await _abort(context, err)
        if worker.streaming:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"worker {worker.worker_id} already holds a lease stream")
        worker.streaming = True
        outbox = self._outbox[worker.worker_id] = asyncio.Queue()
        for seq_id, mode in self.manager.revoked.items():          # revoked before the stream opened
            if (seq := self.manager.seqs.get(seq_id)) is not None and seq.owner == worker.worker_id:
                outbox.put_nowait(_revocation(seq_id, mode))
        if self.is_draining(worker.worker_id):
            outbox.put_nowait(pb.SessionDown(event="drain", reason="memd is draining"))
        reason = "stream broken"
        read: asyncio.Future | None = None
        down: asyncio.Future | None = None
        try:
            await context.write(pb.SessionDown(event="granted"))
            log.info("lease granted", worker=worker.worker_id)
            while True:
                read = read or asyncio.ensure_future(context.read())
                down = asyncio.ensure_future(outbox.get())
                await asyncio.wait({read, down}, return_when=asyncio.FIRST_COMPLETED)
                if down.done():
                    if (message := down.result()) is None:
                        reason = "lease expired"
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                            f"lease expired: no heartbeat for {self.lease_timeout_s:g} s; attach again")
                    await context.write(message)
                    continue
                down.cancel()
                msg, read = read.result(), None
                if msg is grpc.aio.EOF:
                    break
                if msg.goodbye:
                    reason = "goodbye"
                    break
                worker.last_seen = time.monotonic()
        finally:
            for pending in (read, down):
                if pending is not None:
                    pending.cancel()
            self._outbox.pop(worker.worker_id, None)
            self.reclaim(worker.worker_id, reason)

    def reclaim(self, worker_id: int, reason: str) -> None:
        if worker_id not in self.manager.workers:
            return
        # A worker that said goodbye finished its last pass first; any other may still be in one.
        parked, freed = self.manager.reclaim(worker_id, fence=reason != "goodbye")
        self.watch_fences()
        self.persist()
        self.draining.discard(worker_id)
        self._settled()
        log.info("worker reclaimed", worker=worker_id, reason=reason, parked=parked, freed=freed)

    def watch_fences(self) -> None:
        """Lift each pid's fence when its process exits (a pidfd turns readable); at once if it is gone."""
        loop = asyncio.get_running_loop()
        for pid in list(self.manager.fences):
            if pid in self._pidfds:
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                self.lift(pid, "its process is gone")
                continue
            except OSError as exc:        # no pidfd here: the fence lasts until the worker attaches again
                log.warning("cannot watch a fenced worker's process", pid=pid, error=exc.strerror)
                self._pidfds[pid] = -1
                continue
            self._pidfds[pid] = pidfd
            loop.add_reader(pidfd, self.lift, pid, "its process exited")
            log.info("pages fenced until the worker's process exits or attaches again", pid=pid,
                     blocks=len(self.manager.fences[pid]))

    def _unwatch(self, pid: int) -> None:
        pidfd = self._pidfds.pop(pid, None)
        if pidfd is not None and pidfd >= 0:
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)

    def lift(self, pid: int, why: str) -> None:
        self._unwatch(pid)
        freed = self.manager.lift(pid)
        self.persist()
        log.info("fence lifted", pid=pid, reason=why, blocks_freed=freed)

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
                outbox = self._outbox.get(worker_id)
                if outbox is not None:
                    outbox.put_nowait(None)     # the stream handler ends the stream with a status

    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepReply:
        if self.step_seconds is None:
            return await self._step(request, context)
        with self.step_seconds.time():
            return await self._step(request, context)

    async def _step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepReply:
        try:
            ops = []
            for index, op in enumerate(request.ops):
                try:
                    ops.append(op_from_proto(op))
                except WireError as exc:
                    raise OpError(index, "decode", InvalidArgument(str(exc))) from None
            outcome = await self._step_making_room(request.worker_id, ops, request.lease)
        except KvError as err:
            log.debug("rpc", method="Step", worker=request.worker_id, ops=len(request.ops), error=str(err))
            self.manager.counters["steps_refused"] += 1
            self.persist()          # evictions made on the way stand
            await _abort(context, err, self.manager.pool.num_free)
        self.persist()              # write-ahead: journaled before the worker may write a page it was given
        results = [result_to_proto(r) for r in outcome.results]
        # The Step is committed: what follows must finish even if the client cancels or its deadline passes.
        await asyncio.shield(asyncio.ensure_future(self._after_commit(outcome, results)))
        self._settled()
        m = self.manager
        wanted = min(request.wanted_blocks, m.pool.num_blocks) - m.pool.num_free
        if wanted > 0:
            self._start(m.evictions.make_room(wanted, reason="pressure"))
        if m.pool.num_free < m.evictions.watermark_blocks:
            self._pressure.set()
        if enabled(logging.DEBUG):
            self._trace(request.worker_id, ops, outcome)
        return pb.StepReply(results=results, free_blocks=m.pool.num_free)

    async def _step_making_room(self, worker_id: int, ops: list[Op], lease: bytes) -> StepOutcome:
        """Run a Step; when the pool is short, evict cold parked sequences and run it again."""
        for _ in range(PRESSURE_ROUNDS):
            try:
                return self.manager.step(worker_id, ops, lease)
            except OpError as err:
                if not isinstance(err.cause, PoolExhausted):
                    raise
                short, evictions = err.cause.needed - err.cause.free, self.manager.evictions
                plan = evictions.plan(time.monotonic(), self._named(ops))
                if evictions.reclaimable(plan=plan) < short:
                    raise          # evicting would lose cached KV and still not make room
                evicted = evictions.make_room(short, reason="pressure", plan=plan)
                self._start(evicted)
                self.manager.counters["steps_waited_for_room"] += 1
                if self._swap_tasks:
                    await asyncio.wait(set(self._swap_tasks), return_when=asyncio.FIRST_COMPLETED)
                elif not evicted.blocks_freed:
                    raise
        return self.manager.step(worker_id, ops, lease)

    def _trace(self, worker_id: int, ops: list[Op], outcome: StepOutcome) -> None:
        """One debug event per sequence change (--log-level debug): open, extend, park, resume, free, fork.

        Each names the sequence's pages after the Step, so a page can be followed from tenant to tenant.
        """
        for op, result in zip(ops, outcome.results, strict=True):
            seq = self.manager.seqs.get(result.seq_id)
            log.debug(f"seq {type(op).__name__.lower()}", worker=worker_id, seq=result.seq_id,
                      session=getattr(op, "session_id", None), state=result.state, blocks=result.num_blocks,
                      pages=list(seq.block_ids) if seq is not None else [], committed=result.num_committed,
                      cached=result.num_cached)

    def _named(self, ops: list[Op]) -> frozenset[int]:
        """Sequences a Step names: pressure must not evict what the Step is about to use."""
        named = set()
        for op in ops:
            if seq_id := getattr(op, "seq_id", None):
                named.add(seq_id)
            if (session := getattr(op, "session_id", None)) and session in self.manager.sessions:
                named.add(self.manager.sessions[session])
        return frozenset(named)

    async def _after_commit(self, outcome: StepOutcome, results: list[pb.OpResult]) -> None:
        """Page effects, then what they free: swap slots read, prefix blocks now written, preemptions."""
        m = self.manager
        if (m.pending - outcome.pending).intersection(r.seq_id for r in outcome.results):
            # A sequence an earlier Step's copies still fill (its worker died waiting for a swap-in, and
            # this is the retry): the copier is FIFO, so a no-op queued now ends after those copies.
            await asyncio.get_running_loop().run_in_executor(self._copier, lambda: None)
        try:
            if outcome.effects:
                await self._apply(outcome.effects)
            self.manager.register_swapped_in(outcome.register_after)
            self.manager.settle(outcome.pending)
        finally:
            self.manager.release_slots(outcome.read_slots)
            self.persist()
        if outcome.evict_after:
            await self._evict_parked(outcome.evict_after, results)

    async def _evict_parked(self, evict_after: list, results: list[pb.OpResult]) -> None:
        """Preempted (or operator-revoked) sequences this Step parked: swap or drop them before the reply."""
        m, tasks = self.manager, []
        for seq, mode, reason in evict_after:
            if m.seqs.get(seq.seq_id) is seq and seq.state is SeqState.PARKED and seq.seq_id not in m.swap_jobs:
                m.revoked.pop(seq.seq_id, None)
                tasks += self._start(m.evictions.evict(seq, mode, reason))
        if tasks:
            await asyncio.gather(*tasks)
        for result in results:
            seq = m.seqs.get(result.seq_id)
            if seq is not None and result.state == "parked" and seq.state in (SeqState.SWAPPED, SeqState.DROPPED):
                result.state, result.num_blocks, result.first_block = seq.state.value, 0, 0

    def _start(self, evicted: Evicted) -> list[asyncio.Task[bool]]:
        """Launch the copies of swap-outs the manager began; drops are already done."""
        self.persist()
        if evicted.dropped:
            log.info("dropped", seq_ids=evicted.dropped, blocks_freed=evicted.blocks_freed)
        tasks = []
        for job in evicted.jobs:
            task = asyncio.ensure_future(self._swap_out(job))
            self._swap_tasks.add(task)
            task.add_done_callback(self._swap_tasks.discard)
            tasks.append(task)
        return tasks

    async def _swap_out(self, job: SwapOut) -> bool:
        assert self.swap is not None
        pairs = list(zip(job.blocks, job.slots, strict=True))
        loop = asyncio.get_running_loop()
        try:
            if not self._busy_pages.keys().isdisjoint(job.blocks):
                # Its pages still have effects queued (a swap-in, a fork's copy): copy what they will hold.
                await loop.run_in_executor(self._copier, lambda: None)
            await loop.run_in_executor(self._swapper, self.swap.copy_out, pairs)
        except Exception:
            log.exception("swap-out failed; the sequence stays parked", seq=job.seq.seq_id)
            self.manager.evictions.abort_swap_out(job)
            return False
        done = self.manager.evictions.finish_swap_out(job)
        self.persist()
        if done:
            log.info("swapped out", seq=job.seq.seq_id, blocks=len(job.slots), blocks_freed=job.blocks_freed,
                     reason=job.reason or "preempted")
        return done

    async def police(self) -> None:
        """The eviction policy's periodic sweep (idle TTL, revocations, watermark), sooner when woken."""
        ttl = self.manager.evictions.idle_ttl_s
        tick = min(1.0, ttl / 4) if ttl else 1.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pressure.wait(), tick)   # a periodic sweep, or a wake-up
            self._pressure.clear()
            try:
                self._start(self.manager.evictions.sweep(time.monotonic()))
            except Exception:        # a bug must not silently end the policy: log it, sweep again
                log.exception("eviction sweep failed")

    def persist(self) -> None:
        """Journal what changed (memd.state), if memd keeps a state directory.

        Called after every change and before any reply that hands out a page, so
        the journal never lags behind what a worker may have written.
        """
        if self.wal is not None:
            self.wal.flush(self.manager)

    async def _apply(self, effects: list[Effect]) -> None:
        """Zero, copy and swap in pages before the reply; the Step's state change is already made.

        Effects on the same pages must land in Step order, so a Step whose pages
        a queued effect still touches queues behind it (one FIFO thread). A
        small Step on other pages runs inline: it need not wait behind another
        worker's large swap-in. Shielded: a client that cancels or times out
        must not leave its pages unzeroed, since memd has handed them out all the same.
        """
        pages = [page for kind, a, b in effects for page in ((b,) if kind == "swap_in" else (a, b))]
        small = len(effects) * self.manager.geometry.block_bytes <= INLINE_EFFECT_BYTES and \
            not any(kind == "swap_in" for kind, _, _ in effects)
        if small and self._busy_pages.keys().isdisjoint(pages):
            run_effects(self.memory, self.swap, effects)
            return
        self._busy_pages.update(pages)
        job = asyncio.get_running_loop().run_in_executor(self._copier, run_effects, self.memory, self.swap, effects)
        job.add_done_callback(lambda _job: self._settle_pages(pages))
        await asyncio.shield(job)

    def _settle_pages(self, pages: list[int]) -> None:
        busy = self._busy_pages
        busy.subtract(pages)
        for page in pages:
            if busy.get(page, 0) <= 0:
                busy.pop(page, None)

    async def close(self) -> None:
        """Wait for queued page effects and swap copies: the pool must outlive them."""
        for pid in list(self._pidfds):
            self._unwatch(pid)
        if self._swap_tasks:
            await asyncio.wait(set(self._swap_tasks))
        self._swapper.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        self.persist()

    def _settled(self) -> None:
        """Sequences changed state: wake whoever waits for that (a drain)."""
        if self._activity is not None:
            self._activity.set()
            self._activity = None

    async def _changes(self, timeout_s: float) -> None:
        if self._activity is None:
            self._activity = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._activity.wait(), timeout_s)

    def is_draining(self, worker_id: int) -> bool:
        return self.drain_all or worker_id in self.draining

    def _running_on(self, worker_ids: list[int]) -> int:
        """Sequences these workers run, or preempted and mean to resume: what a drain waits for."""
        owners = set(worker_ids)
        return sum(1 for s in self.manager.seqs.values()
                   if (s.state is SeqState.RUNNING and s.owner in owners) or s.preempted_by in owners)

    # ---- admin ---------------------------------------------------------

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        log.debug("rpc", method="Stats")
        m, g = self.manager, self.manager.geometry
        free = m.pool.num_free
        swap = m.swap
        return pb.StatsReply(
            swap_total_blocks=swap.num_slots if swap else 0, swap_free_blocks=swap.num_free if swap else 0,
            swapped_blocks=m.swapped_blocks(),
            total_blocks=g.num_blocks, free_blocks=free, used_blocks=g.num_blocks - free,
            cached_blocks=m.pool.num_cached, block_bytes=g.block_bytes, pool_bytes=g.pool_bytes,
            workers=len(m.workers), sequences=m.state_counts(), counters=dict(m.counters),
            backend=self.memory.backend, device=self.memory.device, generation=self.generation,
            uptime_s=time.monotonic() - self.started, bytes_per_token=g.bytes_per_token,
            block_size=g.block_size, rpcs=dict(self.rpcs), draining=self.drain_all)

    async def Snapshot(self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext) -> pb.SnapshotReply:
        log.debug("rpc", method="Snapshot")
        m, now = self.manager, time.monotonic()
        holders: dict[int, list] = {}
        for seq in m.seqs.values():
            for block in seq.block_ids:
                holders.setdefault(block, []).append(seq)
        blocks = []
        fenced = {block for pages in m.fences.values() for block in pages}
        for block in range(0 if request.skip_blocks else m.pool.num_blocks):
            seqs = holders.get(block, [])
            if seqs:
                state = ",".join(sorted({s.state.value for s in seqs}))
            elif block in fenced:
                state = "fenced"          # a reclaimed worker may still write it: out of use until it exits
            else:
                state = "cached" if m.pool.hash_of[block] is not None else "free"
            blocks.append(pb.BlockRow(
                block_id=block, ref_count=m.pool.ref[block], last_access=m.pool.last_access[block],
                seq_ids=[s.seq_id for s in seqs], state=state,
                heat=max((m.heat(s, now) for s in seqs), default=0.0),
                owners=sorted({s.owner for s in seqs if s.state is SeqState.RUNNING and s.owner})))
        sequences = [pb.SeqRow(seq_id=s.seq_id, session_id=s.session_id or "", state=s.state.value,
                               owner=s.owner or 0, num_committed=s.num_committed, num_tokens=len(s.token_ids),
                               block_ids=s.block_ids, model=s.model, last_access=s.last_access,
                               heat=m.heat(s, now), swapped_blocks=len(s.slots))
                     for s in m.seqs.values()
                     if (not request.state or s.state.value == request.state)
                     and (not request.worker_id or (s.owner == request.worker_id and s.state is SeqState.RUNNING))]
        workers = [pb.WorkerRow(worker_id=w.worker_id, name=w.name, pid=w.pid, model=w.model,
                                block_size=w.block_size, last_seen=w.last_seen,
                                running=self._running_on([w.worker_id]), draining=self.is_draining(w.worker_id))
                   for w in m.workers.values()]
        return pb.SnapshotReply(taken_at=now, block_bytes=m.geometry.block_bytes, blocks=blocks,
                                sequences=sequences, workers=workers, generation=self.generation)

    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.EvictReply:
        target = request.WhichOneof("target")
        log.debug("rpc", method="Evict", target=target)
        m = self.manager
        try:
            if target is None:
                raise InvalidArgument("evict needs a target: a sequence, a session, --idle, --blocks or --worker")
            value = getattr(request, target)
            evicted = m.evictions.force(**{target: value}, mode=request.mode or "swap")
        except KvError as err:
            await _abort(context, err)
        for seq_id, worker_id in evicted.revoked:
            if (outbox := self._outbox.get(worker_id)) is not None:
                outbox.put_nowait(_revocation(seq_id, m.revoked[seq_id]))
        tasks = self._start(evicted)
        swapped = [job.seq.seq_id for job, ok in zip(evicted.jobs, await asyncio.shield(asyncio.gather(*tasks)),
                                                     strict=True) if ok]
        freed = evicted.blocks_freed + sum(job.blocks_freed for job in evicted.jobs)
        revoked = [seq_id for seq_id, _ in evicted.revoked]
        log.info("evicted", reason="forced", target=target, swapped=swapped, dropped=evicted.dropped,
                 revoked=revoked, blocks_freed=freed)
        return pb.EvictReply(seq_ids=swapped + evicted.dropped + revoked, blocks_freed=freed, swapped=swapped,
                             dropped=evicted.dropped, revoked=revoked)

    async def Check(self, request: pb.CheckRequest, context: grpc.aio.ServicerContext) -> pb.CheckReply:
        violations = self.manager.violations()
        log.debug("rpc", method="Check", violations=len(violations))
        return pb.CheckReply(ok=not violations, violations=violations)

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainReply:
        m, worker_id = self.manager, request.worker_id
        if worker_id and worker_id not in m.workers:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {worker_id} is attached (memctl workers)")
        if not 0 <= request.wait_s < float("inf"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s must be a finite number of seconds "
                                                                  f"from 0, not {request.wait_s}")
        if request.undo and worker_id and self.drain_all:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "every worker is draining: end that drain first (memctl drain --undo)")
        targets = [worker_id] if worker_id else list(m.workers)
        if request.undo:
            if worker_id:
                self.draining.discard(worker_id)
            else:
                self.drain_all = False
                self.draining.clear()
        elif worker_id:
            self.draining.add(worker_id)
        else:
            self.drain_all = True
        event = "undrain" if request.undo else "drain"
        for target in targets:
            if (outbox := self._outbox.get(target)) is not None:
                outbox.put_nowait(pb.SessionDown(event=event, reason=f"an operator asked (memctl drain): {event}"))
        log.info(event, worker=worker_id or "all", running=self._running_on(targets))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.wait_s
        while not request.undo and self._running_on(targets) and (left := deadline - loop.time()) > 0:
            await self._changes(left)
        draining = sorted(w for w in m.workers if self.is_draining(w))
        return pb.DrainReply(worker_ids=draining, running=self._running_on(targets))
