"""memctl top: a live view of one memd, redrawn every interval; `q` quits.

Rates (RPCs and Steps per second) are differences of memd's counters between
two readings. The first frame, and the only one of `--once`, comes at once
with averages since memd started: there is nothing earlier to subtract.

The view holds the whole terminal (the alternate screen, as top does) and is
drawn whole at its current size on every refresh and at once on a resize, so
a smaller window never keeps pieces of a wider frame. Bars say used and free
with different characters and in numbers, so they read right without colour.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
import termios
import tty
from collections.abc import Iterator
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from memd.views import sequences_list, stats_dict, workers_list
from shared.client import MemdAdmin
from shared.sizes import format_size

HOT_ROWS = 5
USED, FREE = "█", "░"
QUIT_KEYS = {"q", "Q"}
# A reading of memd at its start: every counter zero. Rates against it are averages since then.
START = {"stats": {"rpcs": {}, "counters": {}}, "uptime": 0.0}


async def reading(admin: MemdAdmin) -> dict[str, Any]:
    snap = await admin.snapshot(blocks=False)
    stats = stats_dict(await admin.stats())
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


class Bar:
    """`used` of `total` as USED characters then FREE ones, as wide as the space it is given."""

    def __init__(self, used: int, total: int) -> None:
        self.used, self.total = used, total

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(10, options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        # The nearest, but never an empty bar for a pool with something in it, nor a full one with room left.
        filled = (2 * width * self.used + self.total) // (2 * self.total) if self.total else 0
        if self.used and not filled:
            filled = 1
        elif filled == width and self.used < self.total:
            filled = width - 1
        yield Text.assemble((USED * filled, "magenta"), (FREE * (width - filled), "green"))


def bar(label: str, used: int, total: int, unit: str, extra: str = "") -> Table:
    """A bar as wide as the terminal allows, its share used beside it, and the counts on the line below."""
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(width=4, no_wrap=True)
    grid.add_column(ratio=1)
    grid.add_column(width=6, justify="right", no_wrap=True)
    share = math.floor(1000 * used / total) / 10 if total else 0.0     # never 100% while a block is free
    grid.add_row(label, Bar(used, total), "<0.1%" if used and not share else f"{share:.1f}%")
    grid.add_row("", Text(f"{used} used, {total - used} free{extra} of {total} {unit}"), "")
    return grid


def frame(now: dict[str, Any], per_s: dict[str, float], address: str, period: str) -> Group:
    s = now["stats"]
    header = Text(f"memd at {address}: {format_size(s['pool_bytes'])} on {s['device']}, up {s['uptime_s']:.0f} s"
                  + ("  [draining]" if s["draining"] else ""), style="bold")
    legend = Text(f"{USED} used  {FREE} free        q quits", style="dim")
    pool = bar("pool", s["used_blocks"], s["total_blocks"], "blocks", f" ({s['cached_blocks']} cached)")
    swap = (bar("swap", s["swap_total_blocks"] - s["swap_free_blocks"], s["swap_total_blocks"], "slots")
            if s["swap_total_blocks"] else Text("swap off"))
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
    return Group(header, legend, pool, swap, seqs, pressure, *section(f"calls per second ({period})", rpc),
                 *section("workers", workers), *section("hottest", heat_table(hot)),
                 *section("coldest parked (evicted first)", heat_table(cold)))


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


@contextlib.contextmanager
def keys_and_resizes(events: asyncio.Queue[str]) -> Iterator[None]:
    """Put each key typed (stdin in cbreak mode, when it is a terminal) and "resize" (SIGWINCH) on `events`.

    cbreak, not raw: keys arrive unbuffered and unechoed, and Ctrl-C still interrupts.
    """
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGWINCH, events.put_nowait, "resize")
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    saved = termios.tcgetattr(fd) if fd is not None else None
    try:
        if fd is not None:
            tty.setcbreak(fd)
            loop.add_reader(fd, lambda: [events.put_nowait(k) for k in os.read(fd, 64).decode(errors="ignore")])
        yield
    finally:
        loop.remove_signal_handler(signal.SIGWINCH)
        if fd is not None:
            loop.remove_reader(fd)
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def top(admin: MemdAdmin, interval_s: float, once: bool, console: Console | None = None) -> None:
    """Redraw every `interval_s` until `q` or an interrupt; `once`: print one frame now (for scripts and logs)."""
    console = console or Console()
    now = await reading(admin)
    view = frame(now, rates(START, now), admin.target, "since memd started")
    if once:
        console.print(view)
        return
    loop, events = asyncio.get_running_loop(), asyncio.Queue[str]()
    with keys_and_resizes(events), Live(view, console=console, screen=True, auto_refresh=False) as live:
        due = loop.time() + interval_s
        while True:
            try:
                event = await asyncio.wait_for(events.get(), max(due - loop.time(), 0.0))
            except TimeoutError:
                before, now = now, await reading(admin)
                view = frame(now, rates(before, now), admin.target, f"last {interval_s:g} s")
                due = loop.time() + interval_s
            else:
                if event in QUIT_KEYS:
                    return
                if event != "resize":
                    continue              # any other key: nothing to do
            live.update(view, refresh=True)     # a resize redraws the same reading at the new size
