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
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass

import msgpack

from memd import state_copy
from memd.manager import KvManager
from memd.state_copy import SeqCopy, StateCopy
from shared.rpc import memd_pb2 as pb

# A block's BlockRow fields: block_id, ref_count, last_access, state, heat, seq_ids, owners.
BlockValues = tuple[int, int, float, str, float, Sequence[int], Sequence[int]]
CHUNK_ROWS = 512            # rows per reply message: about a millisecond to build and serialize
PACKED_CHUNK_ROWS = 1_024   # packed blocks per reply message: made in C, about as long as CHUNK_ROWS rows
NAMED_CHUNK_ROWS = 128      # of them at most, blocks sequences hold or fences name: each made in Python, 5-7 us
SEQ_CHUNK_ROWS = 128        # sequence rows per reply message: 8-10 us each
UNNAMED_STATES = ("free", "cached")    # a block no sequence holds and no fence names, by whether it is cached
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
        # A slice of the loop ends at each message, as at each pause: the stream writes it, then paces the next.
        pacer = state_copy.Pacer()
        if self.blocks:
            holders = await self._holders()
            pacer.resumed()
            for chunk in self._block_chunks(holders):
                pacer.held()
                yield chunk
                pacer.resumed()
        want, reply = self.request, pb.SnapshotReply()
        for n, s in enumerate(self.state.seqs.values(), 1):
            if (not want.state or s.state == want.state) \
                    and (not want.worker_id or (s.owner == want.worker_id and s.running)):
                self._seq_row(reply.sequences.add(), s)
                if len(reply.sequences) == SEQ_CHUNK_ROWS:
                    pacer.held()
                    yield reply.SerializeToString()
                    pacer.resumed()
                    reply = pb.SnapshotReply()
            if n % SEQS_SLICE == 0:                 # a filter may pass over many before it shows one
                await pacer.pause()
        pacer.held()
        if reply.sequences:
            yield reply.SerializeToString()

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

    def _block_chunks(self, holders: dict[int, list[SeqCopy]]) -> Iterator[bytes]:
        """Reply messages of CHUNK_ROWS blocks, serialized: BlockRow messages, or packed (`packed_blocks`).

        A row is made in its message (`add`) with only the fields it has: built apart and copied in it cost
        three times as much, and a million of them were most of a snapshot's time on the loop. Packed, a
        row is one tuple, and msgpack encodes the chunk in C."""
        if self.request.packed_blocks:
            yield from self._packed_chunks(holders)
            return
        rows = self._block_rows(holders)
        reply = pb.SnapshotReply()
        add = reply.blocks.add
        for block, ref, touched, state, heat, seq_ids, owners in rows:
            row = add()
            row.block_id, row.ref_count, row.last_access, row.state = block, ref, touched, state
            if seq_ids:
                row.seq_ids.extend(seq_ids)
                row.heat = heat
                row.owners.extend(owners)
            if len(reply.blocks) == CHUNK_ROWS:
                yield reply.SerializeToString()
                reply = pb.SnapshotReply()
                add = reply.blocks.add
        if reply.blocks:
            yield reply.SerializeToString()

    def _packed_chunks(self, holders: dict[int, list[SeqCopy]]) -> Iterator[bytes]:
        """Packed parts of PACKED_CHUNK_ROWS blocks. The rows of blocks no sequence holds and no fence names
        (most of a pool) are zipped, in C, from the copy's arrays; only the others are made one by one."""
        blocks, fenced = self.state.blocks, self._fenced()
        assert blocks is not None
        named = sorted({*holders, *fenced})
        at, start = 0, 0                                  # into `named`; the first block of the slice
        for refs, touched, cached in zip(blocks.ref, blocks.last_access, blocks.cached, strict=True):
            lo = 0
            while lo < len(refs):
                hi = min(lo + PACKED_CHUNK_ROWS, len(refs))
                if at + NAMED_CHUNK_ROWS < len(named):      # at most NAMED_CHUNK_ROWS named blocks in a chunk
                    hi = min(hi, named[at + NAMED_CHUNK_ROWS] - start)
                first, end = start + lo, start + hi
                rows: list[BlockValues] = list(zip(
                    range(first, end), refs[lo:hi].tolist(), touched[lo:hi].tolist(),
                    map(UNNAMED_STATES.__getitem__, cached[lo:hi]), itertools.repeat(0.0),
                    itertools.repeat(()), itertools.repeat(())))
                while at < len(named) and named[at] < end:
                    block = named[at]
                    i = block - first
                    rows[i] = self._block_row(block, rows[i][1], rows[i][2], cached[lo + i], holders, fenced)
                    at += 1
                yield pb.SnapshotReply(packed_blocks=[msgpack.packb(rows)]).SerializeToString()
                lo = hi
            start += len(refs)

    def _block_rows(self, holders: dict[int, list[SeqCopy]]) -> Iterator[BlockValues]:
        fenced = self._fenced()
        assert self.state.blocks is not None
        for block, (ref, touched, cached) in enumerate(self.state.blocks.rows()):
            yield self._block_row(block, ref, touched, cached, holders, fenced)

    def _block_row(self, block: int, ref: int, touched: float, cached: int, holders: dict[int, list[SeqCopy]],
                   fenced: set[int]) -> BlockValues:
        seqs = holders.get(block)
        if seqs:
            state, now = self.state, self.taken_at
            return (block, ref, touched, ",".join(sorted({s.state for s in seqs})),
                    max(state.heat(s, now) for s in seqs), [s.seq_id for s in seqs],
                    sorted({s.owner for s in seqs if s.running and s.owner}))
        return (block, ref, touched, "fenced" if block in fenced            # a reclaimed worker may still write it
                else UNNAMED_STATES[cached], 0.0, [], [])

    def _fenced(self) -> set[int]:
        return {block for pages in self.state.fences.values() for block in pages}

    def _seq_row(self, row: pb.SeqRow, s: SeqCopy) -> None:
        row.seq_id, row.session_id, row.state, row.owner = s.seq_id, s.session_id, s.state, s.owner
        row.num_committed, row.num_tokens, row.model = s.num_committed, s.num_tokens, s.model
        row.block_ids.extend(s.block_ids)
        row.last_access, row.heat = s.last_access, self.state.heat(s, self.taken_at)
        row.swapped_blocks = s.swapped_blocks
