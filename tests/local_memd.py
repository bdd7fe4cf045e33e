"""memd in the test's own process: the real parts, wired as the daemon wires them, without gRPC.

`LocalMemd` allocates a real shared-memory pool and swap tier, and runs the
real KvManager, StepRunner, Leases and eviction policy (memd.assembly), parsed
from memd's own flags. `LocalClient` is the client interface the scheduler
uses (`shared.client.MemdClient`'s: step, free_blocks, revocations, drains),
calling the step runner directly and raising the same MemdError the gRPC
client raises. `admin()` answers with memd's own servicer handlers. What this
leaves out is the transport: gRPC, the fd socket, leases expiring, memd
restarting — tests of those start processes (`@pytest.mark.processes`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc
import structlog
import torch

from memd.__main__ import build_parser, plan
from memd.assembly import Parts, assemble, new_manager
from memd.errors import KvError, OpError
from memd.leases import Notice
from memd.memory import allocate_pool
from memd.settings import Settings
from memd.swap_tier import allocate_swap
from shared.client import MemdError
from shared.geometry import PoolGeometry
from shared.ops import Op, OpResult
from shared.poolmap import MappedPool
from shared.rpc import memd_pb2 as pb

log = structlog.get_logger("tests.local_memd")


class LocalMemd:
    def __init__(self, parts: Parts, memory: Any, swap: Any) -> None:
        self.parts, self.memory, self.swap = parts, memory, swap
        self.manager = parts.manager
        self.clients: list[LocalClient] = []
        self._police = asyncio.create_task(parts.runner.police(), name="eviction-policy")

    @classmethod
    async def start(cls, *flags: str) -> LocalMemd:
        """A memd as `memd --device cpu FLAGS...` would start (no state directory: nothing outlives it)."""
        args = build_parser().parse_args(["--device", "cpu", *flags])
        geometry = plan(args)
        settings = Settings.from_args(args)
        memory = allocate_pool("cpu", geometry.num_blocks, geometry.block_bytes)
        slots = settings.swap_slots(geometry)
        swap = allocate_swap(memory, slots, geometry.block_bytes) if slots else None
        return cls(assemble(new_manager(geometry, settings), settings, memory, swap), memory, swap)

    async def attach(self, *, model: str = "default", block_size: int = 0, bytes_per_token: int = 0,
                     name: str = "local") -> LocalClient:
        m = self.manager
        worker = m.attach(name, 0, model, block_size, bytes_per_token)
        g = m.geometry
        geometry = PoolGeometry(g.num_blocks, g.block_bytes, worker.block_size, bytes_per_token or g.bytes_per_token)
        pages = MappedPool(torch.frombuffer(self.memory.view(), dtype=torch.uint8).view(g.num_blocks, g.block_bytes),
                           "shm")
        client = LocalClient(self, worker.worker_id, geometry, pages)
        self.clients.append(client)
        return client

    def admin(self) -> LocalAdmin:
        return LocalAdmin(self.parts)

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        self._police.cancel()
        self.parts.scrubber.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._police
        await self.parts.runner.close()
        if self.swap is not None:
            self.swap.close()
        with contextlib.suppress(BufferError):     # a test's tensors may still view the pages: freed at exit
            self.memory.close()


class LocalClient:
    """What the scheduler uses of MemdClient, on a LocalMemd."""

    def __init__(self, memd: LocalMemd, worker_id: int, geometry: PoolGeometry, pool: MappedPool) -> None:
        self.memd, self.worker_id, self.geometry, self.pool = memd, worker_id, geometry, pool
        self.free_blocks = geometry.num_blocks
        self.lease_lost = asyncio.Event()
        self.on_revoke: Callable[[int, str], None] = lambda seq_id, reason: None
        self.on_drain: Callable[[bool], None] = lambda draining: None
        self.draining = False
        leases = memd.parts.leases
        self._outbox = leases.open_stream(memd.manager.worker(worker_id))
        self._listener = asyncio.create_task(self._listen(), name="local-lease")
        self._closed = False

    async def _listen(self) -> None:
        while (notice := await self._outbox.get()) is not None:
            self._notice(notice)
        self.lease_lost.set()

    def _notice(self, notice: Notice) -> None:
        try:                                      # as MemdClient: the lease outlives a bad callback
            if notice.event == "revoked":
                self.on_revoke(notice.seq_id, notice.reason)
            elif notice.event in ("drain", "undrain"):
                self.draining = notice.event == "drain"
                self.on_drain(self.draining)
        except Exception:
            log.exception("a lease callback failed", notice=notice.event)

    async def step(self, *ops: Op, wanted_blocks: int = 0) -> list[OpResult]:
        pool = self.memd.manager.pool
        # A Step from a real worker reaches memd through its socket: the loop turns between two Steps, and
        # memd's other tasks (the eviction policy, a snapshot's slices) run there. A Step that settles inline
        # never suspends, so here the turn is taken explicitly, as the transport would.
        await asyncio.sleep(0)
        try:
            outcome = await self.memd.parts.runner.run(self.worker_id, list(ops), None, wanted_blocks)
        except KvError as err:
            self.free_blocks = pool.num_free
            index = err.index if isinstance(err, OpError) else None
            raise MemdError(getattr(grpc.StatusCode, err.code), str(err), index, pool.num_free) from None
        except Exception as exc:                  # a bug in memd: gRPC would answer UNKNOWN, with no op index
            log.exception("memd failed a Step")
            raise MemdError(grpc.StatusCode.UNKNOWN, f"Unexpected {exc!r}") from None
        self.free_blocks = pool.num_free
        return outcome.results

    async def close(self) -> None:
        """Give the lease back, as a worker's goodbye does: memd parks whatever it still runs."""
        if self._closed:
            return
        self._closed = True
        self._listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._listener
        self.memd.parts.leases.close_stream(self.worker_id, "goodbye")

    async def __aenter__(self) -> LocalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class CallContext:
    """The servicer context memd's handlers use: only abort, which becomes the MemdError a client sees."""

    def set_trailing_metadata(self, metadata: tuple) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise MemdError(code, details)


class LocalAdmin:
    """memctl's calls (MemdAdmin's interface), answered by memd's own servicer handlers."""

    def __init__(self, parts: Parts) -> None:
        self.service = parts.service

    async def stats(self) -> pb.StatsReply:
        return await self.service.Stats(pb.StatsRequest(), CallContext())

    async def check(self) -> pb.CheckReply:
        return await self.service.Check(pb.CheckRequest(), CallContext())

    async def snapshot(self, *, blocks: bool = True, state: str = "", worker_id: int = 0,
                       packed: bool = False) -> pb.SnapshotReply:
        request = pb.SnapshotRequest(skip_blocks=not blocks, state=state, worker_id=worker_id, packed_blocks=packed)
        snapshot = pb.SnapshotReply()
        async for part in self.service.Snapshot(request, CallContext()):
            snapshot.MergeFromString(part.data)
        return snapshot

    async def evict(self, seq_id: int | None = None, session_id: str | None = None, *, idle_s: float | None = None,
                    blocks: int | None = None, worker_id: int | None = None, mode: str = "swap") -> pb.EvictReply:
        targets = {"seq_id": seq_id, "session_id": session_id, "idle_s": idle_s, "blocks": blocks,
                   "worker_id": worker_id}
        request = pb.EvictRequest(mode=mode, **{k: v for k, v in targets.items() if v is not None})
        return await self.service.Evict(request, CallContext())

    async def drain(self, worker_id: int = 0, *, undo: bool = False, wait_s: float = 0.0) -> pb.DrainReply:
        return await self.service.Drain(pb.DrainRequest(worker_id=worker_id, undo=undo, wait_s=wait_s), CallContext())

    async def scrub(self, rate_bytes_s: float = 0.0) -> pb.ScrubReply:
        return await self.service.Scrub(pb.ScrubRequest(rate_bytes_s=rate_bytes_s), CallContext())

    async def __aenter__(self) -> LocalAdmin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass
