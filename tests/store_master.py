"""A real Mooncake Store for the cluster tests: mooncake_master from the kvpool[cluster] wheel, on free ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from shared.launch import free_ports

MASTER = Path(sys.executable).parent / "mooncake_master"


class Store:
    """A mooncake_master with its HTTP metadata server, and a client of it for the test's own looks."""

    def __init__(self) -> None:
        self.rpc, self.meta, self.admin = free_ports(3)
        self.master, self.metadata = f"127.0.0.1:{self.rpc}", f"http://127.0.0.1:{self.meta}/metadata"
        self.proc: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start (or start again, on the same ports) and return once the master serves."""
        self.proc = await asyncio.create_subprocess_exec(
            str(MASTER), f"-rpc_port={self.rpc}", "-enable_http_metadata_server=true",
            f"-http_metadata_server_port={self.meta}", f"-metrics_port={self.admin}", "-default_kv_lease_ttl=100",
            stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            # It says it serves in an INFO line: not silenced by what a Mooncake client in this process set.
            env={k: v for k, v in os.environ.items() if not k.startswith("GLOG_")})
        assert self.proc.stderr is not None
        seen: list[bytes] = []
        try:
            while b"Master admin server started" not in (line := await asyncio.wait_for(self.proc.stderr.readline(),
                                                                                        30)):
                assert line, "mooncake_master exited: " + b"".join(seen).decode(errors="replace")[-2000:]
                seen.append(line)
        except TimeoutError:
            raise AssertionError("mooncake_master did not start: " +
                                 b"".join(seen).decode(errors="replace")[-3000:]) from None
        self._drain = asyncio.create_task(_drain(self.proc.stderr))
        await self._accepting(self.rpc)

    async def _accepting(self, port: int) -> None:
        """Until the master's RPC port takes connections: its admin server can say it started before the RPC
        server listens, and a client set up in that gap is refused (seen on a loaded machine)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except ConnectionRefusedError:
                assert loop.time() < deadline, f"mooncake_master's RPC port {port} never took a connection"
                assert self.proc is not None and self.proc.returncode is None, "mooncake_master exited"
                await asyncio.sleep(0.05)        # polling a port: no readiness signal says when it listens
                continue
            writer.close()
            await writer.wait_closed()
            return

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()
        if self._drain is not None:
            self._drain.cancel()

    @contextlib.contextmanager
    def client(self) -> Iterator[Any]:
        """A client of the store that contributes no memory, as another host's would be."""
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        assert client.setup("127.0.0.1", self.metadata, 0, 16 << 20, "tcp", "", self.master) == 0
        try:
            yield client
        finally:
            client.close()

    def remove(self, key: str) -> None:
        with self.client() as client:
            assert client.remove(key, True) == 0

    def flags(self, *extra: str) -> tuple[str, ...]:
        return ("--cluster-master", self.master, "--cluster-metadata", self.metadata, "--cluster-host", "127.0.0.1",
                "--cluster-segment", "32MiB", *extra)

    def router_flags(self) -> tuple[str, ...]:
        """kvroute's: it contributes no memory to the store."""
        return ("--cluster-master", self.master, "--cluster-metadata", self.metadata, "--cluster-host", "127.0.0.1")

    def look(self, keys: list[str], record: str | None = None) -> tuple[list[bool], dict | None]:
        """Which keys the store holds, and a record decoded: as another host's client sees them."""
        with self.client() as client:
            present = [rc == 1 for rc in client.batch_is_exist(keys)] if keys else []
            data = client.get(record) if record else None
            return present, msgpack.unpackb(bytes(data)) if data else None


@pytest.fixture
async def store() -> AsyncIterator[Store]:
    if not MASTER.exists():
        pytest.skip(f"{MASTER} is missing: kvpool[cluster] installs it")
    running = Store()
    await running.start()
    yield running
    await running.kill()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass
