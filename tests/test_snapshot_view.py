"""memd's snapshot, copied between Steps and streamed in parts: the rows are what the pool holds (no processes)."""

from __future__ import annotations

import dataclasses

import msgpack

from memd import snapshots, views
from memd.snapshot_view import CHUNK_ROWS, NAMED_CHUNK_ROWS, PACKED_CHUNK_ROWS, SnapshotView
from shared.ops import Free, Open, Park
from shared.rpc import memd_pb2 as pb


async def test_a_snapshot_of_more_blocks_than_a_chunk_shows_every_block_and_sequence_as_they_are(local_memd_factory):
    memd = await local_memd_factory("--device", "cpu", "--pool-bytes", "6MiB", "--block-bytes", "1KiB",
                                    "--state-dir", "none")
    client = await memd.attach(block_size=16)
    running, parked = await client.step(Open(list(range(100)), reserve=1),
                                        Open(list(range(500, 564)), reserve=1, session_id="chat"))
    await client.step(Park(parked.seq_id, commit_to=64))
    async with memd.admin() as admin:
        whole = await admin.snapshot()
        only_parked = await admin.snapshot(state="parked")
        no_blocks = await admin.snapshot(blocks=False)
    assert len(whole.blocks) == client.geometry.num_blocks > 2 * CHUNK_ROWS
    assert [row.block_id for row in whole.blocks] == list(range(client.geometry.num_blocks))
    seqs = {s.seq_id: s for s in whole.sequences}
    assert seqs[running.seq_id].state == "running" and seqs[parked.seq_id].state == "parked"
    assert seqs[parked.seq_id].session_id == "chat" and seqs[parked.seq_id].num_committed == 64
    for seq in whole.sequences:
        for block in seq.block_ids:
            row = whole.blocks[block]
            assert list(row.seq_ids) == [seq.seq_id] and row.state == seq.state and row.ref_count == 1
    held = {b for s in whole.sequences for b in s.block_ids}
    assert all(row.state == "free" and row.ref_count == 0 for row in whole.blocks if row.block_id not in held)
    assert next(row.owners for row in whole.blocks if row.block_id in seqs[running.seq_id].block_ids) == \
        [client.worker_id]
    assert [s.seq_id for s in only_parked.sequences] == [parked.seq_id] and len(only_parked.blocks) == len(whole.blocks)
    assert not no_blocks.blocks and len(no_blocks.sequences) == 2 and no_blocks.workers[0].worker_id == client.worker_id


async def test_the_streamed_parts_merge_into_the_whole_reply_and_the_view_stays_as_it_was_taken(local_memd_factory):
    memd = await local_memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--block-bytes", "1KiB",
                                    "--state-dir", "none")
    client = await memd.attach(block_size=16)
    shared = list(range(1000, 1032))                  # two full blocks every sequence below shares
    first = (await client.step(Open(shared + [0], reserve=1, session_id="first")))[0]
    await client.step(Park(first.seq_id, commit_to=33))          # its full blocks enter the prefix cache
    opened = await client.step(*[Open(shared + [i], reserve=1) for i in range(1, CHUNK_ROWS + 100)])
    manager = memd.parts.manager
    view = await SnapshotView.take(manager, pb.SnapshotRequest(), lambda: [pb.WorkerRow(worker_id=client.worker_id)],
                                   7)
    parts = [part async for part in view.replies()]
    await client.step(*[Free(r.seq_id) for r in opened])          # the pool changes after the view was taken
    assert [part async for part in view.replies()] == parts
    assert len(parts) > 3                                         # header, block chunks, sequence chunks

    reply = pb.SnapshotReply()
    for part in parts:
        reply.MergeFromString(part)
    assert len(reply.sequences) == CHUNK_ROWS + 100 > CHUNK_ROWS
    assert reply.generation == 7 and reply.block_bytes == 1024 and reply.taken_at == view.taken_at
    assert [w.worker_id for w in reply.workers] == [client.worker_id]
    shared_rows = [row for row in reply.blocks if len(row.seq_ids) > 1]
    assert len(shared_rows) == 2 and all(row.ref_count == CHUNK_ROWS + 100 for row in shared_rows)
    assert {row.state for row in shared_rows} == {"parked,running"}


async def test_packed_blocks_read_back_as_the_same_rows_in_every_format(local_memd_factory):
    memd = await local_memd_factory("--device", "cpu", "--pool-bytes", "10MiB", "--block-bytes", "1KiB",
                                    "--state-dir", "none")         # several of the copy's slices and packed parts
    client = await memd.attach(block_size=16)
    _, parked, freed = await client.step(Open(list(range(100)), reserve=1),
                                         Open(list(range(500, 564)), reserve=1, session_id="chat"),
                                         Open(list(range(900, 948)), reserve=1))
    await client.step(Park(parked.seq_id, commit_to=64), Free(freed.seq_id, commit_to=48))   # its blocks: cached
    spread = await client.step(*[Open(list(range(10_000 * (i + 1), 10_000 * (i + 1) + 2_000)), reserve=1)
                                 for i in range(40)])             # held blocks in more than one packed part
    assert max(b for r in spread for b in r.block_ids) > PACKED_CHUNK_ROWS
    view = await SnapshotView.take(memd.parts.manager, pb.SnapshotRequest(), lambda: [], 1)

    async def reply(packed: bool) -> pb.SnapshotReply:             # of the same instant, either way
        out = pb.SnapshotReply()
        async for part in dataclasses.replace(view, request=pb.SnapshotRequest(packed_blocks=packed)).replies():
            out.MergeFromString(part)
        return out

    rows, packed = await reply(False), await reply(True)
    assert not packed.blocks and len(packed.packed_blocks) > 2 and len(rows.blocks) > 2 * PACKED_CHUNK_ROWS
    # a part holds at most NAMED_CHUNK_ROWS held blocks (each made in Python), so the held ones make more parts
    held_per_part = [sum(1 for row in msgpack.unpackb(part) if row[5]) for part in packed.packed_blocks]
    assert max(held_per_part) == NAMED_CHUNK_ROWS and sum(held_per_part) > 2 * NAMED_CHUNK_ROWS
    assert {row.state for row in rows.blocks} >= {"running", "parked", "cached", "free"}
    assert any(row.heat > 0 for row in rows.blocks)
    for fmt in ("json", "msgpack"):
        assert snapshots.encode(snapshots.document(packed), fmt) == snapshots.encode(snapshots.document(rows), fmt)
    assert views.snapshot_csv(packed) == views.snapshot_csv(rows)
    async with memd.admin() as admin:                              # and memctl's way of asking for it
        assert len(snapshots.block_rows(await admin.snapshot(packed=True))) == client.geometry.num_blocks
