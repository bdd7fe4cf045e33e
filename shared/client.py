"""The Python client of memd: attach, map the pool, run Steps, keep the lease.

    client = await MemdClient.attach(model="llama-3-8b", block_size=16, bytes_per_token=131072)
    kv = client.pool.view(torch.float16, (32, 2, 16, 8, 128))   # [num_blocks, layers, K/V, bs, heads, dim]
    opened, = await client.step(Open(prompt_ids, reserve=1))
    ... write K/V of the prompt into kv[opened.block_ids] ...
    await client.step(Extend(opened.seq_id, commit_to=len(prompt_ids), reserve=1))
    await client.close()

While the client is open it holds a Session stream, memd's proof that the
worker lives; heartbeats keep it alive even when no request flows. If the
process dies, memd parks its sequences at once. `MemdAdmin` is the operator
side (stats, snapshot, evict, check) that memctl uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import structlog

from shared import address as addr
from shared.geometry import PoolGeometry
from shared.ops import Fork, Free, Op, OpResult, Park, Resume
from shared.rpc import memd_pb2 as pb
from shared.rpc import memd_pb2_grpc as pb_grpc
from shared.wire import OP_INDEX_KEY, decode_handle, op_to_proto, result_from_proto

if TYPE_CHECKING:
    from shared.poolmap import MappedPool

log = structlog.get_logger("kvpool.client")


class MemdError(Exception):
    """memd refused a call: `code` is the gRPC status, `op_index` the failed op of a Step."""

    def __init__(self, code: grpc.StatusCode, message: str, op_index: int | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message, self.op_index = code, message, op_index

    @classmethod
    def from_rpc(cls, err: grpc.aio.AioRpcError) -> MemdError:
        index = None
        for key, value in err.trailing_metadata() or ():
            if key == OP_INDEX_KEY:
                index = int(value)
        return cls(err.code(), err.details() or "", index)


@dataclass(slots=True, frozen=True)
class Attachment:
    worker_id: int
    backend: str
    geometry: PoolGeometry
    generation: int
    lease_timeout_s: float


def channel(address: str | None = None) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(addr.resolve(address), options=[
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 64 << 20),
    ])


class MemdClient:
    def __init__(self, chan: grpc.aio.Channel, attachment: Attachment, pool: MappedPool | None,
                 lease: bytes = b"") -> None:
        self._channel = chan
        self._stub = pb_grpc.MemdStub(chan)
        self.attachment = attachment
        self.worker_id = attachment.worker_id
        self._lease = lease
        self.geometry = attachment.geometry
        self.pool = pool
        self.lease_lost = asyncio.Event()
        self._lease_task: asyncio.Task[None] | None = None
        self._session: grpc.aio.StreamStreamCall | None = None
        self._closing = False
        self.free_blocks = attachment.geometry.num_blocks     # as of memd's latest reply

    @classmethod
    async def attach(cls, address: str | None = None, *, model: str = "default", block_size: int = 0,
                     bytes_per_token: int = 0, name: str | None = None, map_memory: bool = True) -> MemdClient:
        """Attach as a worker; returns once memd has granted the lease (and the pool is mapped)."""
        if map_memory:
            # Imports torch: seconds that must not count against the lease, which runs from Attach.
            from shared.poolmap import map_pool
        chan = channel(address)
        stub = pb_grpc.MemdStub(chan)
        try:
            reply = await stub.Attach(pb.AttachRequest(
                name=name or f"{socket.gethostname()}:{os.getpid()}", pid=os.getpid(), model=model,
                block_size=block_size, bytes_per_token=bytes_per_token))
        except grpc.aio.AioRpcError as err:
            await chan.close()
            raise MemdError.from_rpc(err) from None
        g = reply.geometry
        attachment = Attachment(
            reply.worker_id, g.backend,
            PoolGeometry(g.num_blocks, g.block_bytes, g.block_size, g.bytes_per_token),
            g.generation, reply.lease_timeout_s)
        client = cls(chan, attachment, None, reply.lease)
        try:
            await client._start_lease()
            if map_memory:
                client.pool = await asyncio.to_thread(map_pool, decode_handle(reply.pool_handle),
                                                      attachment.geometry)
        except BaseException:
            await client.close()
            raise
        return client

    async def _start_lease(self) -> None:
        granted = asyncio.get_running_loop().create_future()
        self._lease_task = asyncio.create_task(self._hold_lease(granted), name="memd-lease")
        await granted

    async def _hold_lease(self, granted: asyncio.Future[None]) -> None:
        interval = max(self.attachment.lease_timeout_s / 3, 0.05)
        call = self._session = self._stub.Session()
        try:
            await call.write(pb.SessionUp(worker_id=self.worker_id, lease=self._lease))
            first = await call.read()
            if first is grpc.aio.EOF or first.event != "granted":
                raise MemdError(grpc.StatusCode.UNAVAILABLE, "memd closed the lease stream")
            granted.set_result(None)
            while True:
                await asyncio.sleep(interval)   # heartbeat period, not synchronisation
                await call.write(pb.SessionUp(worker_id=self.worker_id))
        except asyncio.CancelledError:
            if not self._closing:       # a clean close says goodbye on this call first
                call.cancel()
            raise
        except Exception as err:    # any end of the stream is the end of the lease
            if isinstance(err, grpc.aio.AioRpcError):
                err = MemdError.from_rpc(err)
            if not granted.done():
                granted.set_exception(err)
            log.warning("lease lost", worker=self.worker_id, error=str(err))
            self.lease_lost.set()

    async def step(self, *ops: Op) -> list[OpResult]:
        """Apply `ops` in order, all or nothing; one result per op."""
        if self.pool is not None and self.pool.backend == "cuda" and any(isinstance(op, Park | Free | Fork)
                                                                           for op in ops):
            # memd zeroes, reuses or copies released pages on its own stream: the
            # kernels that wrote them here must be finished first.
            self.pool.synchronize()
        request = pb.StepRequest(worker_id=self.worker_id, ops=[op_to_proto(op) for op in ops], lease=self._lease)
        try:
            reply = await self._stub.Step(request)
        except grpc.aio.AioRpcError as err:
            raise MemdError.from_rpc(err) from None
        self.free_blocks = reply.free_blocks
        return [result_from_proto(r, isinstance(op, Resume | Fork) or getattr(op, "continue_session", False))
                for r, op in zip(reply.results, ops, strict=True)]

    async def close(self) -> None:
        """Give the lease back: memd parks whatever this worker still runs."""
        self._closing = True
        if self._lease_task is not None:
            self._lease_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease_task
        session = self._session
        if session is not None and not self.lease_lost.is_set():
            try:
                await session.write(pb.SessionUp(worker_id=self.worker_id, goodbye=True))
                await session.done_writing()
                await asyncio.wait_for(session.code(), 5.0)     # memd has read the goodbye
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, TimeoutError):
                session.cancel()
        if self.pool is not None:
            self.pool.close()
        await self._channel.close()

    async def __aenter__(self) -> MemdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class MemdAdmin:
    """Operator calls; every method raises MemdError on refusal and on an unreachable memd."""

    def __init__(self, address: str | None = None, timeout_s: float = 10.0) -> None:
        self.target = addr.resolve(address)
        self._channel = channel(self.target)
        self._stub = pb_grpc.MemdStub(self._channel)
        self._timeout = timeout_s

    async def _call(self, method: str, request: object) -> object:
        try:
            return await getattr(self._stub, method)(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as err:
            raise MemdError.from_rpc(err) from None

    async def stats(self) -> pb.StatsReply:
        return await self._call("Stats", pb.StatsRequest())  # type: ignore[return-value]

    async def snapshot(self) -> pb.SnapshotReply:
        return await self._call("Snapshot", pb.SnapshotRequest())  # type: ignore[return-value]

    async def evict(self, seq_id: int | None = None, session_id: str | None = None) -> pb.EvictReply:
        request = pb.EvictRequest(session_id=session_id) if session_id else pb.EvictRequest(seq_id=seq_id or 0)
        return await self._call("Evict", request)  # type: ignore[return-value]

    async def check(self) -> pb.CheckReply:
        return await self._call("Check", pb.CheckRequest())  # type: ignore[return-value]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> MemdAdmin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
