"""gRPC servicer: decode a request, call memd's parts, encode the reply.

No policy and no page work here: a Step runs in memd.step_runner, leases
and drains in memd.leases, eviction in memd.eviction. This layer is the one
place that maps memd's typed errors (memd.errors) to gRPC status codes, and
that speaks the Session stream's messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import structlog
from prometheus_client import Histogram

from memd import prefix_lookup
from memd.collector import collections_paused
from memd.errors import InvalidArgument, KvError, OpError
from memd.fdpass import FdServer
from memd.fences import FenceWatch
from memd.interceptors import Serialized
from memd.invariants import violations_between_steps
from memd.leases import Leases, Notice, revocation
from memd.manager import KvManager
from memd.memory import PoolMemory
from memd.quotas import Quota
from memd.scrub import Scrubber
from memd.snapshot_view import SnapshotView
from memd.state_copy import Pacer
from memd.step_outcome import StepOutcome
from memd.step_runner import StepRunner
from shared.logs import enabled
from shared.ops import Op
from shared.packed_steps import PackedOpError, pack_results, unpack_ops
from shared.protobuf_codec import REASON_KEY, WireError, encode_handle
from shared.rpc import memd_pb2 as pb
from shared.rpc import memd_pb2_grpc as pb_grpc

log = structlog.get_logger("memd")


async def _abort(context: grpc.aio.ServicerContext, err: KvError) -> None:
    metadata = [(REASON_KEY, err.reason)] if err.reason else []
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    await context.abort(getattr(grpc.StatusCode, err.code), str(err))


def _down(notice: Notice) -> pb.SessionDown:
    return pb.SessionDown(event=notice.event, seq_id=notice.seq_id, reason=notice.reason)


class MemdService(pb_grpc.MemdServicer):
    def __init__(self, manager: KvManager, runner: StepRunner, leases: Leases, fences: FenceWatch,
                 memory: PoolMemory, fd_server: FdServer | None, scrubber: Scrubber, *, generation: int) -> None:
        self.manager, self.runner, self.leases, self.fences = manager, runner, leases, fences
        self.scrubber = scrubber
        self.cluster_status: Callable[[], Awaitable[str]] | None = None    # set when memd joined a store
        self.memory = memory
        self.fd_server = fd_server
        self.generation = generation
        self.started = time.monotonic()
        self.step_seconds: Histogram | None = None         # Prometheus, when --metrics-port is on
        self.rpcs: Counter[str] = Counter()                 # calls per method (RpcCounter counts them)

    # ---- workers -------------------------------------------------------

    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachReply:
        try:
            worker = self.manager.attach(request.name, request.pid, request.model, request.block_size,
                                         request.bytes_per_token)
        except KvError as err:
            await _abort(context, err)
        self.fences.attached(worker.pid)
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
            pool_handle=encode_handle(handle), lease_timeout_s=self.leases.lease_timeout_s, lease=worker.lease)

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
        outbox = self.leases.open_stream(worker)
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
                    if (notice := down.result()) is None:
                        reason = "lease expired"
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                            f"lease expired: no heartbeat for {self.leases.lease_timeout_s:g} s; "
                                            "attach again")
                    await context.write(_down(notice))
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
            self.leases.close_stream(worker.worker_id, reason)

    async def Steps(self, requests: AsyncIterator[pb.StepRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepReply]:
        """Each Step as it comes, answered in turn; a refusal is an answer and the stream goes on."""
        async for request in requests:
            try:
                reply = await self._step_reply(request)
            except KvError as err:
                reply = pb.StepReply(free_blocks=self.manager.pool.num_free, refused=pb.StepRefusal(
                    code=err.code, message=str(err), op_index=err.index if isinstance(err, OpError) else -1,
                    reason=err.reason))
            yield reply

    async def _step_reply(self, request: pb.StepRequest) -> pb.StepReply:
        """The Step run and its reply, timed (refused ones too); KvError when it is refused (logged here)."""
        if self.step_seconds is None:
            return await self._run_step(request)
        with self.step_seconds.time():
            return await self._run_step(request)

    async def _run_step(self, request: pb.StepRequest) -> pb.StepReply:
        try:
            ops = self._decoded(request)
            outcome = await self.runner.run(request.worker_id, ops, request.lease, request.wanted_blocks)
        except KvError as err:
            log.debug("rpc", method="Step", worker=request.worker_id, error=str(err))
            raise
        if enabled(logging.DEBUG):
            self._trace(request.worker_id, ops, outcome)
        return pb.StepReply(free_blocks=self.manager.pool.num_free, packed_results=pack_results(outcome.results))

    def _decoded(self, request: pb.StepRequest) -> list[Op]:
        """The Step's ops; a Step that cannot be read is refused (and counted)."""
        try:
            try:
                return unpack_ops(request.packed_ops)
            except PackedOpError as exc:
                raise OpError(exc.index, "decode", InvalidArgument(str(exc))) from None
            except WireError as exc:
                raise InvalidArgument(str(exc)) from None
        except KvError:
            self.runner.refused()
            raise

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
            cached_blocks=m.pool.num_cached, prefix_blocks=len(m.pool.by_hash), block_bytes=g.block_bytes,
            pool_bytes=g.pool_bytes,
            workers=len(m.workers), sequences=m.state_counts(), counters=dict(m.counters),
            backend=self.memory.backend, device=self.memory.device, generation=self.generation,
            uptime_s=time.monotonic() - self.started, bytes_per_token=g.bytes_per_token,
            block_size=g.block_size, rpcs=dict(self.rpcs), draining=self.leases.drain_all,
            cluster=await self.cluster_status() if self.cluster_status is not None else "off")

    async def Snapshot(self, request: pb.SnapshotRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[Serialized]:
        log.debug("rpc", method="Snapshot")
        m = self.manager

        def workers() -> list[pb.WorkerRow]:
            return [pb.WorkerRow(worker_id=w.worker_id, name=w.name, pid=w.pid, model=w.model,
                                 block_size=w.block_size, last_seen=w.last_seen,
                                 running=self.leases.running_on([w.worker_id]),
                                 draining=self.leases.is_draining(w.worker_id))
                    for w in m.workers.values()]

        with collections_paused():                 # the copy's rows would set off a full collection
            view = await SnapshotView.take(m, request, workers, self.generation)   # of one instant, between Steps
            pacer = Pacer(observed=False)            # the replies time their own slices: these wait on writes
            async for reply in view.replies():
                yield Serialized(reply)
                await pacer.pause()
            await view.state.drop()

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
            self.leases.tell(worker_id, revocation(seq_id, m.revoked[seq_id]))
        swapped = await self.runner.evict(evicted)
        freed = evicted.blocks_freed + sum(job.blocks_freed for job in evicted.jobs)
        revoked = [seq_id for seq_id, _ in evicted.revoked]
        log.info("evicted", reason="forced", target=target, swapped=swapped, dropped=evicted.dropped,
                 revoked=revoked, blocks_freed=freed)
        return pb.EvictReply(seq_ids=swapped + evicted.dropped + revoked, blocks_freed=freed, swapped=swapped,
                             dropped=evicted.dropped, revoked=revoked, free_blocks=m.pool.num_free)

    async def Check(self, request: pb.CheckRequest, context: grpc.aio.ServicerContext) -> pb.CheckReply:
        violations = await violations_between_steps(self.manager)       # of one instant, checked between Steps
        log.debug("rpc", method="Check", violations=len(violations))
        return pb.CheckReply(ok=not violations, violations=violations)

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainReply:
        m, worker_id = self.manager, request.worker_id
        if worker_id and worker_id not in m.workers:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {worker_id} is attached (memctl workers)")
        if not 0 <= request.wait_s < float("inf"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s must be a finite number of seconds "
                                                                  f"from 0, not {request.wait_s}")
        if request.undo and worker_id and self.leases.drain_all:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "every worker is draining: end that drain first (memctl drain --undo)")
        targets = await self.leases.drain(worker_id, undo=request.undo, wait_s=request.wait_s)
        draining = sorted(w for w in m.workers if self.leases.is_draining(w))
        return pb.DrainReply(worker_ids=draining, running=self.leases.running_on(targets))

    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext) -> pb.ResetPrefixCacheReply:
        try:
            worker = self.manager.worker(request.worker_id, request.lease)
        except KvError as err:
            await _abort(context, err)
        blocks = self.manager.forget_cached(worker.model)
        log.info("cached prefixes reset", worker=worker.worker_id, model=worker.model, blocks=blocks)
        return pb.ResetPrefixCacheReply(blocks=blocks)

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupReply:
        try:
            worker = self.manager.worker(request.worker_id, request.lease)
            found = prefix_lookup.lookups(self.manager, worker, [(q.token_ids, q.cache_salt)
                                                                 for q in request.queries])
        except KvError as err:
            await _abort(context, err)
        return pb.LookupReply(cached_blocks=found)

    def _holders(self, *, no_tenant: bool = False) -> pb.QuotasReply:
        """Every holder's row, read from what memd keeps per holder (memd.seq_index): costs the holders, not
        the sequences, however many are parked."""
        return pb.QuotasReply(holders=[
            pb.HolderRow(kind=h.key[0], name=h.key[1], guaranteed_pages=h.quota.guaranteed, max_pages=h.quota.max,
                         pages=h.pages, evictions=h.evictions, refusals=h.refusals,
                         set_at_run_time=h.set_at_run_time, sequences=h.sequences, retained_pages=h.retained_pages,
                         sessions=h.sessions, swap_slots=h.swap_slots)
            for h in self.manager.holdings(no_tenant=no_tenant)])

    async def Quotas(self, request: pb.QuotasRequest, context: grpc.aio.ServicerContext) -> pb.QuotasReply:
        log.debug("rpc", method="Quotas")
        return self._holders(no_tenant=request.with_no_tenant)

    async def SetQuota(self, request: pb.SetQuotaRequest, context: grpc.aio.ServicerContext) -> pb.QuotasReply:
        m = self.manager
        quota = None if request.clear else Quota(request.guaranteed_pages, request.max_pages)
        try:
            if request.clear and (request.guaranteed_pages or request.max_pages):
                raise InvalidArgument("clear forgets the quota set at run time: give no pages with it")
            m.quotas.set(request.kind, request.name, quota, m.pool.num_blocks)
        except KvError as err:
            await _abort(context, err)
        log.info("quota set", kind=request.kind, name=request.name, cleared=request.clear,
                 guaranteed_pages=request.guaranteed_pages, max_pages=request.max_pages)
        self.runner.wake()                  # a lowered max: the sweep evicts the holder's coldest now
        return self._holders()

    async def Scrub(self, request: pb.ScrubRequest, context: grpc.aio.ServicerContext) -> pb.ScrubReply:
        if not 0 <= request.rate_bytes_s < float("inf"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rate_bytes_s must be a finite number from 0 "
                                                                  f"(0: no limit), not {request.rate_bytes_s}")
        log.info("scrub asked", rate_bytes_s=request.rate_bytes_s or "unlimited")
        report = await self.scrubber.scrub(request.rate_bytes_s)
        return pb.ScrubReply(pages=report.pages, slots=report.slots, bytes=report.bytes, seconds=report.seconds,
                             failures=[pb.ScrubFailure(where=f.where, index=f.index, seq_ids=f.seq_ids,
                                                       sessions=f.sessions) for f in report.failures])
