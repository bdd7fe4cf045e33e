"""A read-only prefix-cache lookup: how much of a prompt an Open would share now, asked without opening.

An engine that schedules on its own and keeps its own KV cache (vLLM,
through its connector API) asks before it allocates how many of a
prompt's tokens an external store can supply, and may ask again on
every scheduler pass until the request runs. The answer must cost memd
nothing it keeps: no sequence, no reference, no heat, no counter. So this
walks the same chain of block hashes an Open walks (the worker's model,
the salt, the tokens), stops at the first block the pool does not hold,
and counts only blocks whose page has a checksum: a page no one can check
is never handed to a reader that checks before it loads. The engine then
takes the pages in its next Step, which may share fewer (a block evicted
in between): it loads what that Open shared and recomputes the rest.
"""

from __future__ import annotations

from array import array

from memd.errors import InvalidArgument
from memd.kv_state import Worker
from memd.manager import KvManager
from memd.sequences import check_salt, prefix_space, shareable_blocks
from shared.packed_steps import unpacked_token_ids
from shared.protobuf_codec import WireError

MAX_QUERIES = 4096          # prompts in one Lookup: an engine asks for what it may schedule next, a batch at most


def cached_blocks(manager: KvManager, worker: Worker, token_ids: array[int], salt: str) -> int:
    """Leading full blocks of `token_ids` in `worker`'s model's prefix cache (salted), each with a checksum,
    up to the block before the last token's."""
    bs, pool, found = worker.block_size, manager.pool, 0
    for _, block in pool.cached_run(manager.hasher.walk(prefix_space(worker.model, salt), token_ids, bs, 0, b"",
                                                        shareable_blocks(len(token_ids), bs))):
        if not pool.checksum[block]:
            break
        found += 1
    return found


def lookups(manager: KvManager, worker: Worker, queries: list[tuple[bytes, str]]) -> list[int]:
    """`cached_blocks` of each (packed token ids, salt); InvalidArgument, and nothing answered, if one is bad."""
    if len(queries) > MAX_QUERIES:
        raise InvalidArgument(f"{len(queries)} queries in one Lookup; at most {MAX_QUERIES}")
    read = []
    for index, (packed, salt) in enumerate(queries):
        try:
            token_ids = unpacked_token_ids(packed)
            check_salt(salt)
        except (WireError, InvalidArgument) as exc:
            raise InvalidArgument(f"query {index}: {exc}") from None
        read.append((token_ids, salt))
    return [cached_blocks(manager, worker, token_ids, salt) for token_ids, salt in read]
