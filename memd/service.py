"""gRPC servicer: decode a request, call the manager, encode the reply.

No policy lives here. Errors from the manager are typed (memd.errors); this
is the one place that maps them to gRPC status codes.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from memd.errors import InvalidArgument, KvError, OpError
from memd.fdpass import FdServer
from memd.manager import Effect, KvManager
from memd.memory import PoolMemory
from memd.sequences import SeqState
from shared.rpc import memd_pb2 as pb
from shared.rpc import memd_pb2_grpc as pb_grpc
from shared.wire import OP_INDEX_KEY, WireError, encode_handle, op_from_proto, result_to_proto

log = structlog.get_logger("memd")

# Effects larger than this run off the event loop, so other workers' Steps
# are answered while a big page copy is in flight.
INLINE_EFFECT_BYTES = 1 << 20


async def _abort(context: grpc.aio.ServicerContext, err: KvError) -> None:
    if isinstance(err, OpError):
        context.set_trailing_metadata(((OP_INDEX_KEY, str(err.index)),))
    await context.abort(getattr(grpc.StatusCode, err.code), str(err))


class MemdService(pb_grpc.MemdServicer):
    def __init__(self, manager: KvManager, memory: PoolMemory, fd_server: FdServer | None, *,
                 lease_timeout_s: float, generation: int) -> None:
        self.manager = manager
        self.memory = memory
        self.fd_server = fd_server
        self.lease_timeout_s = lease_timeout_s
        self.generation = generation
        self.started = time.monotonic()
        self._revocations: dict[int, asyncio.Event] = {}
        # One thread, first in first out, and nothing inline while it has work:
        # the effects of successive Steps land on the pages in Step order.
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memd-pages")
        self._queued_effects = 0

    # ---- workers -------------------------------------------------------

    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachReply:
        try:
            worker = self.manager.attach(request.name, request.pid, request.model, request.block_size,
                                         request.bytes_per_token)
        except KvError as err:
            await _abort(context, err)
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
        revoked = self._revocations[worker.worker_id] = asyncio.Event()
        revoke = asyncio.ensure_future(revoked.wait())
        reason = "stream broken"
        try:
            await context.write(pb.SessionDown(event="granted"))
            log.info("lease granted", worker=worker.worker_id)
            while True:
                read = asyncio.ensure_future(context.read())
                await asyncio.wait({read, revoke}, return_when=asyncio.FIRST_COMPLETED)
                if revoke.done():
                    read.cancel()
                    reason = "lease expired"
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"lease expired: no heartbeat for {self.lease_timeout_s:g} s; attach again")
                msg = read.result()
                if msg is grpc.aio.EOF:
                    break
                if msg.goodbye:
                    reason = "goodbye"
                    break
                worker.last_seen = time.monotonic()
        finally:
            revoke.cancel()
            self._revocations.pop(worker.worker_id, None)
            self.reclaim(worker.worker_id, reason)

    def reclaim(self, worker_id: int, reason: str) -> None:
        if worker_id not in self.manager.workers:
            return
        parked, freed = self.manager.reclaim(worker_id)
        log.info("worker reclaimed", worker=worker_id, reason=reason, parked=parked, freed=freed)

    async def reap_expired(self) -> None:
        """Reclaim workers whose heartbeats stopped; ends their stream if it is still open."""
        interval = min(1.0, self.lease_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)     # a periodic sweep, not a wait for an event
            for worker_id in self.manager.expired_workers(time.monotonic(), self.lease_timeout_s):
                self.reclaim(worker_id, "lease expired")
                revoked = self._revocations.get(worker_id)
                if revoked is not None:
                    revoked.set()          # the stream handler ends the stream with a status

    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepReply:
        try:
            ops = []
            for index, op in enumerate(request.ops):
                try:
                    ops.append(op_from_proto(op))
                except WireError as exc:
                    raise OpError(index, "decode", InvalidArgument(str(exc))) from None
            outcome = self.manager.step(request.worker_id, ops, request.lease)
        except KvError as err:
            log.debug("rpc", method="Step", worker=request.worker_id, ops=len(request.ops), error=str(err))
            await _abort(context, err)
        if outcome.effects:
            await self._apply(outcome.effects)
        log.debug("rpc", method="Step", worker=request.worker_id, ops=len(request.ops))
        return pb.StepReply(results=[result_to_proto(r) for r in outcome.results],
                            free_blocks=self.manager.pool.num_free)

    async def _apply(self, effects: list[Effect]) -> None:
        """Zero and copy pages before the reply; the Step's state change is already made.

        Shielded: a client that cancels or times out must not leave its pages
        unzeroed, since memd has handed them out all the same.
        """
        small = len(effects) * self.manager.geometry.block_bytes <= INLINE_EFFECT_BYTES
        if small and not self._queued_effects:
            self.memory.apply(effects)
            return
        self._queued_effects += 1
        job = asyncio.get_running_loop().run_in_executor(self._copier, self.memory.apply, effects)
        job.add_done_callback(self._effects_done)
        await asyncio.shield(job)

    def _effects_done(self, _job: object) -> None:
        self._queued_effects -= 1

    def close(self) -> None:
        """Wait for queued page effects: the pool must outlive them."""
        self._copier.shutdown(wait=True)

    # ---- admin ---------------------------------------------------------

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        log.debug("rpc", method="Stats")
        m, g = self.manager, self.manager.geometry
        free = m.pool.num_free
        return pb.StatsReply(
            total_blocks=g.num_blocks, free_blocks=free, used_blocks=g.num_blocks - free,
            cached_blocks=m.pool.num_cached, block_bytes=g.block_bytes, pool_bytes=g.pool_bytes,
            workers=len(m.workers), sequences=m.state_counts(), counters=dict(m.counters),
            backend=self.memory.backend, device=self.memory.device, generation=self.generation,
            uptime_s=time.monotonic() - self.started, bytes_per_token=g.bytes_per_token,
            block_size=g.block_size)

    async def Snapshot(self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext) -> pb.SnapshotReply:
        log.debug("rpc", method="Snapshot")
        m, now = self.manager, time.monotonic()
        holders: dict[int, list] = {}
        for seq in m.seqs.values():
            for block in seq.block_ids:
                holders.setdefault(block, []).append(seq)
        blocks = []
        for block in range(m.pool.num_blocks):
            seqs = holders.get(block, [])
            if seqs:
                state = ",".join(sorted({s.state.value for s in seqs}))
            else:
                state = "cached" if m.pool.hash_of[block] is not None else "free"
            blocks.append(pb.BlockRow(
                block_id=block, ref_count=m.pool.ref[block], last_access=m.pool.last_access[block],
                seq_ids=[s.seq_id for s in seqs], state=state,
                heat=max((m.heat(s, now) for s in seqs), default=0.0),
                owners=sorted({s.owner for s in seqs if s.state is SeqState.RUNNING and s.owner})))
        sequences = [pb.SeqRow(seq_id=s.seq_id, session_id=s.session_id or "", state=s.state.value,
                               owner=s.owner or 0, num_committed=s.num_committed, num_tokens=len(s.token_ids),
                               block_ids=s.block_ids, model=s.model, last_access=s.last_access)
                     for s in m.seqs.values()]
        workers = [pb.WorkerRow(worker_id=w.worker_id, name=w.name, pid=w.pid, model=w.model,
                                block_size=w.block_size, last_seen=w.last_seen,
                                running=sum(1 for s in m.seqs.values() if s.owner == w.worker_id))
                   for w in m.workers.values()]
        return pb.SnapshotReply(taken_at=now, block_bytes=m.geometry.block_bytes, blocks=blocks,
                                sequences=sequences, workers=workers)

    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.EvictReply:
        target = request.WhichOneof("target")
        log.debug("rpc", method="Evict", target=target)
        try:
            if target is None:
                raise InvalidArgument("evict needs a sequence id or a session id")
            seq_ids, freed = self.manager.evict(request.seq_id or None, request.session_id or None)
        except KvError as err:
            await _abort(context, err)
        log.info("evicted", seq_ids=seq_ids, blocks_freed=freed, reason="forced")
        return pb.EvictReply(seq_ids=seq_ids, blocks_freed=freed)

    async def Check(self, request: pb.CheckRequest, context: grpc.aio.ServicerContext) -> pb.CheckReply:
        violations = self.manager.violations()
        log.debug("rpc", method="Check", violations=len(violations))
        return pb.CheckReply(ok=not violations, violations=violations)
