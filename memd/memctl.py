"""memctl: look inside a running memd.

Exit codes: 0 done; 1 the answer is bad news (check found violations) or the
request was refused; 2 memd cannot be reached or the command line is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from shared import address as addr
from shared.client import MemdAdmin, MemdError
from shared.sizes import format_size

SNAPSHOT_COLUMNS = ["block_id", "ref_count", "last_access", "seq_id", "state", "heat", "owner"]
STATE_ORDER = ["running", "parked", "swapped", "dropped"]
EVICTION_REASONS = ("idle", "pressure", "forced")
UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memctl", description="Inspect and steer a running memd.")
    p.add_argument("--address", help="memd address (default: $MEMD_ADDRESS, else the per-user socket)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for memd (default: 10)")
    sub = p.add_subparsers(dest="command", required=True)
    stats = sub.add_parser("stats", help="pool usage, sequences by state, workers")
    stats.add_argument("--json", action="store_true", help="one JSON object")
    snap = sub.add_parser("snapshot", help="every block: ref count, last access, sequences, state, heat, owner")
    snap.add_argument("--format", choices=["csv", "json"], default="csv")
    snap.add_argument("-o", "--output", help="write to this file instead of stdout")
    evict = sub.add_parser("evict", help="free pages now: swap out or drop sequences (their token ids stay)",
                           description="A running sequence is revoked: its worker preempts it, then memd "
                                       "swaps or drops it and the worker recomputes or swaps it back in later.")
    target = evict.add_mutually_exclusive_group(required=True)
    target.add_argument("--seq", type=int, help="sequence id")
    target.add_argument("--session", help="session id")
    target.add_argument("--idle", type=float, metavar="SECONDS", help="every parked or swapped sequence idle this long")
    target.add_argument("--blocks", type=int, metavar="N", help="the coldest parked sequences until N blocks are free")
    target.add_argument("--worker", type=int, metavar="ID", help="every sequence running on this worker")
    mode = evict.add_mutually_exclusive_group()
    mode.add_argument("--swap", dest="mode", action="store_const", const="swap",
                      help="copy pages to the host swap tier (the default; drops when swap is off or full)")
    mode.add_argument("--drop", dest="mode", action="store_const", const="drop",
                      help="release pages outright; a resume recomputes")
    sub.add_parser("check", help="verify the invariants; exit 1 listing violations")
    return p


def stats_dict(reply: Any) -> dict[str, Any]:
    data = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for key in ("total_blocks", "free_blocks", "used_blocks", "cached_blocks", "block_bytes", "pool_bytes",
                "generation", "bytes_per_token", "swap_total_blocks", "swap_free_blocks", "swapped_blocks"):
        data[key] = int(data[key])      # protobuf's JSON form writes 64-bit ints as strings
    order = {state: i for i, state in enumerate(STATE_ORDER)}
    data["sequences"] = {k: int(v) for k, v in sorted(data["sequences"].items(), key=lambda kv: order.get(kv[0], 99))}
    counters = {k: int(v) for k, v in sorted(data["counters"].items())}
    for key in ("swap_outs", "swap_ins", "drops", "preemptions"):
        counters.setdefault(key, 0)
    counters["evictions"] = {reason: counters.pop(f"evictions_{reason}", 0) for reason in EVICTION_REASONS}
    data["counters"] = counters
    return data


def render_stats(data: dict[str, Any]) -> str:
    total = data["total_blocks"] or 1
    lines = [
        f"pool      {format_size(data['pool_bytes'])} on {data['device']} ({data['backend']}), "
        f"{data['total_blocks']} blocks of {format_size(data['block_bytes'])}",
        f"used      {data['used_blocks']} blocks ({100 * data['used_blocks'] / total:.1f}%), "
        f"free {data['free_blocks']} (of which {data['cached_blocks']} hold cached prefixes)",
        f"workers   {data['workers']}",
        "sequences " + ", ".join(f"{k} {v}" for k, v in data["sequences"].items()),
    ]
    c = data["counters"]
    if data["swap_total_blocks"]:
        lines.append(f"swap      {data['swapped_blocks']} of {data['swap_total_blocks']} blocks hold swapped "
                     f"sequences, {data['swap_free_blocks']} free")
    else:
        lines.append("swap      off")
    lines.append(f"pressure  swap-outs {c['swap_outs']}, swap-ins {c['swap_ins']}, drops {c['drops']}, "
                 f"preemptions {c['preemptions']}; evictions " +
                 ", ".join(f"{reason} {n}" for reason, n in c["evictions"].items()))
    rest = {k: v for k, v in c.items() if k not in ("swap_outs", "swap_ins", "drops", "preemptions", "evictions")}
    if rest:
        lines.append("counters  " + ", ".join(f"{k} {v}" for k, v in rest.items()))
    return "\n".join(lines)


def snapshot_rows(reply: Any) -> list[dict[str, Any]]:
    rows = []
    for b in reply.blocks:
        rows.append({
            "block_id": b.block_id, "ref_count": b.ref_count, "last_access": round(b.last_access, 6),
            "seq_id": ";".join(map(str, b.seq_ids)) if b.seq_ids else -1, "state": b.state,
            "heat": round(b.heat, 4), "owner": ";".join(map(str, b.owners)) if b.owners else "",
        })
    return rows


def render_snapshot(reply: Any, fmt: str) -> str:
    rows = snapshot_rows(reply)
    if fmt == "json":
        doc = MessageToDict(reply, preserving_proto_field_name=True)
        doc["blocks"] = rows
        return json.dumps(doc, indent=1) + "\n"
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=SNAPSHOT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def render_evicted(reply: Any) -> str:
    if not reply.seq_ids:
        return "evicted nothing: no sequence matched (or all were already swapped or dropped)"
    parts = []
    for label, ids in (("swapped out", reply.swapped), ("dropped", reply.dropped),
                       ("revoked (running; their workers give them up)", reply.revoked)):
        if ids:
            parts.append(f"{label} {', '.join(map(str, ids))}")
    return f"{'; '.join(parts)}: {reply.blocks_freed} block(s) freed"


async def run(args: argparse.Namespace) -> int:
    async with MemdAdmin(args.address, timeout_s=args.timeout) as admin:
        if args.command == "stats":
            data = stats_dict(await admin.stats())
            print(json.dumps(data) if args.json else render_stats(data))
        elif args.command == "snapshot":
            text = render_snapshot(await admin.snapshot(), args.format)
            if args.output:
                with open(args.output, "w") as f:
                    f.write(text)
            else:
                sys.stdout.write(text)
        elif args.command == "evict":
            reply = await admin.evict(seq_id=args.seq, session_id=args.session, idle_s=args.idle, blocks=args.blocks,
                                      worker_id=args.worker, mode=args.mode or "swap")
            print(render_evicted(reply))
        elif args.command == "check":
            reply = await admin.check()
            if not reply.ok:
                for violation in reply.violations:
                    print(violation)
                print(f"check: {len(reply.violations)} violation(s)", file=sys.stderr)
                return 1
            print("check: ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(run(args))
    except MemdError as err:
        if err.code in UNREACHABLE:
            print(f"memctl: memd is not reachable at {addr.resolve(args.address)}: {err.message}",
                  file=sys.stderr)
            return 2
        print(f"memctl: {err.code.name.lower().replace('_', ' ')}: {err.message}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"memctl: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
