"""Fixtures that start real memd and worker processes and always clean them up.

A test that starts a process is marked `processes` (the fixtures below mark
their users; a test that runs a command itself says so). `pytest -m "not
processes"` runs the rest in seconds, and a test left unmarked that starts a
process anyway fails, so the mark stays true.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from shared.client import MemdAdmin, MemdClient

pytest_plugins = ["tests.store_master",     # the `store` fixture: a real mooncake_master
                  "tests.required"]         # KVPOOL_REQUIRE=all: only a missing GPU may skip a test

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60.0

# Property tests assert behaviour, not speed: on a busy machine an example may take seconds.
settings.register_profile("kvpool", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvpool")


def pytest_configure(config: pytest.Config) -> None:
    """inferd's paged kernel, built (once, for every test process) before any test forbids starting a compiler."""
    from inferd import paged_kernel
    paged_kernel.load()


# Fixtures whose users start processes.
PROCESS_FIXTURES = {"daemons", "memd_factory", "inferd_factory", "spawn_worker", "memd", "store"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)


@pytest.fixture(autouse=True)
def _only_marked_tests_start_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("processes") is not None:
        return

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.processes")

    async def refuse_async(*args: Any, **kwargs: Any) -> Any:
        refuse()

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", refuse_async)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak-seconds", type=float, default=12.0,
                     help="how long tests/test_soak.py keeps its load on (default: 12)")
    parser.addoption("--chaos-seconds", type=float, default=10.0,
                     help="how long tests/test_chaos.py kills parts of its fleet (default: 10)")
    parser.addoption("--chaos-chats", type=int, default=12, help="chats tests/test_chaos.py runs at once (default: 12)")
    parser.addoption("--chaos-seed", type=int, default=1, help="seed of tests/test_chaos.py's kills and chats")


@pytest.fixture
def soak_seconds(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--soak-seconds"))


@pytest.fixture
def chaos_seconds(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--chaos-seconds"))


@pytest.fixture
def chaos_chats(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--chaos-chats"))


@pytest.fixture
def chaos_seed(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--chaos-seed"))


LOG_LINE_LIMIT = 1 << 24     # Mooncake's client (the cluster tier) writes some very long lines to memd's stderr


class LogWatch:
    """memd's JSON log lines as events a test can await."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.events: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._pump(stream))

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        while line := await _line(stream):
            text = line.decode(errors="replace").rstrip()
            self.raw.append(text)
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(text)
                if isinstance(event, dict):
                    self.events.append(event)
            async with self._changed:
                self._changed.notify_all()
        async with self._changed:
            self._changed.notify_all()

    def _hits(self, event: str, fields: dict[str, Any]) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())]

    def count(self, event: str, **fields: Any) -> int:
        """How many events of that name with those fields were logged so far."""
        return len(self._hits(event, fields))

    def find(self, event: str, nth: int = 1, **fields: Any) -> dict[str, Any] | None:
        """The `nth` event of that name with those fields, None until there are that many."""
        hits = self._hits(event, fields)
        return hits[nth - 1] if len(hits) >= nth else None

    async def wait_for(self, event: str, timeout: float = 30.0, nth: int = 1, **fields: Any) -> dict[str, Any]:
        async def found() -> dict[str, Any]:
            async with self._changed:
                while (hit := self.find(event, nth, **fields)) is None:
                    if self._task.done():
                        raise AssertionError(f"memd exited before logging {event!r}: {self.raw[-5:]}")
                    await self._changed.wait()
                return hit
        return await asyncio.wait_for(found(), timeout)


async def _line(stream: asyncio.StreamReader) -> bytes:
    """The next line; one longer than the stream's limit comes back cut rather than ending the watch."""
    try:
        return await stream.readline()
    except ValueError:
        return await stream.read(LOG_LINE_LIMIT) or b" "


class Daemon:
    """A memd or inferd process, its address and its log events."""

    def __init__(self, proc: asyncio.subprocess.Process, address: str, log: LogWatch) -> None:
        self.proc, self.address, self.log = proc, address, log

    def admin(self) -> MemdAdmin:
        return MemdAdmin(self.address)

    async def attach(self, **attach: Any) -> MemdClient:
        """A worker's client on this memd (as tests/local_memd.LocalMemd.attach on an in-process one)."""
        return await MemdClient.attach(self.address, **attach)

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), 30)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


async def start_memd(tmp: Path, *args: str, name: str = "memd", env: dict[str, str] | None = None) -> Daemon:
    """Start memd and return once it said READY=1 on a notify socket of the test's own."""
    return await start_daemon(tmp, ["memd", *args], name=name, env=env)


async def start_daemon(tmp: Path, argv: list[str], *, name: str, env: dict[str, str] | None = None,
                       listen: bool = True) -> Daemon:
    """`python -m argv...` with --listen on a socket in `tmp` unless given (or `listen` is off); returns at READY=1."""
    sock_path = tmp / f"{name}.sock"
    notify_path = Path(tempfile.mkdtemp(dir=tmp)) / "notify"
    address = f"unix:{sock_path}"
    if "--listen" in argv:
        address = argv[argv.index("--listen") + 1]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.setblocking(False)
    env = {**os.environ, **(env or {}), "NOTIFY_SOCKET": str(notify_path)}
    flags = list(argv)
    if "--listen" not in flags and listen:
        flags += ["--listen", address]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", *flags, "--log-format", "json",
        env=env, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        limit=LOG_LINE_LIMIT)
    assert proc.stderr is not None
    log = LogWatch(proc.stderr)
    loop = asyncio.get_running_loop()
    try:
        ready = asyncio.ensure_future(_await_ready(loop, listener))
        exited = asyncio.ensure_future(proc.wait())
        done, _ = await asyncio.wait({ready, exited}, timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            await asyncio.sleep(0)
            raise AssertionError(f"{argv[0]} did not become ready: {log.raw[-5:]}")
        exited.cancel()
    finally:
        listener.close()
    return Daemon(proc, address, log)


async def _await_ready(loop: asyncio.AbstractEventLoop, listener: socket.socket) -> None:
    while b"READY=1" not in (await loop.sock_recv(listener, 4096)).split(b"\n"):
        pass


@pytest.fixture
async def daemons() -> AsyncIterator[list[Daemon]]:
    """Every daemon a test started, killed when it ends."""
    started: list[Daemon] = []
    yield started
    for proc in started:
        await proc.kill()


@pytest.fixture
def memd_factory(tmp_path: Path, daemons: list[Daemon]) -> Callable[..., Any]:
    async def factory(*args: str, name: str = "memd", env: dict[str, str] | None = None) -> Daemon:
        daemons.append(await start_memd(tmp_path, *args, name=name, env=env))
        return daemons[-1]
    return factory


@pytest.fixture
async def local_memd_factory() -> AsyncIterator[Callable[..., Any]]:
    """memd's real parts in the test's own process (tests/local_memd.py), from memd's flags; no processes."""
    from tests.local_memd import LocalMemd
    made: list[LocalMemd] = []

    async def factory(*args: str, name: str = "memd") -> LocalMemd:
        made.append(await LocalMemd.start(*args))
        return made[-1]
    yield factory
    for memd in made:
        await memd.close()


@pytest.fixture
async def served(local_memd_factory: Callable[..., Any], checkpoint: Path) -> AsyncIterator[tuple[Any, Any]]:
    """The scheduler on the `checkpoint` model over an in-process memd: (memd, scheduler)."""
    from tests.scheduling import start_scheduler
    memd, client, scheduler, task = await start_scheduler(local_memd_factory, checkpoint)
    yield memd, scheduler
    task.cancel()
    await client.close()


@pytest.fixture
def inferd_factory(tmp_path: Path, daemons: list[Daemon]) -> Callable[..., Any]:
    """Start `inferd serve` processes: `await inferd_factory(model_dir, memd.address, *flags)`."""
    async def factory(model: Path, memd_address: str, *args: str, name: str = "inferd") -> Daemon:
        daemons.append(await start_daemon(tmp_path, ["inferd", "serve", "--model", str(model), "--memd",
                                                     memd_address, "--threads", "1", *args], name=name))
        return daemons[-1]
    return factory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny seeded Llama checkpoint for scheduler tests (test_model.py brings its own, per architecture)."""
    from inferd.tiny import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=7)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    """`transformers` on the same weights: what the paged path must reproduce."""
    transformers = pytest.importorskip("transformers")
    import torch
    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def judge(reference: Any, checkpoint: Path) -> Any:
    """Compares answers across batch shapes, tie-aware (tests/answers.py)."""
    from tests.answers import Reference
    return Reference(reference, checkpoint)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny seeded Llama checkpoint (with a chat template) for tests that run inferd processes."""
    from inferd.tiny import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


@pytest.fixture(scope="module")
def model_judge(model_dir: Path) -> Any:
    """Compares answers of `model_dir` across batch shapes and processes, tie-aware."""
    pytest.importorskip("transformers")
    from tests.answers import Reference
    return Reference.load(model_dir)


@pytest.fixture
async def memd(memd_factory: Callable[..., Any]) -> Daemon:
    """A memd on CPU shared memory: 64 pages of 4 KiB, 16 tokens per block by default."""
    return await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                              "--lease-timeout", "30")


class WorkerProcess:
    """A real worker process (tests/worker_proc.py) driven by JSON commands."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.worker_id = 0

    async def call(self, cmd: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **fields}) + "\n").encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        if not line:
            raise AssertionError("worker process exited")
        reply = json.loads(line)
        if "exception" in reply:
            raise AssertionError(f"worker raised {reply['exception']}")
        return reply

    async def step(self, *ops: dict[str, Any]) -> list[dict[str, Any]]:
        reply = await self.call("step", ops=list(ops))
        if "error" in reply:
            raise AssertionError(f"step refused: {reply['error']}")
        return reply["results"]

    async def step_error(self, *ops: dict[str, Any]) -> dict[str, Any]:
        reply = await self.call("step", ops=list(ops))
        assert "error" in reply, f"step should have been refused: {reply}"
        return reply["error"]

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


@pytest.fixture
async def spawn_worker() -> AsyncIterator[Callable[..., Any]]:
    spawned: list[WorkerProcess] = []

    async def spawn(address: str, **attach: Any) -> WorkerProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "tests" / "worker_proc.py"), cwd=ROOT,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        worker = WorkerProcess(proc)
        spawned.append(worker)
        reply = await worker.call("attach", address=address, **({"block_size": 16} | attach))
        worker.worker_id = reply["worker_id"]
        return worker

    yield spawn
    for worker in spawned:
        if worker.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGCONT)
        await worker.kill()
