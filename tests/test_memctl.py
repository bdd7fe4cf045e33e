"""memctl against a real memd: what operators and scripts rely on."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import sys
from pathlib import Path

from shared.client import MemdClient
from shared.ops import Extend, Open, Park

ROOT = Path(__file__).resolve().parent.parent
BS = 16


async def memctl(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "memd.memctl", *args, cwd=ROOT, env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def park_a_session(memd, session: str = "chat", tokens: int = 40) -> int:
    async with await MemdClient.attach(memd.address, block_size=BS) as client:
        opened, = await client.step(Open(list(range(tokens)), session_id=session))
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
    assert counters["evictions"] == {"idle": 0, "pressure": 0, "forced": 0}


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
    assert rc == 0 and out.strip() == f"dropped {seq_id}: 3 block(s) freed"
    rc, out, _ = await memctl("--address", memd.address, "stats", "--json")
    stats = json.loads(out)
    assert stats["used_blocks"] == 0 and stats["sequences"]["dropped"] == 1
    assert stats["counters"]["drops"] == 1 and stats["counters"]["evictions"] == {"idle": 0, "pressure": 0,
                                                                                  "forced": 1}
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
    assert rc == 0 and out.strip() == f"swapped out {seq_id}: 3 block(s) freed"
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
    assert rc == 0 and out.strip() == f"swapped out {seq_id}: 3 block(s) freed"
    rc, out, _ = await memctl("--address", memd.address, "evict", "--idle", "0")
    assert rc == 0 and out.strip().startswith("evicted nothing")
    rc, _, _ = await memctl("--address", memd.address, "check")
    assert rc == 0


async def test_evict_errors_are_one_line(memd):
    rc, out, err = await memctl("--address", memd.address, "evict", "--seq", "12345")
    assert rc == 1 and out == ""
    assert err.strip() == "memctl: not found: no sequence 12345"


async def test_check_passes_on_a_healthy_memd(memd):
    await park_a_session(memd)
    rc, out, _ = await memctl("--address", memd.address, "check")
    assert rc == 0 and out.strip() == "check: ok"


async def test_memctl_without_memd_says_so_in_one_line(tmp_path):
    address = f"unix:{tmp_path}/nobody.sock"
    for command in (["check"], ["stats", "--json"], ["snapshot"]):
        rc, out, err = await memctl("--address", address, "--timeout", "2", *command)
        assert out == ""
        assert rc == 2, command
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert err.startswith(f"memctl: memd is not reachable at {address}")
