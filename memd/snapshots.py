"""Snapshot files and what changed between two of them: the leak hunt in one command.

A page leak shows two ways: blocks held by no sequence, and a sequence whose
blocks stay held and untouched while latency creeps up (a session whose
/reset never freed it). Both are found by dumping every block's ref count
and owner, twice, and comparing. `memctl snapshot --format msgpack|json`
writes one document; `memctl diff A B` reads two and reports exactly those:
orphaned blocks, sequences that grew, sequences that hold pages but were not
touched between the two snapshots, and what appeared and went.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from shared.rpc import memd_pb2 as pb

FORMAT_VERSION = 1
SEQ_FIELDS = ("seq_id", "session_id", "state", "owner", "num_committed", "num_tokens", "model", "last_access",
              "heat", "swapped_blocks", "tenant", "retain_until")
WORKER_FIELDS = ("worker_id", "name", "pid", "model", "block_size", "last_seen", "running", "draining")


class SnapshotError(ValueError):
    """A snapshot file cannot be read; the message says which and why."""


def document(reply: pb.SnapshotReply) -> dict[str, Any]:
    """A snapshot as plain data: the same for JSON and msgpack, ids as numbers."""
    return {
        "kvpool_snapshot": FORMAT_VERSION, "generation": reply.generation, "taken_at": reply.taken_at,
        "block_bytes": reply.block_bytes,
        "blocks": block_rows(reply),
        "sequences": [{**{f: getattr(s, f) for f in SEQ_FIELDS}, "block_ids": list(s.block_ids)}
                      for s in reply.sequences],
        "workers": [{f: getattr(w, f) for f in WORKER_FIELDS} for w in reply.workers],
    }


def block_rows(reply: pb.SnapshotReply) -> list[dict[str, Any]]:
    """Every block of a snapshot, BlockRow's fields as a dict, whether memd sent rows or packed them."""
    return [{"block_id": block, "ref_count": ref, "last_access": touched, "state": state, "heat": heat,
             "seq_ids": seq_ids, "owners": owners}
            for block, ref, touched, state, heat, seq_ids, owners in block_values(reply)]


def block_values(reply: pb.SnapshotReply) -> Iterator[tuple]:
    """Every block of a snapshot as BlockRow's values in its field order, whether memd sent rows or packed them.

    Packed (SnapshotRequest.packed_blocks) is what memctl asks for: a million
    BlockRow messages read field by field took it about 7 s of a core, on the
    host whose memd it inspects; unpacked, the rows are lists at once."""
    if reply.packed_blocks:
        for part in reply.packed_blocks:
            yield from msgpack.unpackb(part)
        return
    for b in reply.blocks:
        yield b.block_id, b.ref_count, b.last_access, b.state, b.heat, list(b.seq_ids), list(b.owners)


def encode(doc: dict[str, Any], fmt: str) -> bytes:
    if fmt == "msgpack":
        return msgpack.packb(doc, use_bin_type=True)
    return (json.dumps(doc, indent=1) + "\n").encode()


def load(path: str | Path) -> dict[str, Any]:
    """A snapshot written by `memctl snapshot --format json` or `--format msgpack`."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc.strerror}") from None
    if data.startswith(b"block_id,"):
        raise SnapshotError(f"{path} is not a kvpool snapshot of format {FORMAT_VERSION} (a CSV snapshot has no "
                            "sequences: take it with --format json or msgpack)")
    try:
        doc = json.loads(data) if data.lstrip()[:1] == b"{" else msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise SnapshotError(f"{path} is neither a JSON nor a msgpack snapshot ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kvpool_snapshot") != FORMAT_VERSION:
        raise SnapshotError(f"{path} is not a kvpool snapshot of format {FORMAT_VERSION}")
    return doc


def _held(seq: dict[str, Any]) -> int:
    return len(seq["block_ids"])


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What changed from snapshot `a` to the later `b`, both of one memd run."""
    if a.get("generation") != b.get("generation"):
        raise SnapshotError("the snapshots come from different memd runs (it restarted in between): sequence ids "
                            "and clocks do not compare; take both from the running memd")
    seqs_a = {s["seq_id"]: s for s in a["sequences"]}
    seqs_b = {s["seq_id"]: s for s in b["sequences"]}
    both = [seqs_b[i] for i in seqs_b.keys() & seqs_a.keys()]

    def used(doc: dict[str, Any]) -> int:
        return sum(1 for block in doc["blocks"] if block["ref_count"] > 0)

    states_a = Counter(seq["state"] for seq in a["sequences"])
    states_b = Counter(seq["state"] for seq in b["sequences"])
    workers_a = {w["worker_id"] for w in a["workers"]}
    workers_b = {w["worker_id"] for w in b["workers"]}
    return {
        "elapsed_s": b["taken_at"] - a["taken_at"],
        "used_blocks": [used(a), used(b)],
        "sequences": {state: [states_a[state], states_b[state]] for state in sorted(states_a.keys() | states_b.keys())},
        # Held by no sequence: nothing will ever free them.
        "orphaned_blocks": [blk["block_id"] for blk in b["blocks"]
                            if blk["ref_count"] > 0 and not blk["seq_ids"] and blk.get("state") != "fenced"],
        "grew": sorted(({"seq_id": s["seq_id"], "session_id": s["session_id"], "state": s["state"],
                         "blocks": [_held(seqs_a[s["seq_id"]]), _held(s)]}
                        for s in both if _held(s) > _held(seqs_a[s["seq_id"]])),
                       key=lambda g: g["blocks"][0] - g["blocks"][1]),
        # Holding pages, yet no Step, resume or prefix hit touched them between the snapshots.
        "untouched": sorted(({"seq_id": s["seq_id"], "session_id": s["session_id"], "state": s["state"],
                              "blocks": _held(s), "idle_s": b["taken_at"] - s["last_access"]}
                             for s in both if _held(s) and s["last_access"] == seqs_a[s["seq_id"]]["last_access"]),
                            key=lambda u: -u["blocks"]),
        "appeared": [{"seq_id": s["seq_id"], "session_id": s["session_id"], "state": s["state"], "blocks": _held(s)}
                     for s in seqs_b.values() if s["seq_id"] not in seqs_a],
        "gone": sorted(seqs_a.keys() - seqs_b.keys()),
        "workers": {"joined": sorted(workers_b - workers_a), "left": sorted(workers_a - workers_b)},
    }


def render(d: dict[str, Any], limit: int = 10) -> str:
    """The diff for a terminal: the suspicious parts first."""
    lines = [f"{d['elapsed_s']:.1f} s between the snapshots; used blocks {d['used_blocks'][0]} -> "
             f"{d['used_blocks'][1]} ({d['used_blocks'][1] - d['used_blocks'][0]:+d})"]
    lines.append("sequences " + (", ".join(f"{state} {n[0]} -> {n[1]}" for state, n in d["sequences"].items())
                                 or "none"))
    orphans = d["orphaned_blocks"]
    lines.append(f"orphaned blocks (held by no sequence): {len(orphans)}"
                 + (f": {', '.join(map(str, orphans[:limit]))}{' ...' if len(orphans) > limit else ''}"
                    if orphans else ""))

    def session(row: dict[str, Any]) -> str:
        return f" (session {row['session_id']})" if row["session_id"] else ""

    if d["untouched"]:
        lines.append(f"held but untouched between the snapshots: {len(d['untouched'])} sequence(s)")
        lines += [f"  seq {u['seq_id']}{session(u)}: {u['state']}, {u['blocks']} block(s), idle {u['idle_s']:.0f} s"
                  for u in d["untouched"][:limit]]
    if d["grew"]:
        lines.append(f"grew: {len(d['grew'])} sequence(s)")
        lines += [f"  seq {g['seq_id']}{session(g)}: {g['state']}, {g['blocks'][0]} -> {g['blocks'][1]} blocks"
                  for g in d["grew"][:limit]]
    lines.append(f"appeared {len(d['appeared'])}, gone {len(d['gone'])}; workers joined "
                 f"{d['workers']['joined'] or 'none'}, left {d['workers']['left'] or 'none'}")
    return "\n".join(lines)
