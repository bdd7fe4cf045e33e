"""memctl against a real memd: what operators and scripts rely on."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import sys
from pathlib import Path

import grpc
import pytest

from shared.client import MemdAdmin, MemdClient, MemdError
from shared.ops import Extend, Open, Park
from shared.rpc import memd_pb2, memd_pb2_grpc
from tests.clis import run_cli, unit_host_env

ROOT = Path(__file__).resolve().parent.parent
BS = 16


async def memctl(*args: str, env: dict[str, str] | None = None, system_run: Path | None = None) -> tuple[int, str, str]:
    return await run_cli("memd.memctl", *args, env=env, system_run=system_run)


async def park_a_session(memd, session: str = "chat", tokens: int = 40, first: int = 0) -> int:
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        opened, = await client.step(Open(list(range(first, first + tokens)), session_id=session))
        await client.step(Extend(opened.seq_id, commit_to=tokens), Park(opened.seq_id))
    return opened.seq_id


async def test_stats_json_has_the_contracted_fields(memd):
    await park_a_session(memd)
    rc, out, _ = await memctl("stats", "--json", env={"MEMD_ADDRESS": memd.address})
    assert rc == 0
    stats = json.loads(out)
    assert stats["total_blocks"] == 64 and stats["block_bytes"] == 4096
    assert stats["used_blocks"] == 3 and stats["free_blocks"] == 61
    assert stats["workers"] == 0
    assert stats["sequences"] == {"running": 0, "parked": 1, "swapped": 0, "dropped": 0}
    assert stats["swap_total_blocks"] == 19 and stats["swap_free_blocks"] == 19 and stats["swapped_blocks"] == 0
    counters = stats["counters"]
    assert {k: counters[k] for k in ("swap_outs", "swap_ins", "drops", "preemptions")} == dict.fromkeys(
        ("swap_outs", "swap_ins", "drops", "preemptions"), 0)
    assert counters["evictions"] == {"idle": 0, "pressure": 0, "forced": 0, "quota": 0}


async def test_stats_reads_well_in_a_terminal(memd):
    rc, out, _ = await memctl("--address", memd.address, "stats")
    assert rc == 0
    assert "64 blocks of 4.0 KiB" in out and "sequences" in out
    assert "0 of 19 blocks hold swapped sequences" in out and "evictions idle 0, pressure 0, forced 0" in out


async def test_snapshot_csv_is_the_debugging_table(memd):
    seq_id = await park_a_session(memd)
    rc, out, _ = await memctl("--address", memd.address, "snapshot")
    assert rc == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert out.splitlines()[0] == "block_id,ref_count,last_access,seq_id,state,heat,owner"
    assert len(rows) == 64
    held = [r for r in rows if r["seq_id"] == str(seq_id)]
    assert len(held) == 3 and all(r["ref_count"] == "1" and r["state"] == "parked" for r in held)
    assert all(float(r["heat"]) > 0 for r in held)
    assert sum(r["seq_id"] == "-1" for r in rows) == 61


async def test_snapshot_json_to_a_file(memd, tmp_path):
    await park_a_session(memd)
    target = tmp_path / "snap.json"
    rc, out, _ = await memctl("--address", memd.address, "snapshot", "--format", "json", "-o", str(target))
    assert rc == 0 and out == ""
    doc = json.loads(target.read_text())
    assert len(doc["blocks"]) == 64
    assert doc["sequences"][0]["session_id"] == "chat"


async def test_evict_drop_releases_the_pages_and_keeps_the_tokens(memd):
    seq_id = await park_a_session(memd)
    rc, out, _ = await memctl("--address", memd.address, "evict", "--session", "chat", "--drop")
    assert rc == 0 and out.strip() == f"dropped {seq_id}: 3 block(s) freed, 64 now free"
    rc, out, _ = await memctl("--address", memd.address, "stats", "--json")
    stats = json.loads(out)
    assert stats["used_blocks"] == 0 and stats["sequences"]["dropped"] == 1
    assert stats["counters"]["drops"] == 1 and stats["counters"]["evictions"] == {"idle": 0, "pressure": 0,
                                                                                  "forced": 1, "quota": 0}
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        from shared.ops import Resume
        resumed, = await client.step(Resume(session_id="chat"))
        assert resumed.token_ids == list(range(40))      # a resume recomputes from these
        assert resumed.num_cached == 32                   # full blocks still sit in the prefix cache
    rc, _, _ = await memctl("--address", memd.address, "check")
    assert rc == 0


async def test_evict_swaps_out_by_default_and_a_resume_swaps_back_in(memd):
    seq_id = await park_a_session(memd)
    rc, out, _ = await memctl("--address", memd.address, "evict", "--session", "chat")
    assert rc == 0 and out.strip() == f"swapped out {seq_id}: 3 block(s) freed, 64 now free"
    rc, out, _ = await memctl("--address", memd.address, "stats", "--json")
    stats = json.loads(out)
    assert stats["sequences"]["swapped"] == 1 and stats["swapped_blocks"] == 3
    assert stats["swap_total_blocks"] == 19 and stats["swap_free_blocks"] == 16      # 0.3 x 64 blocks
    assert stats["counters"]["swap_outs"] == 1 and stats["counters"]["evictions"]["forced"] == 1
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        from shared.ops import Resume
        resumed, = await client.step(Resume(session_id="chat"))
        assert resumed.num_committed == 40 and resumed.num_cached == 40     # nothing to recompute
    rc, out, _ = await memctl("--address", memd.address, "stats", "--json")
    stats = json.loads(out)
    assert stats["counters"]["swap_ins"] == 1 and stats["swap_free_blocks"] == 19
    rc, out, _ = await memctl("--address", memd.address, "evict", "--idle", "0")     # parked again at the close
    assert rc == 0 and out.strip() == f"swapped out {seq_id}: 3 block(s) freed, 64 now free"
    rc, out, _ = await memctl("--address", memd.address, "evict", "--idle", "0")
    assert rc == 0 and out.strip().startswith("evicted nothing")
    rc, _, _ = await memctl("--address", memd.address, "check")
    assert rc == 0


async def test_evict_blocks_asks_for_room_and_leaves_a_pool_with_enough_free_alone(memd):
    # 64 pages, 3 parked sessions of 3 pages each: 55 free. Asking for 50 free must not empty the cache.
    parked = [await park_a_session(memd, f"chat-{i}", first=100 * i) for i in range(3)]
    rc, out, err = await memctl("--address", memd.address, "evict", "--blocks", "50")
    assert rc == 0, err
    assert out.strip() == "evicted nothing: 55 blocks are free already (asked for 50)"
    rc, out, _ = await memctl("--address", memd.address, "sequences", "--state", "parked", "--json")
    assert sorted(s["seq_id"] for s in json.loads(out)) == sorted(parked)
    rc, out, _ = await memctl("--address", memd.address, "evict", "--blocks", "57", "--json")
    assert rc == 0 and json.loads(out)["blocks_freed"] == 3 and json.loads(out)["free_blocks"] == 58
    rc, out, err = await memctl("--address", memd.address, "evict", "--blocks", "65")
    assert rc == 1 and err.strip() == "memctl: invalid argument: evict --blocks takes 1 to 64, the blocks in the " \
                                      "pool, not 65"


async def test_evict_errors_are_one_line(memd):
    rc, out, err = await memctl("--address", memd.address, "evict", "--seq", "12345")
    assert rc == 1 and out == ""
    assert err.strip() == "memctl: not found: no sequence 12345"


async def test_check_passes_on_a_healthy_memd(memd):
    await park_a_session(memd)
    rc, out, _ = await memctl("--address", memd.address, "check")
    assert rc == 0 and out.strip() == "check: ok"


@pytest.mark.processes
async def test_memctl_without_memd_says_so_in_one_line(tmp_path):
    address = f"unix:{tmp_path}/nobody.sock"
    for command in (["check"], ["stats", "--json"], ["snapshot"]):
        rc, out, err = await memctl("--address", address, "--timeout", "2", *command)
        assert out == ""
        assert rc == 2, command
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert err.startswith(f"memctl: memd is not reachable at {address}")


async def test_memctl_finds_the_memd_of_the_unit_when_the_per_user_socket_is_missing(memd_factory, tmp_path):
    # `sudo memctl stats` on a systemd host: root's own socket does not exist, memd.service's does.
    run = tmp_path / "run"
    unit = f"unix:{run}/memd/memd.sock"
    (run / "memd").mkdir(parents=True)                    # RuntimeDirectory=memd: systemd makes it, memd does not
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB", "--listen", unit)
    env = unit_host_env(tmp_path)
    rc, out, err = await memctl("stats", "--json", env=env, system_run=run)
    assert rc == 0, err
    assert json.loads(out)["total_blocks"] == 64
    rc, out, err = await memctl("evict", "--seq", "12345", env=env, system_run=run)     # memd refuses: it answered
    assert rc == 1 and err.strip() == "memctl: not found: no sequence 12345"
    rc, _, err = await memctl("--address", "unix:/nonexistent/memd.sock", "stats", env=env, system_run=run)
    assert rc == 2 and "/nonexistent/memd.sock" in err                                   # a named address wins
    await memd.kill()                                     # its socket file stays, nobody listens
    rc, out, err = await memctl("stats", env=env, system_run=run)
    assert rc == 2 and out == ""
    assert err == (f"memctl: memd is not reachable at {unit} (connection refused): give --address or set "
                   "MEMD_ADDRESS\n")
    rc, out, err = await memctl("stats", env=env, system_run=tmp_path / "no-units")     # no unit either
    assert rc == 2
    assert err == (f"memctl: memd is not reachable at unix:{tmp_path}/user-runtime/kvpool/memd.sock (no such "
                   "file or directory; nor does memd.service run): give --address or set MEMD_ADDRESS\n")


async def test_workers_and_sequences_list_what_memd_holds(memd):
    await park_a_session(memd, "parked-one")
    async with await MemdClient.attach(memd.address, block_size=BS, name="inferd@a") as a, \
            await MemdClient.attach(memd.address, block_size=BS, name="inferd@b") as b:
        mine, = await a.step(Open(list(range(20)), session_id="live"))
        theirs, = await b.step(Open(list(range(100, 110))))
        rc, out, _ = await memctl("--address", memd.address, "workers", "--json")
        assert rc == 0
        workers = json.loads(out)
        assert [(w["worker_id"], w["name"], w["running"], w["draining"]) for w in workers] == [
            (a.worker_id, "inferd@a", 1, False), (b.worker_id, "inferd@b", 1, False)]
        rc, out, _ = await memctl("--address", memd.address, "sequences", "--state", "running", "--json")
        assert sorted(s["seq_id"] for s in json.loads(out)) == [mine.seq_id, theirs.seq_id]
        rc, out, _ = await memctl("--address", memd.address, "sequences", "--worker", str(a.worker_id), "--json")
        rows = json.loads(out)
        assert [(s["seq_id"], s["session_id"], s["blocks"], s["owner"]) for s in rows] == [
            (mine.seq_id, "live", 2, a.worker_id)]
        rc, out, _ = await memctl("--address", memd.address, "sequences")
        lines = out.splitlines()
        assert lines[0].split() == ["seq_id", "session_id", "state", "owner", "model", "num_tokens", "blocks",
                                    "swapped_blocks", "heat", "idle_s"]
        assert len(lines) == 4 and any("parked-one" in line and "parked" in line for line in lines)
        rc, out, _ = await memctl("--address", memd.address, "workers")
        assert "inferd@a" in out and "inferd@b" in out
    rc, out, _ = await memctl("--address", memd.address, "workers")
    assert rc == 0 and out.strip() == "no worker attached"
    rc, out, _ = await memctl("--address", memd.address, "sequences", "--state", "swapped")
    assert rc == 0 and out.strip() == "no sequence matches"


async def test_diff_of_two_snapshots_finds_the_sequence_that_holds_pages_untouched(memd, tmp_path):
    # A leak: a session whose "/reset" never freed it holds its pages, untouched,
    # while everything else moves on. Two snapshots and a diff name it.
    forgotten = await park_a_session(memd, "forgotten", tokens=64)
    before, after = tmp_path / "before.msgpack", tmp_path / "after.json"
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        busy, = await client.step(Open(list(range(500, 520)), session_id="busy"))
        await client.step(Extend(busy.seq_id, commit_to=20))
        rc, _, err = await memctl("--address", memd.address, "snapshot", "--format", "msgpack", "-o", str(before))
        assert rc == 0, err
        await client.step(Extend(busy.seq_id, list(range(520, 560))))                  # it grows
        await client.step(Extend(busy.seq_id, commit_to=60))
        fresh, = await client.step(Open(list(range(900, 917)), session_id="fresh"))
        rc, _, err = await memctl("--address", memd.address, "snapshot", "--format", "json", "-o", str(after))
        assert rc == 0, err
    rc, out, err = await memctl("diff", str(before), str(after), "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["untouched"] == [{"seq_id": forgotten, "session_id": "forgotten", "state": "parked", "blocks": 4,
                               "idle_s": d["untouched"][0]["idle_s"]}]
    assert d["grew"] == [{"seq_id": busy.seq_id, "session_id": "busy", "state": "running", "blocks": [2, 4]}]
    assert [a["seq_id"] for a in d["appeared"]] == [fresh.seq_id] and d["gone"] == []
    assert d["orphaned_blocks"] == [] and d["used_blocks"] == [6, 10]
    rc, out, _ = await memctl("diff", str(before), str(after))
    assert "orphaned blocks (held by no sequence): 0" in out
    assert f"seq {forgotten} (session forgotten): parked, 4 block(s)" in out
    assert f"seq {busy.seq_id} (session busy): running, 2 -> 4 blocks" in out


async def test_diff_refuses_what_is_not_a_snapshot_in_one_line(memd, tmp_path):
    table = tmp_path / "blocks.csv"
    rc, _, _ = await memctl("--address", memd.address, "snapshot", "-o", str(table))
    assert rc == 0
    rc, out, err = await memctl("diff", str(table), str(table))
    assert rc == 2 and out == ""
    assert err.strip() == (f"memctl: {table} is not a kvpool snapshot of format 1 (a CSV snapshot has no "
                           "sequences: take it with --format json or msgpack)")
    rc, _, err = await memctl("diff", str(tmp_path / "none"), str(table))
    assert rc == 2 and err.strip() == f"memctl: cannot read {tmp_path / 'none'}: No such file or directory"


async def test_top_once_prints_one_frame_at_once_that_reads_without_colour_and_fits_the_width(memd):
    await park_a_session(memd, "cold")
    async with await MemdClient.attach(memd.address, block_size=BS, name="inferd@top"):
        # A day's interval: --once must not wait for a second reading (the test would time out).
        rc, out, err = await memctl("--address", memd.address, "top", "--once", "--interval", "86400",
                                    env={"COLUMNS": "72"})
    assert rc == 0, err
    lines = out.splitlines()
    assert max(map(len, lines)) <= 72
    pool = next(line for line in lines if line.startswith("pool "))
    assert len(pool) == 72 and (pool.count("█"), pool.count("░")) == (3, 57)     # 3 of 64 used, on 60 columns
    assert "3 used, 61 free (0 cached) of 64 blocks" in out and "0 used, 19 free of 19 slots" in out
    assert "calls per second (since memd started)" in out and "Stats" in out
    assert "inferd@top" in out
    assert "coldest parked" in out and "cold" in out
    rc, out, _ = await memctl("--address", memd.address, "top", "--once", env={"COLUMNS": "40"})
    assert rc == 0 and max(map(len, out.splitlines())) <= 40


async def test_top_in_a_terminal_redraws_the_whole_frame_on_a_resize_and_quits_on_q(memd):
    import fcntl
    import pty
    import re
    import signal
    import struct
    import termios

    def set_size(fd: int, columns: int) -> None:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))

    master, terminal = pty.openpty()
    set_size(terminal, 100)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"TERM": "xterm-256color"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "memd.memctl", "--address", memd.address, "top", "--interval", "86400", cwd=ROOT,
        env=env, stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True)
    loop = asyncio.get_running_loop()

    async def next_frame() -> list[str]:
        """The lines of the next frame drawn, escape sequences taken out."""
        seen = b""
        while b"coldest parked" not in seen:        # the last section: the lines above it are all there
            seen += await asyncio.wait_for(loop.run_in_executor(None, os.read, master, 1 << 16), 30)
        drawn = seen[seen.rindex(b"\x1b[H"):]           # each frame is drawn from the top left corner
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn.decode(errors="replace"))
        return text.split("\r\n")
    try:
        first = await next_frame()
        assert any(line.startswith("pool ") and len(line) == 100 for line in first)
        attrs = termios.tcgetattr(terminal)
        assert not attrs[3] & (termios.ICANON | termios.ECHO)          # cbreak: keys come one by one, unechoed
        set_size(terminal, 60)
        proc.send_signal(signal.SIGWINCH)
        resized = await next_frame()            # at once, though the next reading is a day away
        assert any(line.startswith("pool ") and len(line) == 60 for line in resized)
        assert max(len(line.rstrip()) for line in resized) <= 60
        os.write(master, b"q")
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        attrs = termios.tcgetattr(terminal)
        assert attrs[3] & termios.ICANON and attrs[3] & termios.ECHO       # the terminal given back as it was
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        os.close(master)
        os.close(terminal)


@pytest.mark.processes
def test_completion_scripts_know_the_commands():
    import subprocess
    out = subprocess.run([sys.executable, "-m", "memd.memctl", "completion", "bash"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    for command in ("stats", "snapshot", "diff", "workers", "sequences", "evict", "drain", "check", "top"):
        assert command in out
    assert "--state" in out and "running" in out


async def test_evict_and_check_answer_in_json_too(memd):
    seq_id = await park_a_session(memd)
    rc, out, _ = await memctl("--address", memd.address, "evict", "--seq", str(seq_id), "--drop", "--json")
    assert rc == 0 and json.loads(out) == {"swapped": [], "dropped": [seq_id], "revoked": [], "blocks_freed": 3,
                                        "free_blocks": 64}
    rc, out, _ = await memctl("--address", memd.address, "check", "--json")
    assert rc == 0 and json.loads(out) == {"ok": True, "violations": []}


async def test_a_drain_waits_for_preempted_sequences_too(memd):
    from shared.ops import Free, Resume
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        opened, = await client.step(Open(list(range(20))))
        await client.step(Extend(opened.seq_id, commit_to=20), Park(opened.seq_id, preempt=True))
        rc, out, _ = await memctl("--address", memd.address, "drain", "--worker", str(client.worker_id),
                                  "--wait", "0", "--json")
        assert rc == 1 and json.loads(out)["running"] == 1        # its request waits to resume: not drained
        waiting = asyncio.create_task(memctl("--address", memd.address, "drain", "--worker", str(client.worker_id),
                                             "--wait", "60"))
        rc, out, _ = await memctl("--address", memd.address, "workers", "--json")
        assert json.loads(out)[0]["draining"] is True
        await client.step(Resume(seq_id=opened.seq_id))
        await client.step(Free(opened.seq_id))
        rc, out, err = await waiting
        assert rc == 0 and out.startswith(f"worker {client.worker_id} drained"), err
    rc, _, err = await memctl("--address", memd.address, "drain", "--worker", "0")
    assert rc == 2 and "must be a worker id from 1" in err
    rc, _, err = await memctl("--address", memd.address, "drain", "--wait", "inf")
    assert rc == 2 and "argument --wait: must be a number at least 0 and at most 31536000: inf" in err


def test_diff_refuses_snapshots_of_two_memd_runs():
    import pytest

    from memd.snapshots import SnapshotError, diff
    empty = {"kvpool_snapshot": 1, "taken_at": 1.0, "block_bytes": 4096, "blocks": [], "sequences": [], "workers": []}
    assert diff({**empty, "generation": 7}, {**empty, "generation": 7})["used_blocks"] == [0, 0]
    with pytest.raises(SnapshotError, match="different memd runs"):
        diff({**empty, "generation": 7}, {**empty, "generation": 8})


class _SlowSnapshots(memd_pb2_grpc.MemdServicer):
    """A Memd service whose Snapshot streams its parts `gap` seconds apart (a big pool on a busy host)."""

    def __init__(self, gap: float, parts: int) -> None:
        self.gap, self.parts = gap, parts

    async def Snapshot(self, request, context):
        for i in range(self.parts):
            await asyncio.sleep(self.gap)
            yield memd_pb2.SnapshotReply(blocks=[memd_pb2.BlockRow(block_id=i)])


@pytest.mark.parametrize("gap, answered", [(0.3, True), (3.0, False)])
async def test_the_timeout_bounds_memds_silence_between_snapshot_parts_not_the_whole_snapshot(tmp_path, gap, answered):
    server = grpc.aio.server()
    memd_pb2_grpc.add_MemdServicer_to_server(_SlowSnapshots(gap, parts=4), server)
    address = f"unix:{tmp_path / 'memd.sock'}"
    server.add_insecure_port(address)
    await server.start()
    try:
        async with MemdAdmin(address, timeout_s=1.0) as admin:
            if answered:              # 1.2 s in all, more than the timeout: every part came within it
                assert [b.block_id for b in (await admin.snapshot()).blocks] == [0, 1, 2, 3]
            else:
                with pytest.raises(MemdError) as raised:
                    await admin.snapshot()
                assert raised.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await server.stop(None)
