"""A snapshot of memd's state as of one instant, streamed to memctl a chunk of rows at a time.

Building a million block rows took seconds on the loop, and every worker's
Step waited for them; building them on a thread instead still made Steps
wait tens of milliseconds, for the thread's hold on the GIL. Now the state
is copied a slice at a time between Steps (memd.state_copy: the copy is
still of one instant), and the rows are built from the copy and sent a
chunk at a time, each a reply message of its own on the stream: the loop
serves Steps between chunks, and memd never holds the whole reply.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from memd import state_copy
from memd.manager import KvManager
from memd.state_copy import SeqCopy, StateCopy
from shared.rpc import memd_pb2 as pb

CHUNK_ROWS = 512            # rows per reply message: about a millisecond to build and serialize
SEQS_SLICE = 512            # sequences indexed or filtered between two turns of the loop


@dataclass(frozen=True, slots=True)
class SnapshotView:
    taken_at: float
    block_bytes: int
    generation: int
    state: StateCopy
    blocks: bool                            # False: the request skipped them
    request: pb.SnapshotRequest             # its filters say which sequences are shown
    workers: list[pb.WorkerRow]

    @classmethod
    async def take(cls, manager: KvManager, request: pb.SnapshotRequest,
                   workers: Callable[[], list[pb.WorkerRow]], generation: int) -> SnapshotView:
        """The view as of one instant; `workers` is called at that instant, with nothing awaited in between."""
        state = await state_copy.take(manager, blocks=not request.skip_blocks)
        return cls(time.monotonic(), manager.geometry.block_bytes, generation, state, not request.skip_blocks,
                   request, workers())

    async def replies(self) -> AsyncIterator[bytes]:
        """The reply, serialized, as a stream of messages: workers first, then blocks, then sequences.

        The messages merged (as memd's client does) are the whole snapshot. A
        chunk of rows is built per message: a millisecond or so of the loop.
        """
        yield pb.SnapshotReply(taken_at=self.taken_at, block_bytes=self.block_bytes, workers=self.workers,
                               generation=self.generation).SerializeToString()
        if self.blocks:
            holders = await self._holders()
            for rows in _batched(self._blocks(holders), CHUNK_ROWS):
                yield pb.SnapshotReply(blocks=rows).SerializeToString()
        want, rows, pacer = self.request, [], state_copy.Pacer()
        for n, s in enumerate(self.state.seqs.values(), 1):
            if (not want.state or s.state == want.state) \
                    and (not want.worker_id or (s.owner == want.worker_id and s.running)):
                rows.append(self._seq_row(s))
                if len(rows) == CHUNK_ROWS:
                    yield pb.SnapshotReply(sequences=rows).SerializeToString()
                    rows = []
            if n % SEQS_SLICE == 0:                 # a filter may pass over many before it shows one
                await pacer.pause()
        if rows:
            yield pb.SnapshotReply(sequences=rows).SerializeToString()

    async def _holders(self) -> dict[int, list[SeqCopy]]:
        """Block -> the sequences whose tables name it."""
        holders: dict[int, list[SeqCopy]] = {}
        pacer = state_copy.Pacer()
        for n, seq in enumerate(self.state.seqs.values(), 1):
            for block in seq.block_ids:
                holders.setdefault(block, []).append(seq)
            if n % SEQS_SLICE == 0:
                await pacer.pause()
        return holders

    def _blocks(self, holders: dict[int, list[SeqCopy]]) -> Iterator[pb.BlockRow]:
        state, now = self.state, self.taken_at
        fenced = {block for pages in state.fences.values() for block in pages}
        assert state.blocks is not None
        for block, (ref, touched, cached) in enumerate(state.blocks.rows()):
            seqs = holders.get(block)
            if seqs:
                yield pb.BlockRow(block_id=block, ref_count=ref, last_access=touched, seq_ids=[s.seq_id for s in seqs],
                                  state=",".join(sorted({s.state for s in seqs})),
                                  heat=max(state.heat(s, now) for s in seqs),
                                  owners=sorted({s.owner for s in seqs if s.running and s.owner}))
            else:
                state_name = ("fenced" if block in fenced          # a reclaimed worker may still write it
                              else "cached" if cached else "free")
                yield pb.BlockRow(block_id=block, ref_count=ref, last_access=touched, state=state_name)

    def _seq_row(self, s: SeqCopy) -> pb.SeqRow:
        return pb.SeqRow(seq_id=s.seq_id, session_id=s.session_id, state=s.state, owner=s.owner,
                         num_committed=s.num_committed, num_tokens=s.num_tokens, block_ids=s.block_ids,
                         model=s.model, last_access=s.last_access, heat=self.state.heat(s, self.taken_at),
                         swapped_blocks=s.swapped_blocks)


def _batched(rows: Iterator[Any], size: int) -> Iterator[list[Any]]:
    """Lists of `size` rows (itertools.batched, which Python 3.11 lacks)."""
    while chunk := list(itertools.islice(rows, size)):
        yield chunk
