"""What memctl prints: every answer as plain data (its --json form) and as text for a terminal.

Each command turns memd's reply into a dict or list first; the text form is
rendered from that same data, so the two never disagree.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from google.protobuf.json_format import MessageToDict

from memd.sequences import EvictionReason, SeqState
from memd.snapshots import SEQ_FIELDS, WORKER_FIELDS, block_values
from shared.rpc import memd_pb2 as pb
from shared.sizes import format_size

SNAPSHOT_COLUMNS = ["block_id", "ref_count", "last_access", "seq_id", "state", "heat", "owner"]
STATE_ORDER = [state.value for state in SeqState]
PRESSURE_COUNTERS = ("swap_outs", "swap_ins", "drops", "preemptions")
INTEGRITY_COUNTERS = ("integrity_failures", "pages_verified")


def stats_dict(reply: pb.StatsReply) -> dict[str, Any]:
    data = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for key in ("total_blocks", "free_blocks", "used_blocks", "cached_blocks", "block_bytes", "pool_bytes",
                "generation", "bytes_per_token", "swap_total_blocks", "swap_free_blocks", "swapped_blocks",
                "prefix_blocks"):
        data[key] = int(data[key])      # protobuf's JSON form writes 64-bit ints as strings
    order = {state: i for i, state in enumerate(STATE_ORDER)}
    data["sequences"] = {k: int(v) for k, v in sorted(data["sequences"].items(), key=lambda kv: order.get(kv[0], 99))}
    data["rpcs"] = {k: int(v) for k, v in sorted(data["rpcs"].items())}
    counters = {k: int(v) for k, v in sorted(data["counters"].items())}
    for key in (*PRESSURE_COUNTERS, *INTEGRITY_COUNTERS):
        counters.setdefault(key, 0)
    counters["evictions"] = {reason.value: counters.pop(reason.counter, 0) for reason in EvictionReason}
    data["counters"] = counters
    return data


def render_stats(data: dict[str, Any]) -> str:
    total = data["total_blocks"] or 1
    lines = [
        f"pool      {format_size(data['pool_bytes'])} on {data['device']} ({data['backend']}), "
        f"{data['total_blocks']} blocks of {format_size(data['block_bytes'])}",
        f"used      {data['used_blocks']} blocks ({100 * data['used_blocks'] / total:.1f}%), "
        f"free {data['free_blocks']} (of which {data['cached_blocks']} hold cached prefixes)",
        f"workers   {data['workers']}" + (" (all draining)" if data["draining"] else ""),
        "sequences " + ", ".join(f"{k} {v}" for k, v in data["sequences"].items()),
    ]
    c = data["counters"]
    if data["swap_total_blocks"]:
        lines.append(f"swap      {data['swapped_blocks']} of {data['swap_total_blocks']} blocks hold swapped "
                     f"sequences, {data['swap_free_blocks']} free")
    else:
        lines.append("swap      off")
    if data.get("cluster", "off") != "off":
        lines.append(f"cluster   store {data['cluster']}; blocks out {c.get('cluster_puts', 0)}, in "
                     f"{c.get('cluster_hits', 0)}, missed {c.get('cluster_misses', 0)}, "
                     f"errors {c.get('cluster_errors', 0)}")
    lines.append(f"pressure  swap-outs {c['swap_outs']}, swap-ins {c['swap_ins']}, drops {c['drops']}, "
                 f"preemptions {c['preemptions']}; evictions " +
                 ", ".join(f"{reason} {n}" for reason, n in c["evictions"].items()))
    rest = {k: v for k, v in c.items() if k not in (*PRESSURE_COUNTERS, "evictions")}
    if rest:
        lines.append("counters  " + ", ".join(f"{k} {v}" for k, v in rest.items()))
    return "\n".join(lines)


def snapshot_csv(reply: pb.SnapshotReply) -> str:
    """One row per block, `block_id,ref_count,last_access,seq_id` first (then state, heat, owner).

    To find leaked pages, filter ref_count > 0 and seq_id = -1 (held by no
    sequence), state other than `fenced`.
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(SNAPSHOT_COLUMNS)
    # Tuples straight from the packed rows, in C where it can: a dict per block made this 10 s of a core for a
    # million blocks, on the host whose memd it inspects.
    writer.writerows((block, ref, round(touched, 6), ";".join(map(str, seq_ids)) if seq_ids else -1, state,
                      round(heat, 4), ";".join(map(str, owners)) if owners else "")
                     for block, ref, touched, state, heat, seq_ids, owners in block_values(reply))
    return out.getvalue()


def workers_list(reply: pb.SnapshotReply) -> list[dict[str, Any]]:
    return [{**{f: getattr(w, f) for f in WORKER_FIELDS}, "idle_s": round(reply.taken_at - w.last_seen, 3)}
            for w in sorted(reply.workers, key=lambda w: w.worker_id)]


def sequences_list(reply: pb.SnapshotReply) -> list[dict[str, Any]]:
    return [{**{f: getattr(s, f) for f in SEQ_FIELDS}, "blocks": len(s.block_ids),
             "idle_s": round(reply.taken_at - s.last_access, 3)}
            for s in sorted(reply.sequences, key=lambda s: s.seq_id)]


def tenants_list(quotas: pb.QuotasReply) -> list[dict[str, Any]]:
    """Per tenant: its sequences by state, the pool pages they hold (a page two of its sequences share once; a
    page two tenants' sequences share counts for each), the swap slots they fill, its quota, evictions and
    refusals. "" is the sequences of none. Read from memd's per-holder counts (QuotasRequest.with_no_tenant),
    not from a snapshot of every sequence."""
    rows = []
    for h in quotas.holders:
        if h.kind != "tenant":
            continue
        states = dict(h.sequences)
        rows.append({"tenant": h.name, "sequences": sum(states.values()), "sessions": h.sessions,
                     "running": states.get("running", 0), "parked": states.get("parked", 0),
                     "swapped": states.get("swapped", 0), "dropped": states.get("dropped", 0), "pages": h.pages,
                     "swap_slots": h.swap_slots, "guaranteed_pages": h.guaranteed_pages, "max_pages": h.max_pages,
                     "evictions": h.evictions, "refusals": h.refusals})
    return sorted(rows, key=lambda row: row["tenant"])


def render_tenants(rows: list[dict[str, Any]]) -> str:
    shown = [{**row, "tenant": row["tenant"] or "(none)", "max_pages": row["max_pages"] or "-"} for row in rows]
    return table(shown, ["tenant", "sequences", "sessions", "running", "parked", "swapped", "dropped", "pages",
                         "guaranteed_pages", "max_pages", "swap_slots", "evictions", "refusals"], "no sequence")


def quota_list(reply: pb.QuotasReply) -> list[dict[str, Any]]:
    return [{"kind": h.kind, "name": h.name, "guaranteed_pages": h.guaranteed_pages, "max_pages": h.max_pages,
             "pages": h.pages, "sequences": dict(h.sequences), "evictions": h.evictions, "refusals": h.refusals,
             "retained_pages": h.retained_pages, "set_at_run_time": h.set_at_run_time} for h in reply.holders]


def render_quotas(rows: list[dict[str, Any]]) -> str:
    shown = [{**row, "sequences": sum(row["sequences"].values()), "max_pages": row["max_pages"] or "-",
              "set": "memctl" if row["set_at_run_time"] else "file"} for row in rows]
    return table(shown, ["kind", "name", "guaranteed_pages", "max_pages", "pages", "retained_pages", "sequences",
                         "evictions", "refusals", "set"], "no tenant or model holds pages or has a quota")


def table(rows: list[dict[str, Any]], columns: list[str], empty: str) -> str:
    """Aligned columns, numbers to the right; `empty` when there are no rows."""
    if not rows:
        return empty

    def cell(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    cells = [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    numeric = [all(isinstance(row[c], int | float) and not isinstance(row[c], bool) for row in rows)
               for c in columns]
    lines = ["  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(columns, widths, numeric, strict=True))]
    for r in cells:
        lines.append("  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(r, widths, numeric, strict=True)))
    return "\n".join(line.rstrip() for line in lines)


def render_workers(rows: list[dict[str, Any]]) -> str:
    return table(rows, ["worker_id", "name", "pid", "model", "block_size", "running", "draining", "idle_s"],
                 "no worker attached")


def render_sequences(rows: list[dict[str, Any]]) -> str:
    return table(rows, ["seq_id", "session_id", "state", "owner", "model", "num_tokens", "blocks", "swapped_blocks",
                        "heat", "idle_s"], "no sequence matches")


def evicted_dict(reply: pb.EvictReply) -> dict[str, Any]:
    return {"swapped": list(reply.swapped), "dropped": list(reply.dropped), "revoked": list(reply.revoked),
            "blocks_freed": reply.blocks_freed, "free_blocks": reply.free_blocks}


def render_evicted(data: dict[str, Any], wanted_free: int | None = None) -> str:
    """`wanted_free`: the N of `evict --blocks N`, so the operator reads whether the room asked for is there."""
    free = f"{data['free_blocks']} now free"
    if wanted_free is not None and data["free_blocks"] < wanted_free:
        free += f", short of the {wanted_free} asked for: running sequences or swap-outs in flight hold the rest"
    if not (data["swapped"] or data["dropped"] or data["revoked"]):
        if wanted_free is None:
            return "evicted nothing: no sequence matched (or all were already swapped or dropped)"
        if data["free_blocks"] >= wanted_free:
            return f"evicted nothing: {data['free_blocks']} blocks are free already (asked for {wanted_free})"
        return f"evicted nothing: {free}"
    parts = []
    for label, key in (("swapped out", "swapped"), ("dropped", "dropped"),
                       ("revoked (running; their workers give them up)", "revoked")):
        if data[key]:
            parts.append(f"{label} {', '.join(map(str, data[key]))}")
    return f"{'; '.join(parts)}: {data['blocks_freed']} block(s) freed, {free}"


def scrubbed_dict(reply: pb.ScrubReply) -> dict[str, Any]:
    return {"pages": reply.pages, "slots": reply.slots, "bytes": reply.bytes, "seconds": reply.seconds,
            "failures": [{"where": f.where, "index": f.index, "seq_ids": list(f.seq_ids), "sessions": list(f.sessions)}
                         for f in reply.failures]}


def render_scrubbed(data: dict[str, Any]) -> str:
    checked = (f"scrub: {data['pages']} page(s) and {data['slots']} swap slot(s) checked, "
               f"{format_size(data['bytes'])} in {data['seconds']:.2f} s")
    if not data["failures"]:
        return f"{checked}: all intact"
    lines = [f"{checked}: {len(data['failures'])} corrupted, dropped (their sequences recompute from before them)"]
    for f in data["failures"]:
        whose = ", ".join([f"seq {s}" for s in f["seq_ids"]] + [f"session {s!r}" for s in f["sessions"]])
        what = "block" if f["where"] == "page" else "swap slot"
        lines.append(f"  {what} {f['index']}: {whose or 'cached, no sequence'}")
    return "\n".join(lines)


def drained_dict(reply: pb.DrainReply, undo: bool) -> dict[str, Any]:
    return {"draining": list(reply.worker_ids), "running": reply.running, "undone": undo,
            "drained": not undo and reply.running == 0}


def render_drained(data: dict[str, Any], worker_id: int) -> str:
    who = f"worker {worker_id}" if worker_id else "every worker"
    if data["undone"]:
        return f"{who} admits requests again"
    if data["drained"]:
        return f"{who} drained: nothing running; draining now: {data['draining'] or 'none'}"
    return (f"{who} still has {data['running']} sequence(s) running or preempted and waiting to resume: "
            "not drained yet (the drain stays on)")


def as_json(data: Any) -> str:
    return json.dumps(data)
