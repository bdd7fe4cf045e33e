"""What operators' tools see of memd: Prometheus metrics, gRPC health, server reflection."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from conftest import ROOT
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared import tokens
from shared.client import MemdClient
from shared.launch import free_port
from shared.ops import Extend, Open, Park

BS = 16


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


async def test_metrics_show_the_pool_swap_sequences_evictions_and_step_latency(memd_factory):
    port = free_port()
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                              "--metrics-port", str(port))
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        kept, = await client.step(Open(list(range(40)), session_id="kept"))
        await client.step(Extend(kept.seq_id, commit_to=40), Park(kept.seq_id))
        gone, = await client.step(Open(list(range(100, 120)), session_id="gone"))
        await client.step(Extend(gone.seq_id, commit_to=20), Park(gone.seq_id))
    async with memd.admin() as admin:
        await admin.evict(session_id="gone")
    m = await asyncio.to_thread(scrape, port)
    assert m['kvpool_memd_blocks{state="used"}'] == 3 and m['kvpool_memd_blocks{state="free"}'] == 61
    assert m["kvpool_memd_pool_blocks"] == 64 and m["kvpool_memd_pool_usage_ratio"] == 3 / 64
    assert m['kvpool_memd_sequences{state="parked"}'] == 1 and m['kvpool_memd_sequences{state="swapped"}'] == 1
    assert m['kvpool_memd_swap_blocks{state="swapped"}'] == 2 and m["kvpool_memd_swap_outs_total"] == 1
    assert m['kvpool_memd_evictions_total{reason="forced"}'] == 1
    assert m['kvpool_memd_evictions_total{reason="idle"}'] == 0
    assert m["kvpool_memd_steps_total"] == 4 and m["kvpool_memd_step_duration_seconds_count"] == 4
    assert m["kvpool_memd_workers"] == 0
    # gRPC calls: the worker's 4 Steps rode one Steps call (steps_total counts the Steps themselves)
    assert m['kvpool_memd_rpcs_total{method="Steps"}'] == 1 and m['kvpool_memd_rpcs_total{method="Evict"}'] == 1
    assert m['kvpool_memd_rpcs_total{method="Attach"}'] == 1
    # Python's full collections in memd since start-up: as many freezes as long ones at most
    assert m["kvpool_memd_gc_full_collections_total"] >= m["kvpool_memd_gc_freezes_total"]
    assert m["kvpool_memd_gc_longest_full_collection_seconds"] <= m["kvpool_memd_gc_full_collection_seconds_total"]
    # An operator's snapshot and check hold the loop a slice at a time, and each slice is timed
    assert m["kvpool_memd_operator_hold_seconds_count"] == 0
    async with memd.admin() as admin:
        await admin.snapshot()
        await admin.check()
    after = await asyncio.to_thread(scrape, port)
    assert after["kvpool_memd_operator_hold_seconds_count"] >= 2
    assert after["kvpool_memd_operator_hold_seconds_sum"] > 0


async def test_health_says_serving_and_reflection_lists_the_services(memd):
    async with grpc.aio.insecure_channel(memd.address) as channel:
        checker = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvpool.memd.v1.Memd"):
            reply = await checker.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        await stream.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await stream.read()
        await stream.done_writing()
        names = {s.name for s in reply.list_services_response.service}
        assert {"kvpool.memd.v1.Memd", "grpc.health.v1.Health"} <= names


@pytest.mark.processes
async def test_a_metrics_port_in_use_fails_at_start_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "memd", "--device", "cpu", "--pool-bytes", "1MiB", "--listen",
            f"unix:{tmp_path}/m.sock", "--metrics-port", str(port), cwd=ROOT, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1
    assert err.decode().strip().splitlines()[-1].startswith(f"memd: cannot serve metrics on 127.0.0.1:{port}")


@contextlib.asynccontextmanager
async def memd_on_a_notify_socket(tmp_path: Path, **env: str) -> AsyncIterator[tuple[socket.socket, Path]]:
    """A 16-block memd whose sd_notify datagrams arrive on the yielded socket, as systemd would get them."""
    notify_path, sock = tmp_path / "notify", tmp_path / "m.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(notify_path))
        listener.setblocking(False)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "memd", "--device", "cpu", "--pool-bytes", "1MiB", "--block-bytes", "64KiB",
            "--listen", f"unix:{sock}", cwd=ROOT, stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "NOTIFY_SOCKET": str(notify_path), **env})
        try:
            yield listener, sock
        finally:
            proc.terminate()
            await proc.wait()


@pytest.mark.processes
async def test_under_a_watchdog_memd_pings_from_its_loop_with_the_pool_in_its_status(tmp_path):
    async with memd_on_a_notify_socket(tmp_path, WATCHDOG_USEC="200000") as (listener, _):
        loop, messages = asyncio.get_running_loop(), []

        async def pings() -> None:
            while sum("WATCHDOG=1" in m for m in messages) < 3:
                messages.append((await loop.sock_recv(listener, 4096)).decode())
        await asyncio.wait_for(pings(), 60)
    first_ping = next(i for i, m in enumerate(messages) if "WATCHDOG=1" in m)
    assert any("READY=1" in m for m in messages[:first_ping + 1])      # ready before (or with) the first ping
    status = [line for line in messages[first_ping].split("\n") if line.startswith("STATUS=")]
    assert status == ["STATUS=pool 0% used (0/16 blocks), swap 0/4; 0 worker(s); sequences: none"]


@pytest.mark.processes
async def test_ready_comes_only_once_the_socket_answers_calls(tmp_path):
    # systemd starts inferd@ units the moment memd says READY=1: by then a call must succeed on the
    # first try, with no retry and no wait for the channel to become ready.
    from shared.rpc import memd_pb2, memd_pb2_grpc
    async with memd_on_a_notify_socket(tmp_path) as (listener, sock):
        loop = asyncio.get_running_loop()
        while b"READY=1" not in (await asyncio.wait_for(loop.sock_recv(listener, 4096), 60)).split(b"\n"):
            pass
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660      # the service group may connect
        async with grpc.aio.insecure_channel(f"unix:{sock}") as channel:
            reply = await memd_pb2_grpc.MemdStub(channel).Stats(
                memd_pb2.StatsRequest(), wait_for_ready=False, timeout=10,
                metadata=tokens.metadata(tokens.find_token(f"unix:{sock}")))
        assert reply.total_blocks == 16
