"""Who may call memd: every refusal has its status, its one-line reason, and changes nothing."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from conftest import ROOT
from test_memctl import memctl, park_a_session

from shared import tokens
from shared.client import MemdClient
from shared.rpc import memd_pb2 as pb
from shared.rpc import memd_pb2_grpc as pb_grpc

BS = 16
CALLS = {
    "Attach": lambda stub, md: stub.Attach(pb.AttachRequest(name="intruder", block_size=BS), metadata=md),
    "Stats": lambda stub, md: stub.Stats(pb.StatsRequest(), metadata=md),
    "Check": lambda stub, md: stub.Check(pb.CheckRequest(), metadata=md),
    "Snapshot": lambda stub, md: stub.Snapshot(pb.SnapshotRequest(), metadata=md).read(),   # a stream of parts
    "Evict": lambda stub, md: stub.Evict(pb.EvictRequest(session_id="chat", mode="drop"), metadata=md),
    "Drain": lambda stub, md: stub.Drain(pb.DrainRequest(), metadata=md),
}
ADMIN_ONLY = ("Snapshot", "Evict", "Drain")


async def fingerprint(memd) -> tuple:
    """What a refused call must leave as it was (read with the admin token)."""
    async with memd.admin() as admin:
        stats = await admin.stats()
        snap = await admin.snapshot(blocks=False)
    counters = {k: v for k, v in stats.counters.items()}
    return (stats.used_blocks, stats.workers, stats.draining, dict(stats.sequences), counters,
            [(s.seq_id, s.state, tuple(s.block_ids)) for s in snap.sequences])


async def refused(memd, method: str, md: tuple) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(memd.address) as channel:
        stub = pb_grpc.MemdStub(channel)
        if method in ("Session", "Steps"):
            # memd ends the stream before reading a message: its status is what the first read gets. (A write
            # racing that end fails with grpc's own "Internal error from Core", which says nothing of memd.)
            call = getattr(stub, method)(metadata=md)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await CALLS[method](stub, md)
    return err.value


def token_file(memd, admin: bool = False) -> Path:
    worker, admin_file = tokens.token_files(memd.address)
    return admin_file if admin else worker


async def test_token_files_are_readable_only_by_whom_they_admit(memd):
    sock = Path(memd.address.removeprefix("unix:"))
    assert stat.S_IMODE(sock.stat().st_mode) == 0o660
    assert stat.S_IMODE(token_file(memd).stat().st_mode) == 0o640
    assert stat.S_IMODE(token_file(memd, admin=True).stat().st_mode) == 0o600
    assert token_file(memd).read_text() != token_file(memd, admin=True).read_text()


@pytest.mark.parametrize("method", [*CALLS, "Session", "Steps"])
async def test_a_call_without_a_token_is_unauthenticated_and_changes_nothing(memd, method):
    await park_a_session(memd)
    before = await fingerprint(memd)
    err = await refused(memd, method, ())
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.details() == (f"{method} with no token: members of memd's group read it from {token_file(memd)}, "
                             "or set $KVPOOL_TOKEN / $KVPOOL_TOKEN_FILE")
    assert await fingerprint(memd) == before


async def test_a_wrong_token_is_unauthenticated(memd):
    await park_a_session(memd)
    before = await fingerprint(memd)
    for method in ("Attach", "Evict"):
        err = await refused(memd, method, tokens.metadata("0" * 64))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "a wrong token" in err.details()
    assert await fingerprint(memd) == before


@pytest.mark.parametrize("method", ADMIN_ONLY)
async def test_the_worker_token_cannot_make_admin_calls(memd, method):
    await park_a_session(memd)
    before = await fingerprint(memd)
    err = await refused(memd, method, tokens.metadata(token_file(memd).read_text().strip()))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.details() == (f"{method} needs the admin token ({token_file(memd, admin=True)}, readable by memd's "
                             "user only)")
    assert await fingerprint(memd) == before


async def test_workers_and_read_only_tools_need_only_the_worker_token(memd, monkeypatch):
    monkeypatch.setenv("KVPOOL_TOKEN", token_file(memd).read_text().strip())
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        assert client.pool is not None                     # the pool handle comes with an authenticated Attach
    rc, out, err = await memctl("--address", memd.address, "stats", "--json")
    assert rc == 0, err
    rc, out, err = await memctl("--address", memd.address, "evict", "--idle", "0")
    assert rc == 1 and out == ""
    assert err.strip() == (f"memctl: permission denied: Evict needs the admin token "
                           f"({token_file(memd, admin=True)}, readable by memd's user only)")
    rc, _, err = await memctl("--address", memd.address, "stats", env={"KVPOOL_TOKEN": "nonsense"})
    assert rc == 1 and err.startswith("memctl: unauthenticated: Stats with a wrong token")


async def test_health_needs_no_token(memd):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    async with grpc.aio.insecure_channel(memd.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_restarted_memd_writes_new_tokens(memd_factory):
    first = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB")
    old = token_file(first).read_text()
    assert await first.stop() == 0
    second = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB")
    assert token_file(second).read_text() != old
    err = await refused(second, "Stats", tokens.metadata(old.strip()))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another user")
async def test_the_pool_handle_goes_to_no_other_user_even_through_an_open_socket(memd_factory):
    # Even if an operator loosens the side socket's mode, the kernel-reported peer must be memd's user or group.
    open_dir = Path(tempfile.mkdtemp(prefix="kvpool-open-"))
    open_dir.chmod(0o755)
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                              "--listen", f"unix:{open_dir}/memd.sock")
    async with grpc.aio.insecure_channel(memd.address) as channel:
        reply = await pb_grpc.MemdStub(channel).Attach(pb.AttachRequest(name="w", block_size=BS),
                                                       metadata=tokens.metadata(token_file(memd).read_text().strip()))
    from shared.protobuf_codec import decode_handle
    handle = decode_handle(reply.pool_handle)
    os.chmod(handle["socket"], 0o666)
    probe = ("import os, socket, sys\nos.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
             "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(bytes.fromhex(sys.argv[2]))\n"
             "print(s.recv(2).decode())")
    answer = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", probe, handle["socket"],
                                                      handle["token"].hex()],
                                     capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert answer.stdout.strip() == "NO", answer.stderr
    event = await memd.log.wait_for("pool handle refused", uid=65534)
    assert event["reason"] == "peer is not memd's user or group"
    with socket.socket(socket.AF_UNIX) as mine:          # the token still works for the worker it was issued to
        mine.connect(handle["socket"])
        mine.sendall(handle["token"])
        msg, fds, _, _ = socket.recv_fds(mine, 2, 1)
    assert msg == b"OK" and len(fds) == 1
    os.close(fds[0])
    await memd.stop()
    shutil.rmtree(open_dir, ignore_errors=True)


@pytest.mark.processes
async def test_token_files_the_operator_gives_must_be_private_and_plain(tmp_path):
    from test_memd_startup import run_memd
    sock = f"unix:{tmp_path}/m.sock"
    admin, worker = tmp_path / "admin.token", tmp_path / "worker.token"
    admin.write_text("a" * 64)
    admin.chmod(0o640)                           # group-readable: every worker would be an admin
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "1MiB", "--listen", sock,
                             "--admin-token-file", str(admin))
    assert rc == 1 and err.strip().splitlines()[-1] == (
        f"memd: {admin} is open to more users than it should be: chmod 600 {admin}")
    worker.symlink_to(admin)
    admin.chmod(0o600)
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "1MiB", "--listen", sock,
                             "--token-file", str(worker))
    assert rc == 1 and err.strip().splitlines()[-1].endswith("must be a plain file owned by memd's user (or root)")
    assert not (tmp_path / "m.sock.admin-token").exists()         # a failed start leaves no token behind


@pytest.mark.processes
async def test_a_start_that_fails_late_removes_its_token_files(tmp_path):
    from test_memd_startup import run_memd
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        rc, err = await run_memd("--device", "cpu", "--pool-bytes", "1MiB", "--listen", f"unix:{tmp_path}/m.sock",
                                 "--metrics-port", str(taken.getsockname()[1]))
    assert rc == 1 and "cannot serve metrics" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
