"""memctl: look inside a running memd, and steer it.

Exit codes (also in `memctl --help`):
  0  done
  1  the answer is bad news or was refused: check found violations, scrub found
     corrupted pages, drain timed out with sequences still running, memd refused
  2  memd cannot be reached, a file cannot be read, or the command line is wrong
  130 interrupted
  141 the reader of its output went away (memctl snapshot | head); nothing is said
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc
import shtab

from memd import snapshots, views
from shared import address as addr
from shared.client import MemdAdmin, MemdError
from shared.command_line import Parser, entry_point
from shared.flag_types import UINT64_MAX, count, number, proto_id, seconds, seconds_or_zero, timeout, wait
from shared.tokens import TokenError

EXIT_CODES = """exit codes:
  0    done
  1    bad news or refused: check found violations, scrub corrupted pages, a drain timed out, memd refused
  2    memd unreachable, a file unreadable, or a wrong command line
  130  interrupted
  141  the reader of the output went away (memctl snapshot | head)"""


worker_id = proto_id("worker", "memctl workers")
seq_id = proto_id("sequence", "memctl sequences")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="memctl", description="Inspect and steer a running memd.", epilog=EXIT_CODES,
               formatter_class=argparse.RawDescriptionHelpFormatter, version=True)
    p.add_argument("--address", help="memd address (default: $MEMD_ADDRESS, else the per-user socket if it "
                                     "exists, else memd.service's /run/memd/memd.sock)")
    p.add_argument("--timeout", type=timeout, default=10.0,
                   help="seconds to wait for memd's answer, or for each part of a snapshot (default: 10)")
    as_json = Parser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print one JSON document")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("stats", parents=[as_json], help="pool usage, sequences by state, workers, counters")
    snap = sub.add_parser("snapshot", help="every block: ref count, last access, sequences, state, heat, owner")
    snap.add_argument("--format", choices=["csv", "json", "msgpack"], default="csv",
                      help="csv: the block table; json, msgpack: blocks, sequences and workers (for memctl diff)")
    snap.add_argument("-o", "--output", help="write to this file instead of stdout").complete = shtab.FILE
    diff = sub.add_parser("diff", parents=[as_json], help="what changed between two snapshots: orphaned blocks, "
                                                          "growth, sequences held but untouched")
    diff.add_argument("before").complete = shtab.FILE
    diff.add_argument("after").complete = shtab.FILE
    sub.add_parser("workers", parents=[as_json], help="attached workers: running sequences, drain, last heartbeat")
    seqs = sub.add_parser("sequences", parents=[as_json], help="sequences with their state, owner, size and heat")
    sub.add_parser("tenants", parents=[as_json], help="per tenant (inferd --api-keys): sequences by state, pool "
                                                      "pages held, quota, swap slots filled, evictions")
    quota = sub.add_parser("quota", parents=[as_json], help="page quotas per tenant and model: list, or set one now",
                           description="With no KIND: every tenant and model with a quota or a sequence. With "
                                       "KIND NAME: set its quota now (kept across memd restarts), or --clear it "
                                       "back to memd --quotas's.")
    quota.add_argument("kind", nargs="?", choices=["tenant", "model"])
    quota.add_argument("name", nargs="?")
    quota.add_argument("--guaranteed", type=number(int, at_least=0, at_most=UINT64_MAX), metavar="PAGES",
                       help="pages others' pressure never evicts its parked sequences below (default: as it is)")
    quota.add_argument("--max", type=number(int, at_least=0, at_most=UINT64_MAX), metavar="PAGES",
                       help="pages it may hold at most, 0 for no max; its own coldest go first, then its requests "
                            "wait (default: as it is)")
    quota.add_argument("--clear", action="store_true", help="forget the quota set at run time")
    seqs.add_argument("--state", choices=views.STATE_ORDER)
    seqs.add_argument("--worker", type=worker_id, metavar="ID", help="only those running on this worker")
    evict = sub.add_parser("evict", parents=[as_json],
                           help="free pages now: swap out or drop sequences (their token ids stay)",
                           description="A running sequence is revoked: its worker preempts it, then memd "
                                       "swaps or drops it and the worker recomputes or swaps it back in later.")
    target = evict.add_mutually_exclusive_group(required=True)
    target.add_argument("--seq", type=seq_id, metavar="ID", help="sequence id")
    target.add_argument("--session", help="session id")
    target.add_argument("--idle", type=seconds_or_zero, metavar="SECONDS",
                        help="every parked or swapped sequence idle this long")
    target.add_argument("--blocks", type=count(UINT64_MAX), metavar="N",
                        help="the coldest parked sequences until at least N blocks are free (none if N already are)")
    target.add_argument("--worker", type=worker_id, metavar="ID", help="every sequence running on this worker")
    mode = evict.add_mutually_exclusive_group()
    mode.add_argument("--swap", dest="mode", action="store_const", const="swap",
                      help="copy pages to the host swap tier (the default; drops when swap is off or full)")
    mode.add_argument("--drop", dest="mode", action="store_const", const="drop",
                      help="release pages outright; a resume recomputes")
    drain = sub.add_parser("drain", parents=[as_json], help="stop admitting requests, wait for running ones to end",
                           description="Workers refuse new requests (UNAVAILABLE, so a balancer retries elsewhere) "
                                       "and finish the running ones; the drain lasts until --undo or the worker "
                                       "re-attaches. Exit 0 once nothing runs or waits to resume, 1 if --wait "
                                       "passes first.")
    drain.add_argument("--worker", type=worker_id, metavar="ID",
                       help="one worker (default: every worker, and new ones)")
    drain.add_argument("--wait", type=wait, metavar="SECONDS",
                       help="wait this long for running sequences to end (default: 300; 0: do not wait)")
    drain.add_argument("--undo", action="store_true", help="end the drain: admit requests again")
    sub.add_parser("check", parents=[as_json], help="verify the invariants; exit 1 listing violations")
    scrub = sub.add_parser("scrub", parents=[as_json],
                           help="check every parked, cached and swapped page against its checksum; exit 1 if any "
                                "was corrupted",
                           description="Runs in memd beside the Steps (a thread of its own). A corrupted page "
                                       "is never reused: its sequences keep their tokens and recompute from "
                                       "before it. Exit 0 all intact, 1 corrupted pages found (each listed), "
                                       "2 memd unreachable.")
    scrub.add_argument("--rate", type=number(at_least=0), default=0.0, metavar="MB/s",
                       help="hash at most this many MB per second (default: 0, as fast as one thread goes)")
    top = sub.add_parser("top", help="a live view (q quits): pool, swap, sequences, workers, hot and cold sequences, "
                                     "RPC rate")
    top.add_argument("--interval", type=seconds, default=1.0, help="seconds between refreshes (default: 1)")
    top.add_argument("--once", action="store_true", help="print one frame now (rates since memd started) and exit")
    completion = sub.add_parser("completion", help="print a shell completion script",
                                description="bash: memctl completion bash > /etc/bash_completion.d/memctl\n"
                                            "zsh:  memctl completion zsh > \"${fpath[1]}/_memctl\"",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    completion.add_argument("shell", choices=["bash", "zsh", "tcsh"])
    return p


def show(args: argparse.Namespace, data: object, text: str) -> None:
    print(views.as_json(data) if getattr(args, "json", False) else text)


async def run(args: argparse.Namespace, target: str) -> int:
    async with MemdAdmin(target, timeout_s=args.timeout) as admin:
        if args.command == "stats":
            data = views.stats_dict(await admin.stats())
            show(args, data, views.render_stats(data))
        elif args.command == "snapshot":
            reply = await admin.snapshot(packed=True)
            if args.format == "csv":
                blob = views.snapshot_csv(reply).encode()
            else:
                blob = snapshots.encode(snapshots.document(reply), args.format)
            if args.output:
                with open(args.output, "wb") as f:
                    f.write(blob)
            else:
                sys.stdout.buffer.write(blob)
        elif args.command == "workers":
            rows = views.workers_list(await admin.snapshot(blocks=False))
            show(args, rows, views.render_workers(rows))
        elif args.command == "sequences":
            reply = await admin.snapshot(blocks=False, state=args.state or "", worker_id=args.worker or 0)
            rows = views.sequences_list(reply)
            show(args, rows, views.render_sequences(rows))
        elif args.command == "tenants":
            rows = views.tenants_list(await admin.quotas(with_no_tenant=True))
            show(args, rows, views.render_tenants(rows))
        elif args.command == "quota":
            if args.kind is None:
                reply = await admin.quotas()
            else:
                now = next((h for h in (await admin.quotas()).holders if (h.kind, h.name) == (args.kind, args.name)),
                           None)
                guaranteed = args.guaranteed if args.guaranteed is not None else now.guaranteed_pages if now else 0
                limit = args.max if args.max is not None else now.max_pages if now else 0
                reply = await admin.set_quota(args.kind, args.name, guaranteed_pages=0 if args.clear else guaranteed,
                                              max_pages=0 if args.clear else limit, clear=args.clear)
            rows = views.quota_list(reply)
            show(args, rows, views.render_quotas(rows))
        elif args.command == "evict":
            reply = await admin.evict(seq_id=args.seq, session_id=args.session, idle_s=args.idle, blocks=args.blocks,
                                      worker_id=args.worker, mode=args.mode or "swap")
            data = views.evicted_dict(reply)
            show(args, data, views.render_evicted(data, args.blocks))
        elif args.command == "drain":
            data = views.drained_dict(await admin.drain(args.worker or 0, undo=args.undo, wait_s=args.wait),
                                      args.undo)
            show(args, data, views.render_drained(data, args.worker or 0))
            return 0 if data["undone"] or data["drained"] else 1
        elif args.command == "check":
            reply = await admin.check()
            show(args, {"ok": reply.ok, "violations": list(reply.violations)},
                 "check: ok" if reply.ok else "\n".join(reply.violations))
            if not reply.ok:
                print(f"check: {len(reply.violations)} violation(s)", file=sys.stderr)
                return 1
        elif args.command == "scrub":
            data = views.scrubbed_dict(await admin.scrub(args.rate * 1e6))
            show(args, data, views.render_scrubbed(data))
            if data["failures"]:
                return 1
        elif args.command == "top":
            from memd.top import top
            await top(admin, args.interval, args.once)
    return 0


def offline(args: argparse.Namespace) -> int | None:
    """Commands that need no memd; None for those that do."""
    if args.command == "completion":
        print(shtab.complete(build_parser(), shell=args.shell))
        return 0
    if args.command == "diff":
        before, after = snapshots.load(args.before), snapshots.load(args.after)
        data = snapshots.diff(before, after)
        show(args, data, snapshots.render(data))
        return 0
    if args.command == "snapshot" and args.format == "msgpack" and not args.output and sys.stdout.isatty():
        print("memctl: msgpack is binary: give -o FILE or redirect the output", file=sys.stderr)
        return 2
    return None


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with what no flag's type can see: flags that mean nothing together."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "quota":
        if args.kind is not None and not args.name:
            parser.error(f"quota {args.kind} needs the {args.kind}'s name")
        given = args.guaranteed is not None or args.max is not None
        if args.kind is None and (args.clear or given):
            parser.error("quota --guaranteed, --max and --clear need KIND and NAME: memctl quota tenant acme --max 512")
        if args.clear and given:
            parser.error("quota --clear goes back to memd --quotas's: give no pages with it")
        if args.kind is not None and args.name and not (args.clear or given):
            parser.error(f"quota {args.kind} {args.name}: say what to set (--guaranteed, --max) or --clear")
    if args.command == "drain":
        if args.undo and args.wait is not None:
            parser.error("drain --wait means nothing with --undo: ending a drain returns at once")
        args.wait = (0.0 if args.undo else 300.0) if args.wait is None else args.wait
    return args


@entry_point("memctl")
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    target = addr.connect_target(args.address)
    try:
        if (done := offline(args)) is not None:
            return done
        return asyncio.run(run(args, target))
    except (snapshots.SnapshotError, TokenError) as err:
        print(f"memctl: {err}", file=sys.stderr)
        return 2
    except MemdError as err:
        if err.code is grpc.StatusCode.UNAVAILABLE:
            print(f"memctl: {addr.not_reachable('memd', target, err.message)}", file=sys.stderr)
            return 2
        if err.code is grpc.StatusCode.DEADLINE_EXCEEDED:      # connected but slow, or a TCP peer that never says
            print(f"memctl: memd at {target} did not answer within {args.timeout:g} s (--timeout)", file=sys.stderr)
            return 2
        print(f"memctl: {err.code.name.lower().replace('_', ' ')}: {err.message}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise                            # entry_point: the reader went away, nothing to say
    except OSError as err:
        print(f"memctl: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0 if args.command == "top" else 130


if __name__ == "__main__":
    sys.exit(main())
