"""memctl top: a live view of one memd, redrawn every interval.

Rates (RPCs and Steps per second) are differences of memd's counters between
two readings, so the first frame comes one interval after start.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from memd.views import sequences_list, stats_dict, workers_list
from shared.client import MemdAdmin
from shared.sizes import format_size

HOT_ROWS = 5


async def reading(admin: MemdAdmin) -> dict[str, Any]:
    stats = stats_dict(await admin.stats())
    snap = await admin.snapshot(blocks=False)
    return {"stats": stats, "uptime": stats["uptime_s"], "workers": workers_list(snap),
            "sequences": sequences_list(snap)}


def rates(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Per-second rates of RPCs by method and of applied Steps and ops, between two readings."""
    dt = max(after["uptime"] - before["uptime"], 1e-9)
    out = {method: (n - before["stats"]["rpcs"].get(method, 0)) / dt for method, n in after["stats"]["rpcs"].items()}
    for counter in ("steps", "ops", "steps_refused"):
        out[f"applied {counter}"] = (after["stats"]["counters"].get(counter, 0) -
                                     before["stats"]["counters"].get(counter, 0)) / dt
    return out


def bar(label: str, used: int, total: int, detail: str) -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=6)
    grid.add_column(width=40)
    grid.add_column()
    share = used / total if total else 0.0
    grid.add_row(label, ProgressBar(total=max(total, 1), completed=used, width=40),
                 f"{100 * share:5.1f}%  {detail}")
    return grid


def frame(now: dict[str, Any], per_s: dict[str, float], address: str) -> Group:
    s = now["stats"]
    header = Text(f"memd at {address}: {format_size(s['pool_bytes'])} on {s['device']}, up {s['uptime_s']:.0f} s"
                  + ("  [draining]" if s["draining"] else ""), style="bold")
    pool = bar("pool", s["used_blocks"], s["total_blocks"],
               f"{s['used_blocks']}/{s['total_blocks']} blocks, {s['cached_blocks']} cached")
    swap = bar("swap", s["swap_total_blocks"] - s["swap_free_blocks"], s["swap_total_blocks"],
               f"{s['swapped_blocks']}/{s['swap_total_blocks']} slots" if s["swap_total_blocks"] else "off")
    seqs = Text("sequences  " + "  ".join(f"{state} {n}" for state, n in s["sequences"].items()))
    c = s["counters"]
    pressure = Text(f"pressure   swap-outs {c['swap_outs']}  swap-ins {c['swap_ins']}  drops {c['drops']}  "
                    f"preemptions {c['preemptions']}  evictions " +
                    " ".join(f"{k} {v}" for k, v in c["evictions"].items()))
    rpc = Table(box=None, pad_edge=False)
    rpc.add_column("method")
    rpc.add_column("/s", justify="right")
    for method, rate in sorted(per_s.items(), key=lambda kv: -kv[1]):
        if rate:
            rpc.add_row(method, f"{rate:.1f}")
    workers = Table(box=None, pad_edge=False)
    for column in ("id", "name", "pid", "running", "draining", "idle s"):
        workers.add_column(column, justify="left" if column == "name" else "right")
    for w in now["workers"]:
        workers.add_row(str(w["worker_id"]), w["name"], str(w["pid"]), str(w["running"]),
                        "yes" if w["draining"] else "", f"{w['idle_s']:.1f}")
    held = [q for q in now["sequences"] if q["state"] in ("running", "parked")]
    hot = sorted(held, key=lambda q: -q["heat"])[:HOT_ROWS]
    cold = sorted((q for q in held if q["state"] == "parked"), key=lambda q: q["heat"])[:HOT_ROWS]
    return Group(header, pool, swap, seqs, pressure, *section("calls per second", rpc), *section("workers", workers),
                 *section("hottest", heat_table(hot)), *section("coldest parked (evicted first)", heat_table(cold)))


def section(title: str, body: Table) -> tuple[Text, Text, Table]:
    return Text(""), Text(title, style="bold"), body


def heat_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(box=None, pad_edge=False)
    for column in ("seq", "session", "state", "blocks", "heat", "idle s"):
        t.add_column(column, justify="left" if column in ("session", "state") else "right")
    for q in rows:
        t.add_row(str(q["seq_id"]), q["session_id"], q["state"], str(q["blocks"]), f"{q['heat']:.2f}",
                  f"{q['idle_s']:.0f}")
    return t


async def top(admin: MemdAdmin, interval_s: float, once: bool, console: Console | None = None) -> None:
    """Redraw every `interval_s` until interrupted; `once`: print a single frame (for scripts and logs)."""
    console = console or Console()
    before = await reading(admin)
    await asyncio.sleep(interval_s)      # a rate needs two readings
    now = await reading(admin)
    if once:
        console.print(frame(now, rates(before, now), admin.target))
        return
    with Live(frame(now, rates(before, now), admin.target), console=console, auto_refresh=False) as live:
        while True:
            before = now
            await asyncio.sleep(interval_s)      # the refresh period
            now = await reading(admin)
            live.update(frame(now, rates(before, now), admin.target), refresh=True)
