"""The Python client of memd: attach, map the pool, run Steps, keep the lease.

    client = await MemdClient.attach(model="llama-3-8b", block_size=16, bytes_per_token=131072)
    kv = client.pool.view(torch.float16, (32, 2, 16, 8, 128))   # [num_blocks, layers, K/V, bs, heads, dim]
    opened, = await client.step(Open(prompt_ids, reserve=1))
    ... write K/V of the prompt into kv[opened.block_ids] ...
    await client.step(Extend(opened.seq_id, commit_to=len(prompt_ids), reserve=1))
    await client.close()

While the client is open it holds a Session stream, memd's proof that the
worker lives; heartbeats keep it alive even when no request flows. If the
process dies, memd parks its sequences at once. memd also speaks on that
stream: a sequence an operator evicts while it runs arrives as a revocation
(`on_revoke`), which the worker answers by preempting it. `MemdAdmin` is the operator
side (stats, snapshot, evict, check) that memctl uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import structlog

from shared import address as addr
from shared import tokens
from shared.geometry import PoolGeometry
from shared.ops import Fork, Free, Op, OpResult, Park
from shared.packed_steps import pack_ops, packed_token_ids, unpack_results
from shared.protobuf_codec import REASON_KEY, decode_handle
from shared.rpc import memd_pb2 as pb
from shared.rpc import memd_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from shared.poolmap import MappedPool

log = structlog.get_logger("kvpool.client")
# Steps calls a worker keeps open between Steps: its scheduler's one, and a few for Steps sent beside it
# (a reset, a cancel) so that those open no call each time.
MAX_IDLE_CALLS = 4


class MemdError(Exception):
    """memd refused a call: `code` is the gRPC status, `op_index` the failed op of a Step.

    `free_blocks`: the pool's free blocks when memd refused a Step. `reason`: what the refusal means to a
    client beside its code ("session_busy"; memd.errors.KvError.reason), "" if nothing more.
    """

    def __init__(self, code: grpc.StatusCode, message: str, op_index: int | None = None,
                 free_blocks: int | None = None, reason: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message, self.op_index, self.free_blocks = code, message, op_index, free_blocks
        self.reason = reason

    @classmethod
    def from_rpc(cls, err: grpc.aio.AioRpcError) -> MemdError:
        reason = next((str(value) for key, value in err.trailing_metadata() or () if key == REASON_KEY), "")
        return cls(err.code(), err.details() or "", reason=reason)


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
                 lease: bytes = b"", token: str | None = None) -> None:
        self._channel = chan
        self._metadata = tokens.metadata(token)
        self._stub = pb_grpc.MemdStub(chan)
        self.attachment = attachment
        self.worker_id = attachment.worker_id
        self._lease = lease
        self.geometry = attachment.geometry
        self.pool = pool
        self.lease_lost = asyncio.Event()
        self._lease_task: asyncio.Task[None] | None = None
        self._beats: asyncio.Task[None] | None = None
        self._stop_beating = asyncio.Event()
        self._session: grpc.aio.StreamStreamCall | None = None
        # Steps ride a Steps call, opened at the first; a Step sent while every open one carries another
        # opens one more, so that concurrent Steps never wait for one another. Calls not carrying a Step
        # wait here for the next (at most MAX_IDLE_CALLS; a call beyond them is ended).
        self._idle_calls: list[grpc.aio.StreamStreamCall] = []
        self._closing = False
        self.free_blocks = attachment.geometry.num_blocks     # as of memd's latest reply
        # Called with (seq_id, reason) for each sequence memd revokes.
        self.on_revoke: Callable[[int, str], None] = lambda seq_id, reason: None
        # An operator's drain (True) or its end (False): stop or resume admitting requests. memd may say
        # it before attach() returns, so the state is also kept here for whoever installs the callback late.
        self.on_drain: Callable[[bool], None] = lambda draining: None
        self.draining = False

    @classmethod
    async def attach(cls, address: str | None = None, *, model: str = "default", block_size: int = 0,
                     bytes_per_token: int = 0, name: str | None = None, map_memory: bool = True) -> MemdClient:
        """Attach as a worker; returns once memd has granted the lease (and the pool is mapped)."""
        if map_memory:
            # Imports torch: seconds that must not count against the lease, which runs from Attach.
            from shared.poolmap import map_pool
        target = addr.resolve(address)
        token = tokens.find_token(target)       # read at every attach: memd writes a new one when it restarts
        chan = channel(target)
        stub = pb_grpc.MemdStub(chan)
        try:
            reply = await stub.Attach(pb.AttachRequest(
                name=name or f"{socket.gethostname()}:{os.getpid()}", pid=os.getpid(), model=model,
                block_size=block_size, bytes_per_token=bytes_per_token), metadata=tokens.metadata(token))
        except grpc.aio.AioRpcError as err:
            await chan.close()
            raise MemdError.from_rpc(err) from None
        g = reply.geometry
        attachment = Attachment(
            reply.worker_id, g.backend,
            PoolGeometry(g.num_blocks, g.block_bytes, g.block_size, g.bytes_per_token),
            g.generation, reply.lease_timeout_s)
        client = cls(chan, attachment, None, reply.lease, token)
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
        """Hold the Session stream: heartbeats up, revocations down; any end of it is the end of the lease."""
        interval = max(self.attachment.lease_timeout_s / 3, 0.05)
        call = self._session = self._stub.Session(metadata=self._metadata)
        try:
            await call.write(pb.SessionUp(worker_id=self.worker_id, lease=self._lease))
            first = await call.read()
            if first is grpc.aio.EOF or first.event != "granted":
                raise MemdError(grpc.StatusCode.UNAVAILABLE, "memd closed the lease stream")
            granted.set_result(None)
            self._beats = asyncio.create_task(self._heartbeat(call, interval), name="memd-heartbeat")
            while (down := await call.read()) is not grpc.aio.EOF:
                if down.event == "revoked":
                    log.info("memd revoked a sequence", seq=down.seq_id, reason=down.reason)
                    try:
                        self.on_revoke(down.seq_id, down.reason)
                    except Exception:       # the lease outlives a bad callback
                        log.exception("on_revoke failed", seq=down.seq_id)
                elif down.event in ("drain", "undrain"):
                    log.info(f"memd says {down.event}", reason=down.reason)
                    self.draining = down.event == "drain"
                    try:
                        self.on_drain(down.event == "drain")
                    except Exception:
                        log.exception("on_drain failed")
            if self._closing:
                return                  # memd read our goodbye and ended the stream
            if self._beats.done() and not self._beats.cancelled():
                self._beats.result()    # a failed heartbeat is why the stream ended
            raise MemdError(grpc.StatusCode.UNAVAILABLE, "memd closed the lease stream")
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as err:    # any end of the stream is the end of the lease
            if isinstance(err, grpc.aio.AioRpcError):
                err = MemdError.from_rpc(err)
            if not granted.done():
                granted.set_exception(err)
            if not self._closing:
                log.warning("lease lost", worker=self.worker_id, error=str(err))
                self.lease_lost.set()
        finally:
            if self._beats is not None:
                self._beats.cancel()

    async def _heartbeat(self, call: grpc.aio.StreamStreamCall, interval: float) -> None:
        """Beat every `interval` until close() says stop: never cancelled mid-write, which would cancel the call."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_beating.wait(), interval)   # the heartbeat period
            if self._stop_beating.is_set():
                return
            await call.write(pb.SessionUp(worker_id=self.worker_id))

    async def step(self, *ops: Op, wanted_blocks: int = 0) -> list[OpResult]:
        """Apply `ops` in order, all or nothing; one result per op.

        `wanted_blocks`: free blocks this worker waits for; memd evicts cold parked sequences to make them.
        """
        if self.pool is not None and self.pool.backend == "cuda" and any(isinstance(op, Park | Free | Fork)
                                                                           for op in ops):
            # memd zeroes, reuses or copies released pages on its own stream: the
            # kernels that wrote them here must be finished first.
            self.pool.synchronize()
        request = pb.StepRequest(worker_id=self.worker_id, lease=self._lease, wanted_blocks=wanted_blocks,
                                 packed_ops=pack_ops(ops))
        try:
            reply = await self._streamed_step(request)
        except grpc.aio.AioRpcError as err:
            raise MemdError.from_rpc(err) from None
        self.free_blocks = reply.free_blocks
        if reply.HasField("refused"):
            refused = reply.refused
            raise MemdError(getattr(grpc.StatusCode, refused.code, grpc.StatusCode.UNKNOWN), refused.message,
                            refused.op_index if refused.op_index >= 0 else None, reply.free_blocks, refused.reason)
        results = unpack_results(reply.packed_results)
        if len(results) != len(ops):
            raise MemdError(grpc.StatusCode.INTERNAL, f"memd answered {len(results)} results to {len(ops)} ops")
        return results

    async def _streamed_step(self, request: pb.StepRequest) -> pb.StepReply:
        """One Step on an idle Steps call (opened if none is). Should it fail or its caller be cancelled, the
        call is ended: a reply still on its way would otherwise answer the next Step sent on it."""
        call = self._idle_calls.pop() if self._idle_calls else self._stub.Steps(metadata=self._metadata)
        try:
            try:
                await call.write(request)
            except asyncio.InvalidStateError:       # the call ended before this Step (memd went away): say why
                details = await call.details() if call.done() else ""
                raise MemdError(grpc.StatusCode.UNAVAILABLE, f"the Steps call had ended: {details}") from None
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise MemdError(grpc.StatusCode.UNAVAILABLE, "memd ended the Steps call")
        except BaseException:
            call.cancel()
            raise
        if self._closing or len(self._idle_calls) >= MAX_IDLE_CALLS:
            call.cancel()
        else:
            self._idle_calls.append(call)
        return reply  # type: ignore[no-any-return]

    async def lookup(self, queries: list[tuple[Sequence[int], str]]) -> list[int]:
        """Per (prompt token ids, cache salt): its leading full blocks memd's prefix cache holds for this worker's
        model, checksummed, as an Open would share them now. Changes nothing in memd."""
        request = pb.LookupRequest(worker_id=self.worker_id, lease=self._lease, queries=[
            pb.LookupQuery(token_ids=packed_token_ids(token_ids), cache_salt=salt) for token_ids, salt in queries])
        try:
            reply = await self._stub.Lookup(request, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise MemdError.from_rpc(err) from None
        return list(reply.cached_blocks)

    async def close(self) -> None:
        """Give the lease back: memd parks whatever this worker still runs."""
        self._closing = True
        while self._idle_calls:
            self._idle_calls.pop().cancel()
        self._stop_beating.set()
        if self._beats is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._beats
        session, holder = self._session, self._lease_task
        if session is not None and holder is not None and not holder.done():
            try:
                await session.write(pb.SessionUp(worker_id=self.worker_id, goodbye=True))
                await session.done_writing()
                await asyncio.wait_for(asyncio.shield(holder), 5.0)     # memd read the goodbye, ended the stream
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, TimeoutError):
                pass
        if holder is not None and not holder.done():
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holder
        if self.pool is not None:
            self.pool.close()
        await self._channel.close()

    async def reset_prefix_cache(self) -> int:
        """This worker's model's cached prefixes leave memd's prefix cache; returns how many blocks did."""
        try:
            reply = await self._stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(
                worker_id=self.worker_id, lease=self._lease), metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise MemdError.from_rpc(err) from None
        return int(reply.blocks)

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
        # The admin token where this user can read it, else the worker token: read-only calls work with either.
        self.metadata = tokens.metadata(tokens.find_token(self.target, admin=True))

    async def _call(self, method: str, request: object) -> object:
        try:
            return await getattr(self._stub, method)(request, timeout=self._timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise MemdError.from_rpc(err) from None

    async def stats(self) -> pb.StatsReply:
        return await self._call("Stats", pb.StatsRequest())  # type: ignore[return-value]

    async def snapshot(self, *, blocks: bool = True, state: str = "", worker_id: int = 0,
                       packed: bool = False) -> pb.SnapshotReply:
        """Every block, sequence and worker; `blocks=False` leaves the blocks out, the rest filter sequences.

        `packed`: the blocks come as msgpack in `packed_blocks` (memd.snapshots.block_rows reads either)."""
        request = pb.SnapshotRequest(skip_blocks=not blocks, state=state, worker_id=worker_id, packed_blocks=packed)
        snapshot = pb.SnapshotReply()
        call = self._stub.Snapshot(request, metadata=self.metadata)
        try:
            # The timeout bounds memd's silence, not the snapshot: a million blocks stream for seconds on a busy
            # host, and a deadline on the whole call failed them as "did not answer" while parts were arriving.
            while (part := await asyncio.wait_for(call.read(), self._timeout)) is not grpc.aio.EOF:
                snapshot.MergeFrom(part)            # memd streams it in parts: merged, they are the snapshot
        except TimeoutError:
            call.cancel()
            raise MemdError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"memd sent no part of the snapshot for {self._timeout:g} s") from None
        except grpc.aio.AioRpcError as err:
            raise MemdError.from_rpc(err) from None
        return snapshot

    async def drain(self, worker_id: int = 0, *, undo: bool = False, wait_s: float = 0.0) -> pb.DrainReply:
        """Stop (or, with `undo`, resume) admitting on a worker, or all; wait up to `wait_s` for RUNNING to end."""
        request = pb.DrainRequest(worker_id=worker_id, undo=undo, wait_s=wait_s)
        try:
            return await self._stub.Drain(request, timeout=self._timeout + wait_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise MemdError.from_rpc(err) from None

    async def evict(self, seq_id: int | None = None, session_id: str | None = None, *, idle_s: float | None = None,
                    blocks: int | None = None, worker_id: int | None = None, mode: str = "swap") -> pb.EvictReply:
        """Exactly one target; a running target is revoked through its worker."""
        targets = {"seq_id": seq_id, "session_id": session_id, "idle_s": idle_s, "blocks": blocks,
                   "worker_id": worker_id}
        chosen = {k: v for k, v in targets.items() if v is not None}
        request = pb.EvictRequest(mode=mode, **chosen)
        return await self._call("Evict", request)  # type: ignore[return-value]

    async def check(self) -> pb.CheckReply:
        return await self._call("Check", pb.CheckRequest())  # type: ignore[return-value]

    async def quotas(self, *, with_no_tenant: bool = False) -> pb.QuotasReply:
        """Every tenant's and model's row; `with_no_tenant`: the sequences of no tenant's too (tenant "")."""
        return await self._call("Quotas", pb.QuotasRequest(with_no_tenant=with_no_tenant))  # type: ignore[return-value]

    async def set_quota(self, kind: str, name: str, *, guaranteed_pages: int = 0, max_pages: int = 0,
                        clear: bool = False) -> pb.QuotasReply:
        """One tenant's or model's quota, now and across memd restarts; `clear` goes back to memd --quotas's."""
        request = pb.SetQuotaRequest(kind=kind, name=name, guaranteed_pages=guaranteed_pages, max_pages=max_pages,
                                     clear=clear)
        return await self._call("SetQuota", request)  # type: ignore[return-value]

    async def scrub(self, rate_bytes_s: float = 0.0) -> pb.ScrubReply:
        """One scrub pass; no deadline past reaching memd, since a big pool at a low rate takes a while."""
        try:
            return await self._stub.Scrub(pb.ScrubRequest(rate_bytes_s=rate_bytes_s), metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise MemdError.from_rpc(err) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> MemdAdmin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
