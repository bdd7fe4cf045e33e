"""A snapshot of memd's state as of one instant, streamed to memctl a chunk of rows at a time.

Building a million block rows in one go holds the loop for seconds, and
every worker's Step waits for them; building them on a thread instead still
makes Steps wait, for the thread's hold on the GIL. So the state is copied a
slice at a time between Steps (memd.state_copy: the copy is still of one
instant), and the rows are built from the copy and sent a chunk at a time,
each a reply message of its own on the stream: the loop serves Steps between
chunks, and memd never holds the whole reply.
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
NAMED_CHUNK_ROWS = 128      # of them at most, blocks sequences hold or fences name: each made in Python, not in C
SEQ_CHUNK_ROWS = 128        # sequence rows per reply message: each made in Python, as a named block is
UNNAMED_STATES = ("free", "cached")    # a block no sequence holds and no fence names, by whether it is cached
SEQS_SLICE = 64             # sequences indexed or filtered between two places a slice may end (Pacer.checkpoint)


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
                await pacer.checkpoint()
        pacer.held()
        if reply.sequences:
            yield reply.SerializeToString()

    async def _holders(self) -> Holders:
        holders = Holders(list(self.state.seqs.values()), self.state.num_blocks)
        pacer = state_copy.Pacer()
        for i, seq in enumerate(holders.seqs):
            holders.add(i, seq.block_ids)
            if i % SEQS_SLICE == 0:
                await pacer.checkpoint()
        for pages in self.state.fences.values():
            holders.fence(pages)
        return holders

    def _block_chunks(self, holders: Holders) -> Iterator[bytes]:
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

    def _packed_chunks(self, holders: Holders) -> Iterator[bytes]:
        """Packed parts of PACKED_CHUNK_ROWS blocks. The rows of blocks no sequence holds and no fence names
        (most of a pool) are zipped, in C, from the copy's arrays; only the others are made one by one."""
        blocks = self.state.blocks
        assert blocks is not None
        start = 0                                          # the first block of the copy's array
        for refs, touched, cached in zip(blocks.ref, blocks.last_access, blocks.cached, strict=True):
            lo = 0
            while lo < len(refs):
                hi = min(lo + PACKED_CHUNK_ROWS, len(refs))
                named = holders.named_in(start + lo, start + hi)
                if len(named) > NAMED_CHUNK_ROWS:          # at most NAMED_CHUNK_ROWS named blocks in a chunk
                    hi = named[NAMED_CHUNK_ROWS] - start
                    del named[NAMED_CHUNK_ROWS:]
                first, end = start + lo, start + hi
                rows: list[BlockValues] = list(zip(
                    range(first, end), refs[lo:hi].tolist(), touched[lo:hi].tolist(),
                    map(UNNAMED_STATES.__getitem__, cached[lo:hi]), itertools.repeat(0.0),
                    itertools.repeat(()), itertools.repeat(())))
                for block in named:
                    i = block - first
                    rows[i] = self._block_row(block, rows[i][1], rows[i][2], cached[lo + i], holders)
                yield pb.SnapshotReply(packed_blocks=[msgpack.packb(rows)]).SerializeToString()
                lo = hi
            start += len(refs)

    def _block_rows(self, holders: Holders) -> Iterator[BlockValues]:
        assert self.state.blocks is not None
        for block, (ref, touched, cached) in enumerate(self.state.blocks.rows()):
            yield self._block_row(block, ref, touched, cached, holders)

    def _block_row(self, block: int, ref: int, touched: float, cached: int, holders: Holders) -> BlockValues:
        seqs = holders.of(block)
        if seqs:
            state, now = self.state, self.taken_at
            return (block, ref, touched, ",".join(sorted({s.state for s in seqs})),
                    max(state.heat(s, now) for s in seqs), [s.seq_id for s in seqs],
                    sorted({s.owner for s in seqs if s.running and s.owner}))
        return (block, ref, touched, "fenced" if block in holders.fenced    # a reclaimed worker may still write it
                else UNNAMED_STATES[cached], 0.0, [], [])

    def _seq_row(self, row: pb.SeqRow, s: SeqCopy) -> None:
        row.seq_id, row.session_id, row.state, row.owner = s.seq_id, s.session_id, s.state, s.owner
        row.num_committed, row.num_tokens, row.model = s.num_committed, s.num_tokens, s.model
        row.block_ids.extend(s.block_ids)
        row.last_access, row.heat = s.last_access, self.state.heat(s, self.taken_at)
        row.swapped_blocks = s.swapped_blocks
        row.tenant = s.tenant
        row.retain_until = s.retain_until


class Holders:
    """Which sequences' tables name each block, and which blocks a fence names.

    Flat per-block arrays, not a dict of block -> sequences: a dict grows by
    rehashing itself whole, holding the loop for all of its entries at once,
    and its keys would have to be sorted to walk them in block order, another
    pass over every held block on the loop. Most blocks have one
    holder; the rest of a block's (a shared prefix's) are in `_more`.
    """

    __slots__ = ("_first", "_more", "fenced", "named", "seqs")

    def __init__(self, seqs: list[SeqCopy], num_blocks: int) -> None:
        self.seqs = seqs
        self._first = memoryview(bytearray(4 * num_blocks)).cast("i")  # 1 + index in seqs of its first holder
        self._more: dict[int, list[int]] = {}
        self.named = bytearray(num_blocks)         # 1: a sequence's table or a fence names the block
        self.fenced: set[int] = set()

    def add(self, index: int, blocks: Sequence[int]) -> None:
        """`seqs[index]` names `blocks` (one outside the pool is left out: it has no row)."""
        first, named, num_blocks = self._first, self.named, len(self.named)
        for block in blocks:
            if not 0 <= block < num_blocks:
                continue
            if first[block]:
                self._more.setdefault(block, []).append(index)
            else:
                first[block] = index + 1
            named[block] = 1

    def fence(self, pages: Sequence[int]) -> None:
        for block in pages:
            if 0 <= block < len(self.named):
                self.fenced.add(block)
                self.named[block] = 1

    def of(self, block: int) -> list[SeqCopy]:
        first = self._first[block]
        if not first:
            return []
        return [self.seqs[first - 1], *(self.seqs[i] for i in self._more.get(block, ()))]

    def named_in(self, first: int, end: int) -> list[int]:
        """The named blocks of [first, end), in order (picked out in C)."""
        return list(itertools.compress(range(first, end), self.named[first:end]))
