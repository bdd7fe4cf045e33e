"""memd's snapshot, taken on the loop and built off it in chunks: the rows are what the pool holds (no processes)."""

from __future__ import annotations

from memd.snapshot_view import CHUNK_ROWS
from shared.ops import Open, Park


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
