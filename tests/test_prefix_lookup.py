"""memd's read-only Lookup (real memd): what an Open would share now, checksummed, without changing anything;
and an Open's result names the checksums of the blocks it shared, for a reader that checks them."""

from __future__ import annotations

import grpc
import pytest

from shared.client import MemdClient
from shared.ops import Extend, Free, Open
from shared.rpc import memd_pb2 as pb

BS = 16
PROMPT = list(range(100, 150))          # 50 tokens: 3 full blocks, the last token's block partly filled
SUMS = [0x1111, 0x2222, 0x3333]


async def _cache(client: MemdClient, tokens: list[int], sums: list[int], salt: str | None = None) -> None:
    """A sequence that commits `tokens`' full blocks with `sums` (0: that page has none), then is freed."""
    opened, = await client.step(Open(tokens, cache_salt=salt))
    full = len(tokens) // BS * BS
    await client.step(Extend(opened.seq_id, commit_to=full, sums_from=0, page_sums=[s for s in sums if s]),
                      Free(opened.seq_id))


async def _state(memd) -> tuple:
    """What a lookup must leave as it was: the pool's counts and counters, every block's references, access time
    and heat."""
    async with memd.admin() as admin:
        stats, snap = await admin.stats(), await admin.snapshot()
    counters = dict(stats.counters)
    return (stats.free_blocks, stats.cached_blocks, counters,
            [(b.block_id, b.ref_count, b.last_access, b.heat) for b in snap.blocks])


async def test_lookup_counts_checksummed_leading_blocks_and_changes_nothing(memd):
    async with await MemdClient.attach(memd.address, model="m", block_size=BS) as writer, \
            await MemdClient.attach(memd.address, model="m", block_size=BS) as reader, \
            await MemdClient.attach(memd.address, model="other", block_size=BS) as stranger:
        await _cache(writer, PROMPT, SUMS)
        await _cache(writer, PROMPT, SUMS, salt="tenant:acme")
        before = await _state(memd)
        queries = [(PROMPT, ""), (PROMPT[:33], ""), (PROMPT[:48], ""), (PROMPT + [7] * 40, ""),
                   ([1] + PROMPT[1:], ""), (PROMPT, "tenant:acme"), (PROMPT, "tenant:other"), ([], "")]
        assert await reader.lookup(queries) == [3, 2, 2, 3, 0, 3, 0, 0]
        assert await reader.lookup(queries) == [3, 2, 2, 3, 0, 3, 0, 0]        # asked again: the same
        assert await stranger.lookup([(PROMPT, "")]) == [0]                       # another model's cache
        assert await _state(memd) == before

        opened, = await reader.step(Open(PROMPT))                                  # what the lookup promised
        assert opened.num_cached == 3 * BS and opened.cached_sums == SUMS
        await reader.step(Free(opened.seq_id))


async def test_lookup_stops_at_a_page_without_a_checksum(memd):
    """A page no one can check is never offered to a reader that checks before it loads."""
    async with await MemdClient.attach(memd.address, model="m", block_size=BS) as client:
        opened, = await client.step(Open(PROMPT))
        await client.step(Extend(opened.seq_id, commit_to=48, sums_from=0, page_sums=SUMS[:1]), Free(opened.seq_id))
        assert await client.lookup([(PROMPT, "")]) == [1]
        shared, = await client.step(Open(PROMPT))          # an Open shares all three, and says which it can check
        assert shared.num_cached == 48 and shared.cached_sums == [SUMS[0], 0, 0]
        await client.step(Free(shared.seq_id))


@pytest.mark.parametrize(("query", "words"), [
    (pb.LookupQuery(token_ids=b"\x01\x02\x03\x04\x05"), "query 0: token ids of 5 bytes"),
    (pb.LookupQuery(token_ids=b"\x01\x00\x00\x00", cache_salt="a\0b"), "query 0: a cache salt"),
])
async def test_a_bad_lookup_is_refused_whole(memd, query, words):
    async with await MemdClient.attach(memd.address, model="m", block_size=BS) as client:
        request = pb.LookupRequest(worker_id=client.worker_id, lease=client._lease, queries=[query])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client._stub.Lookup(request, metadata=client._metadata)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()


async def test_a_lookup_needs_a_live_attachment_s_lease(memd):
    async with await MemdClient.attach(memd.address, model="m", block_size=BS) as client, \
            await MemdClient.attach(memd.address, model="m", block_size=BS) as gone:
        wrong = pb.LookupRequest(worker_id=client.worker_id, lease=b"not the lease",
                                 queries=[pb.LookupQuery(token_ids=b"")])
        await gone.close()
        detached = pb.LookupRequest(worker_id=gone.worker_id, lease=gone._lease, queries=[pb.LookupQuery()])
        for request, code in ((wrong, grpc.StatusCode.PERMISSION_DENIED),
                              (detached, grpc.StatusCode.FAILED_PRECONDITION)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client._stub.Lookup(request, metadata=client._metadata)
            assert refused.value.code() == code
