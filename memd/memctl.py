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
    evict = sub.add_parser("evict", help="drop a parked sequence's pages (its token ids stay)")
    target = evict.add_mutually_exclusive_group(required=True)
    target.add_argument("--seq", type=int, help="sequence id")
    target.add_argument("--session", help="session id")
    sub.add_parser("check", help="verify the invariants; exit 1 listing violations")
    return p


def stats_dict(reply: Any) -> dict[str, Any]:
    data = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for key in ("total_blocks", "free_blocks", "used_blocks", "cached_blocks", "block_bytes", "pool_bytes",
                "generation", "bytes_per_token"):
        data[key] = int(data[key])      # protobuf's JSON form writes 64-bit ints as strings
    order = {state: i for i, state in enumerate(STATE_ORDER)}
    data["sequences"] = {k: int(v) for k, v in sorted(data["sequences"].items(), key=lambda kv: order.get(kv[0], 99))}
    data["counters"] = {k: int(v) for k, v in sorted(data["counters"].items())}
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
    if data["counters"]:
        lines.append("counters  " + ", ".join(f"{k} {v}" for k, v in data["counters"].items()))
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
            reply = await admin.evict(seq_id=args.seq, session_id=args.session)
            print(f"evicted sequence(s) {', '.join(map(str, reply.seq_ids))}: {reply.blocks_freed} block(s) freed")
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
