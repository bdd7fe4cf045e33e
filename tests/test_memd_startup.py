"""Start-up: sizing, fail-fast allocation, one memd per socket, clean shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import grpc
import pytest
from conftest import ROOT

from shared.client import MemdClient, MemdError


async def run_memd(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "memd", "--log-format", "json", *args, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, err.decode()


def write_config(path: Path, **overrides: object) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_attention_heads": 8,
              "num_key_value_heads": 2, "num_hidden_layers": 4, "torch_dtype": "bfloat16"} | overrides
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.processes
async def test_a_pool_larger_than_memory_fails_at_start(tmp_path):
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "100TiB", "--listen", f"unix:{tmp_path}/m.sock")
    assert rc == 1
    assert err.startswith("memd: pool of ") and "does not fit" in err
    assert "Traceback" not in err and not (tmp_path / "m.sock").exists()


@pytest.mark.processes
async def test_bad_sizes_are_refused_by_the_command_line(tmp_path):
    rc, err = await run_memd("--pool-bytes", "12XB")
    assert rc == 2 and "not a size: '12XB'" in err
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "1MiB", "--block-bytes", "1000",
                             "--listen", f"unix:{tmp_path}/m.sock")
    assert rc == 1 and "multiple of 16" in err


async def test_a_model_config_sizes_the_blocks(memd_factory, tmp_path):
    model = write_config(tmp_path / "model")
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model), "--block-size", "32")
    ready = await memd.log.wait_for("memd ready")
    bytes_per_token = 4 * 2 * 2 * (256 // 8) * 2          # layers x K/V x kv_heads x head_dim x bf16
    assert ready["bytes_per_token"] == bytes_per_token == 1024
    assert ready["block_bytes"] == 32 * bytes_per_token
    assert ready["num_blocks"] == (8 << 20) // (32 * bytes_per_token)
    async with await MemdClient.attach(memd.address) as client:    # the model's block size is the default
        assert client.geometry.block_size == 32


@pytest.mark.processes
async def test_a_missing_model_config_is_one_clear_line(tmp_path):
    rc, err = await run_memd("--device", "cpu", "--model", str(tmp_path / "nothing"), "--listen",
                             f"unix:{tmp_path}/m.sock")
    assert rc == 1 and err.strip().endswith("no such file (expected a Hugging Face model directory)")


async def test_a_second_memd_on_the_same_socket_is_refused(memd, tmp_path):
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "1MiB", "--listen", memd.address)
    assert rc == 1 and "another memd is already listening on" in err
    async with memd.admin() as admin:
        assert (await admin.check()).ok                  # the first one is untouched


async def test_a_stale_socket_from_a_killed_memd_is_cleared(memd_factory, tmp_path):
    first = await memd_factory("--device", "cpu", "--pool-bytes", "1MiB")
    await first.kill()                                   # SIGKILL leaves memd.sock behind
    assert (tmp_path / "memd.sock").exists()
    second = await memd_factory("--device", "cpu", "--pool-bytes", "1MiB")
    async with second.admin() as admin:
        assert (await admin.stats()).total_blocks == 16


async def test_sigterm_stops_cleanly_and_removes_the_socket(memd_factory, tmp_path):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "1MiB")
    assert await memd.stop() == 0
    assert not (tmp_path / "memd.sock").exists() and not (tmp_path / "memd.sock.fd").exists()
    assert not (tmp_path / "memd.sock.token").exists() and not (tmp_path / "memd.sock.admin-token").exists()


async def test_memd_serves_over_tcp_only_with_tokens(memd_factory, tmp_path, monkeypatch):
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "1MiB", "--listen", "127.0.0.1:0")
    assert rc == 1 and err.strip().splitlines()[-1] == (
        "memd: listening on TCP needs --token-file and --admin-token-file: clients on other hosts present a copy "
        "of the token ($KVPOOL_TOKEN_FILE)")
    worker_token = tmp_path / "worker.token"
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "1MiB", "--listen", "127.0.0.1:0",
                              "--token-file", str(worker_token), "--admin-token-file", str(tmp_path / "admin.token"),
                              env={"XDG_RUNTIME_DIR": str(tmp_path), "RUNTIME_DIRECTORY": ""})
    address = (await memd.log.wait_for("memd ready"))["listen"]
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")
    with pytest.raises(MemdError) as refused:
        await MemdClient.attach(address, block_size=16)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    monkeypatch.setenv("KVPOOL_TOKEN_FILE", str(worker_token))
    async with await MemdClient.attach(address, block_size=16) as client:   # the pool fd comes over a side socket
        assert client.pool is not None and client.pool.pages.shape == (16, 65536)
    assert any((tmp_path / "kvpool").glob("memd-*.fd"))
    assert await memd.stop() == 0
    assert worker_token.exists()             # the operator's token files outlive memd


@pytest.mark.processes
async def test_unusable_socket_paths_are_refused_clearly(tmp_path):
    long_dir = tmp_path / ("d" * 100)
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "1MiB", "--listen", f"unix:{long_dir}/memd.sock")
    assert rc == 1 and "too long for a Unix socket" in err and "Traceback" not in err
    (tmp_path / "precious.txt").write_text("not a socket")
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "1MiB", "--listen", f"unix:{tmp_path}/precious.txt")
    assert rc == 1 and "is not a socket; refusing to replace it" in err
    assert (tmp_path / "precious.txt").read_text() == "not a socket"


@pytest.mark.processes
async def test_a_swap_tier_larger_than_memory_or_a_bad_latency_setting_fails_at_start(tmp_path):
    listen = ("--listen", f"unix:{tmp_path}/m.sock")
    rc, err = await run_memd("--device", "cpu", "--pool-bytes", "64MiB", "--swap-ratio", "100000", *listen)
    assert rc == 1 and err.startswith("memd: swap tier of ") and "--disable-swap" in err
    rc, err = await run_memd("--swap-ratio", "-1")
    assert rc == 2 and "must be a number at least 0: -1" in err
    rc, err = await run_memd("--free-watermark", "1.5")
    assert rc == 2 and "below 1" in err
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "memd", "--device", "cpu", "--pool-bytes", "1MiB", *listen, cwd=ROOT,
        env={**os.environ, "SWAP_LATENCY_TEST": "soon"}, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and err.decode().strip() == "memd: SWAP_LATENCY_TEST='soon' is not a number of seconds"


async def test_memd_reports_its_swap_tier_when_ready(memd_factory):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "1MiB", "--block-bytes", "64KiB",
                              "--swap-ratio", "0.5", "--idle-ttl", "60")
    ready = await memd.log.wait_for("memd ready")
    assert ready["swap"] == "512.0 KiB" and ready["idle_ttl_s"] == 60
    async with memd.admin() as admin:
        stats = await admin.stats()
        assert stats.swap_total_blocks == 8 == stats.swap_free_blocks
