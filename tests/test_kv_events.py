"""memd's KV events, read by a consumer kvpool did not write: vLLM's own KVEventBatch decoder, in the vLLM venv
(tests/vllm_probe.py), subscribed as a router subscribes (SUB, then the replay socket for what it missed).

After chats (sessions over two turns, two sharing a system prompt), a swap-out, pressure that hands cached
pages out again, a drop and a session reset, the index the events build holds what memd holds: as many
blocks in the pool's prefix cache ("GPU") as memd counts there, the swapped sessions' full blocks ("CPU"), and
every block's token ids, followed up its parent links, are a prefix of a conversation that was sent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass, field

import pytest

from shared.client import MemdClient
from shared.launch import free_port_pair
from shared.ops import Free, Open, Park
from tests.test_vllm_metrics import PROBE, vllm_python

pytestmark = pytest.mark.processes

BS = 16
WAIT_S = 30.0


@dataclass
class Index:
    """What a router indexes from the events: (hash, medium) now held, and every block ever announced."""

    held: set[tuple[int, str]] = field(default_factory=set)
    blocks: dict[int, tuple[int | None, list[int]]] = field(default_factory=dict)   # hash -> (parent, tokens)
    batches: int = 0
    replayed: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    cleared: int = 0
    topic_of: dict[int, str] = field(default_factory=dict)        # hash -> the topic it was announced under
    salt_of: dict[int, str] = field(default_factory=dict)         # hash -> the salt in its extra_keys

    def apply(self, line: dict) -> None:
        if "replayed" in line:
            self.replayed.set()
            return
        self.batches += 1
        for event in line["events"]:
            if event["type"] == "BlockStored":
                hashes = event["block_hashes"]
                for digest, keys in zip(hashes, event.get("extra_keys") or [None] * len(hashes), strict=True):
                    self.topic_of[digest] = line["topic"]
                    if keys is not None:
                        self.salt_of[digest] = keys[0]
            if event["type"] == "AllBlocksCleared":
                self.held.clear()
                self.cleared += 1
            elif event["type"] == "BlockStored":
                parent, size, tokens = event["parent_block_hash"], event["block_size"], event["token_ids"]
                assert size == BS and len(tokens) == size * len(event["block_hashes"]), event
                for i, digest in enumerate(event["block_hashes"]):
                    self.blocks[digest] = (parent, tokens[i * size:(i + 1) * size])
                    self.held.add((digest, event["medium"]))
                    parent = digest
            elif event["type"] == "BlockRemoved":
                for digest in event["block_hashes"]:
                    assert (digest, event["medium"]) in self.held, (digest, event)
                    self.held.discard((digest, event["medium"]))
        self.changed.set()

    def count(self, medium: str) -> int:
        return sum(1 for _, m in self.held if m == medium)

    def history(self, digest: int) -> list[int]:
        """The token ids from the chain's first block to this one, by parent links."""
        parent, tokens = self.blocks[digest]
        return (self.history(parent) if parent is not None else []) + tokens


async def read(stream: asyncio.StreamReader, index: Index) -> None:
    while line := await stream.readline():
        index.apply(json.loads(line))


async def holds(index: Index, memd, sent: list[list[int]], swapped: int) -> None:
    """Wait (for batches, not for time) until the index holds what memd says it holds, then check its content."""
    async with memd.admin() as admin:
        while True:
            index.changed.clear()                # before reading memd: a batch after it sets it again
            pooled = (await admin.stats()).prefix_blocks
            if (index.count("GPU"), index.count("CPU")) == (pooled, swapped):
                break
            try:
                await asyncio.wait_for(index.changed.wait(), WAIT_S)
            except TimeoutError:
                pytest.fail(f"the events hold {index.count('GPU')} pool and {index.count('CPU')} swap-tier "
                            f"blocks; memd holds {pooled} and {swapped}")
    for digest, _ in index.held:
        history = index.history(digest)
        assert any(conversation[:len(history)] == history for conversation in sent), history[:8]


async def test_vllms_decoder_indexes_memds_events_to_what_memd_holds(memd_factory):
    port = free_port_pair()
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "256KiB", "--block-bytes", "4KiB",
                              "--swap-ratio", "1.0", "--kv-events", f"tcp://127.0.0.1:{port}")
    probe = await asyncio.create_subprocess_exec(
        str(vllm_python()), str(PROBE), "events", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    index = Index()
    reader = asyncio.create_task(read(probe.stdout, index))
    try:
        await asyncio.wait_for(index.replayed.wait(), 120)        # the probe imports vLLM first
        assert index.cleared == 1                                  # memd's first batch: forget any earlier memd
        sent: list[list[int]] = []
        system = list(range(500, 532))                             # two whole blocks two sessions share
        async with await MemdClient.attach(memd.address, block_size=BS, map_memory=False) as client:
            # A chat: three sessions over two turns; "b" and "c" share a system prompt.
            for name, first in (("a", [7] * 40), ("b", system + [1] * 8), ("c", system + [2] * 8)):
                opened, = await client.step(Open(first, reserve=1, session_id=name))
                await client.step(Park(opened.seq_id, commit_to=len(first)))
                turn = [3] * 24
                again, = await client.step(Open(turn, reserve=1, session_id=name, continue_session=True))
                await client.step(Park(again.seq_id, commit_to=len(first) + len(turn)))
                sent.append(first + turn)
            await holds(index, memd, sent, swapped=0)
            assert index.count("GPU") == 4 + 4 + 2                 # 64 tokens each; the system prompt once

            async with memd.admin() as admin:
                await admin.evict(session_id="a", mode="swap")    # a swap-out: its 4 full blocks in the tier
                await holds(index, memd, sent, swapped=4)
                await admin.evict(session_id="b", mode="drop")    # a drop: pages free, still cached
                await holds(index, memd, sent, swapped=4)

            # Pressure: new prompts that take every page, so cached blocks are handed out again.
            async with memd.admin() as admin:
                total = (await admin.stats()).total_blocks
            for k in range(3):
                prompt = [10_000 + 100 * k + i for i in range(BS * (total // 3))]
                opened, = await client.step(Open(prompt, reserve=1))
                await client.step(Free(opened.seq_id, commit_to=len(prompt)))
                sent.append(prompt)
            await holds(index, memd, sent, swapped=4)
            assert index.count("GPU") < 10 + 3 * (total // 3)      # some were removed: their pages reused

            await client.step(Free(session_id="a"))                # a reset of the swapped session
            await holds(index, memd, sent, swapped=0)

        # Another model on the same pool, salted (a tenant's cache): its own topic, the salt on its chain's root.
        async with await MemdClient.attach(memd.address, model="other", block_size=BS, map_memory=False) as other:
            opened, = await other.step(Open(system + [4] * 8, reserve=1, cache_salt="tenant:t1"))
            await other.step(Park(opened.seq_id, commit_to=40))
            sent.append(system + [4] * 8)
            await holds(index, memd, sent, swapped=0)
        host = socket.gethostname()
        theirs = [d for d, topic in index.topic_of.items() if topic == f"kv@{host}@other" and (d, "GPU") in index.held]
        assert len(theirs) == 2                                    # the system prompt's two blocks, stored again
        root, child = sorted(theirs, key=lambda d: index.blocks[d][0] is not None)
        assert index.salt_of.get(root) == "tenant:t1" and child not in index.salt_of
        assert index.blocks[child][0] == root
        assert {topic for d, topic in index.topic_of.items() if d not in theirs} == {f"kv@{host}@default"}
    finally:
        probe.kill()
        await probe.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
