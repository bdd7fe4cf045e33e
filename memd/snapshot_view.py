"""A snapshot of memd's state taken in one instant on the event loop, turned into a reply on another thread.

Building a million block rows took seconds on the loop, and every worker's
Step waited for them. Taking the snapshot is now only copying flat arrays
(the pool's ref counts, access times and prefix hashes) and one small tuple
per sequence: consistent, because nothing else runs on the loop meanwhile,
and a few milliseconds per million blocks. The rows are built from the copies
on a thread and serialized there too (memd's `SerializedReplies` interceptor
sends the bytes as they are), while Steps go on.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from memd.manager import KvManager
from memd.sequences import SeqState
from shared.rpc import memd_pb2 as pb

CHUNK_ROWS = 2048           # rows serialized at once: a few milliseconds of the GIL


@dataclass(frozen=True, slots=True)
class _Seq:
    seq_id: int
    session_id: str
    state: str
    owner: int
    running: bool
    num_committed: int
    num_tokens: int
    block_ids: list[int]
    model: str
    last_access: float
    heat: float
    swapped_blocks: int


@dataclass(frozen=True, slots=True)
class SnapshotView:
    taken_at: float
    block_bytes: int
    generation: int
    ref: list[int] | None                   # None: the request skipped blocks
    last_access: list[float] | None
    hash_of: list[Any] | None
    fenced: frozenset[int]
    seqs: list[_Seq]
    shown: frozenset[int]                   # the sequences the request asked for, by id
    workers: list[pb.WorkerRow]

    @classmethod
    def capture(cls, manager: KvManager, request: pb.SnapshotRequest, workers: list[pb.WorkerRow],
                generation: int, now: float) -> SnapshotView:
        """Copies of what the reply shows; call on the event loop, with nothing awaited in between."""
        pool = manager.pool
        blocks = not request.skip_blocks
        seqs = [_Seq(s.seq_id, s.session_id or "", s.state.value, s.owner or 0, s.state is SeqState.RUNNING,
                     s.num_committed, len(s.token_ids), list(s.block_ids), s.model, s.last_access,
                     manager.heat(s, now), len(s.slots))
                for s in manager.seqs.values()]
        shown = frozenset(s.seq_id for s in seqs
                          if (not request.state or s.state == request.state)
                          and (not request.worker_id or (s.owner == request.worker_id and s.running)))
        return cls(now, manager.geometry.block_bytes, generation,
                   pool.ref.copy() if blocks else None, pool.last_access.copy() if blocks else None,
                   pool.hash_of.copy() if blocks else None,
                   frozenset(b for pages in manager.fences.values() for b in pages), seqs, shown, workers)

    def serialized(self) -> bytes:
        """The reply as gRPC sends it, built from the copies (on a thread: it touches nothing live).

        Serialized a chunk of rows at a time: protobuf's serializer holds the
        GIL for a whole message (close to a second for a million rows, the
        event loop stalled all along), and serialized messages concatenated
        are one message whose repeated fields hold every chunk's rows.
        """
        parts = [pb.SnapshotReply(taken_at=self.taken_at, block_bytes=self.block_bytes, workers=self.workers,
                                  generation=self.generation).SerializeToString()]
        for rows in _batched(self._blocks(), CHUNK_ROWS):
            parts.append(pb.SnapshotReply(blocks=rows).SerializeToString())
        shown = (self._seq_row(s) for s in self.seqs if s.seq_id in self.shown)
        for rows in _batched(shown, CHUNK_ROWS):
            parts.append(pb.SnapshotReply(sequences=rows).SerializeToString())
        return b"".join(parts)

    def _blocks(self) -> Iterator[pb.BlockRow]:
        if self.ref is None or self.last_access is None or self.hash_of is None:
            return
        holders: dict[int, list[_Seq]] = {}
        for seq in self.seqs:
            for block in seq.block_ids:
                holders.setdefault(block, []).append(seq)
        for block, (ref, touched, digest) in enumerate(zip(self.ref, self.last_access, self.hash_of, strict=True)):
            seqs = holders.get(block)
            if seqs:
                yield pb.BlockRow(block_id=block, ref_count=ref, last_access=touched, seq_ids=[s.seq_id for s in seqs],
                                  state=",".join(sorted({s.state for s in seqs})), heat=max(s.heat for s in seqs),
                                  owners=sorted({s.owner for s in seqs if s.running and s.owner}))
            else:
                state = ("fenced" if block in self.fenced          # a reclaimed worker may still write it
                         else "cached" if digest is not None else "free")
                yield pb.BlockRow(block_id=block, ref_count=ref, last_access=touched, state=state)

    @staticmethod
    def _seq_row(s: _Seq) -> pb.SeqRow:
        return pb.SeqRow(seq_id=s.seq_id, session_id=s.session_id, state=s.state, owner=s.owner,
                         num_committed=s.num_committed, num_tokens=s.num_tokens, block_ids=s.block_ids,
                         model=s.model, last_access=s.last_access, heat=s.heat, swapped_blocks=s.swapped_blocks)


def _batched(rows: Iterator[Any], size: int) -> Iterator[list[Any]]:
    """Lists of `size` rows (itertools.batched, which Python 3.11 lacks)."""
    while chunk := list(itertools.islice(rows, size)):
        yield chunk
