"""memd's prefix cache and swap tier as KV events, in vLLM's wire format (`memd --kv-events tcp://HOST:PORT`).

Routers that route a request to where its prefix is cached (llm-d's KV-cache
indexer, Dynamo's KV router, SGLang's router, kvroute) subscribe to an
engine's KV events. memd owns the pages of every worker of its host, so one
publisher covers them all: a block here is reusable by any of them.

What is published, in vLLM's `KVEventBatch` of `BlockStored`, `BlockRemoved`
and `AllBlocksCleared`:
- medium "GPU": a full block joined the pool's prefix cache (its hash, its
  parent's, its token ids, its block size), or left it (its page was handed
  out for new content, or failed a check). "GPU" is vLLM's name for an
  engine's own KV cache, which its CPU build uses as well: here, memd's pool,
  on a GPU or in shared memory.
- medium "CPU": a sequence's full blocks reached the swap tier, or left it (a
  block two swapped sequences share is stored once, and removed with the
  last of them).
- `AllBlocksCleared` first, when memd starts: whatever a subscriber kept of an
  earlier memd is gone; the blocks memd recovered follow as `BlockStored`.

A block's hash is the prefix cache's own (keyed, per memd run), in vLLM's
int form, the digest's last 8 bytes, as vLLM's are its own: a subscriber
indexes the token ids and parent links the events carry (llm-d's indexer
does). The events of a change are sent once the change is committed: after
each Step, and after whatever else changes the cache (eviction, swap-outs),
within `FLUSH_S`; a flush announces at most `FLUSH_BLOCKS` blocks (and
`FLUSH_SEQS` sequences' swapped blocks), so the blocks a restarted memd
recovered go out over several flushes, parents first, without holding its
loop.

A block cached under a salt (a request's `cache_salt`, a tenant's name: see
`shared.tenants`) says so as vLLM's do, in `extra_keys`: the salt on the
first block of its chain, the one whose hash it enters; its children differ
through their parent. A router keys such a chain apart from the same tokens
unsalted, as memd does.

One memd serves several models (a namespace each): each batch holds one
model's events, sent under that model's topic (`DEFAULT_TOPIC`, llm-d's
`kv@<pod>@<model>`). The sequence numbers count the publisher's batches, every
model's: a subscriber of one model's topic sees the others' as gaps.

On the wire, as vLLM's ZmqEventPublisher: a PUB socket sending (topic,
8-byte big-endian sequence number, msgpack batch) and a ROUTER socket that
replays the batches still buffered from a sequence number on, then an end
marker (sequence number -1), to a subscriber that missed some.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from array import array
from collections import Counter, deque
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio

from memd.kv_state import KvState
from memd.sequences import TOKEN_BYTES, Sequence

log = structlog.get_logger("memd.kv_events")

FLUSH_S = 0.01                 # changes outside Steps (evictions, swap-outs) are sent within this
FLUSH_BLOCKS = 2_048           # pool blocks one batch announces at most (more wait for the next flush)
FLUSH_SEQS = 1_024             # sequences whose swap-tier blocks one batch looks at, at most
REPLAY_BATCHES = 10_000        # batches kept for replay, as vLLM's buffer_steps
HIGH_WATER_MARK = 100_000      # batches queued for slow subscribers before PUB drops them, as vLLM's
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
POOL_MEDIUM, SWAP_MEDIUM = "GPU", "CPU"
DEFAULT_TOPIC = "kv@{host}@{model}"    # llm-d's indexer reads the pod and the model from a topic of this form


def event_hash(digest: bytes) -> int:
    """vLLM's int form of a block hash: the last 8 bytes of the digest, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def _token_ids(chunk: bytes) -> list[int]:
    return array("I", chunk).tolist()


class _Stored:
    """One block to announce: its digest, its parent's (b"": none), its token bytes, its chain's salt."""

    __slots__ = ("digest", "parent", "salt", "tokens")

    def __init__(self, digest: bytes, parent: bytes, tokens: bytes, salt: str = "") -> None:
        self.digest, self.parent, self.tokens, self.salt = digest, parent, tokens, salt


class _Announced:
    """What the subscribers of one model's topic were told: the pool's cached blocks (by block), the swap tier's
    (by sequence, with a count per digest: a block two sequences share is announced once)."""

    __slots__ = ("pooled", "swap_count", "swapped")

    def __init__(self) -> None:
        self.pooled: dict[int, bytes] = {}
        self.swapped: dict[int, list[bytes]] = {}
        self.swap_count: Counter[bytes] = Counter()


class _Batches:
    """One flush's events, by model: each model's go out as a batch under its own topic."""

    def __init__(self) -> None:
        self.events: dict[str, list[dict[str, Any]]] = {}

    def add(self, model: str, events: list[dict[str, Any]]) -> None:
        if events:
            self.events.setdefault(model, []).extend(events)

    def add_changes(self, removed: dict[str, list[bytes]], stored: dict[str, list[_Stored]], medium: str) -> None:
        """Each model's removals and stores in `medium`. Removals first: a digest one sequence let go and another
        took in the same flush ends up stored."""
        for model in removed.keys() | stored.keys():
            self.add(model, _removed(removed.get(model, []), medium) + _stored(stored.get(model, []), medium))


class KvEvents:
    """The publisher: diffs what the pool's prefix cache and the swap tier hold against what it announced."""

    def __init__(self, manager: KvState, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = DEFAULT_TOPIC) -> None:
        self.manager, self.topic = manager, topic
        self.host = socket.gethostname()
        self.context = zmq.asyncio.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self.replay = self.context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)
            self.replay_endpoint = self.replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.next_seq = 0
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self.dropped = 0
        self.announced: dict[str, _Announced] = {}        # by model
        # At the first flush, every block the prefix cache holds (those memd recovered); later, those changed.
        self.blocks: set[int] = set(manager.pool.by_hash.values())
        self.seqs: set[int] = set(manager.seqs)
        manager.pool.watches.append(self.blocks)
        manager.watches.append(self.seqs)
        self.cleared = False
        self._tasks: list[asyncio.Task[None]] = []

    def topic_of(self, model: str) -> bytes:
        """The topic `model`'s batches go out under: --kv-events-topic with {host} and {model} filled in."""
        return self.topic.format(host=self.host, model=model).encode()

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._flushing(), name="kv-events"))
        if self.replay is not None:
            self._tasks.append(asyncio.create_task(self._replaying(), name="kv-events-replay"))
        log.info("publishing KV events", endpoint=self.endpoint, replay=self.replay_endpoint,
                 topic=self.topic.format(host=self.host, model="{model}"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        m = self.manager
        m.pool.watches[:] = [w for w in m.pool.watches if w is not self.blocks]
        m.watches[:] = [w for w in m.watches if w is not self.seqs]
        self.context.destroy(linger=0)

    async def _flushing(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)        # the period changes outside Steps wait for, at most
            self.flush()

    def after_step(self, _outcome: object) -> None:
        self.flush()

    # ---- what changed ---------------------------------------------------------------------------------

    def flush(self) -> None:
        """Announce what changed since the last flush: a batch per model that changed (none if nothing did)."""
        batches = _Batches()
        if not self.cleared:
            # Whatever a subscriber kept of an earlier memd is gone: said on every model's topic memd knows of.
            models = {seq.model for seq in self.manager.seqs.values()} or {""}
            for model in sorted(models):
                batches.add(model, [{"type": "AllBlocksCleared"}])
            self.cleared = True
        if self.blocks:
            self._pool_changes(batches)
        if self.seqs:
            self._swap_changes(batches)
        for model, events in batches.events.items():
            self._send(model, events)

    def _view(self, model: str) -> _Announced:
        view = self.announced.get(model)
        if view is None:
            view = self.announced[model] = _Announced()
        return view

    def _pool_changes(self, batches: _Batches) -> None:
        pool = self.manager.pool
        changed = self._next_blocks()
        removed: dict[str, list[bytes]] = {}
        stored: dict[str, list[_Stored]] = {}
        hash_of, tokens_of, origin_of, num_blocks = pool.hash_of, pool.tokens_of, pool.origin_of, pool.num_blocks
        views = self.announced
        for block in changed:
            if block >= num_blocks:
                continue                             # the free queue's sentinel
            new = hash_of[block]
            old, was = None, ""
            for model, view in views.items():        # a model or two: the one it was announced under
                if (old := view.pooled.get(block)) is not None:
                    was = model
                    break
            if old == new:
                continue                             # (a digest covers its model: the same one)
            if old is not None:
                removed.setdefault(was, []).append(old)
                del views[was].pooled[block]
            if new is not None:
                parent, model, salt = origin_of[block] or (b"", "", "")
                self._view(model).pooled[block] = new
                stored.setdefault(model, []).append(_Stored(new, parent, tokens_of[block] or b"", salt))
        batches.add_changes(removed, stored, POOL_MEDIUM)

    def _next_blocks(self) -> list[int]:
        """The changed blocks this batch announces: all of them, or (after a restart that recovered a host's
        worth of sessions, say) FLUSH_BLOCKS and the parents they need, the rest at the next flushes, so no
        one flush holds memd's loop for long. A block's parent still waiting goes first, in the same batch:
        subscribers always learn of a parent before its children."""
        pending = self.blocks
        if len(pending) <= FLUSH_BLOCKS:
            out = list(pending)
            pending.clear()
            return out
        out: list[int] = []
        while pending and len(out) < FLUSH_BLOCKS:
            chain = [pending.pop()]
            while (parent := self._waiting_parent(chain[-1])) is not None:
                pending.discard(parent)
                chain.append(parent)
            out += reversed(chain)
        return out

    def _waiting_parent(self, block: int) -> int | None:
        """The block of `block`'s cached parent, if it is still to be announced."""
        pool = self.manager.pool
        if block >= pool.num_blocks or pool.hash_of[block] is None or (origin := pool.origin_of[block]) is None:
            return None                          # the free queue's sentinel, or no prefix cached there
        parent = pool.by_hash.get(origin[0])
        return parent if parent is not None and parent in self.blocks else None

    def _swap_changes(self, batches: _Batches) -> None:
        seqs = self.manager.seqs
        if len(self.seqs) <= FLUSH_SEQS:
            changed = list(self.seqs)
            self.seqs.clear()
        else:
            changed = [self.seqs.pop() for _ in range(FLUSH_SEQS)]
        removed: dict[str, list[bytes]] = {}
        stored: dict[str, list[_Stored]] = {}
        for seq_id in changed:
            seq = seqs.get(seq_id)
            model = seq.model if seq is not None else \
                next((m for m, view in self.announced.items() if seq_id in view.swapped), None)
            if model is None:
                continue                             # gone, and nothing of it was announced
            view = self._view(model)
            old = view.swapped.pop(seq_id, [])
            new = _swapped_blocks(seq) if seq is not None else []
            if old == [s.digest for s in new]:
                if old:
                    view.swapped[seq_id] = old
                continue
            count = view.swap_count
            for digest in old:
                count[digest] -= 1
                if not count[digest]:
                    del count[digest]
                    removed.setdefault(model, []).append(digest)
            for block in new:
                count[block.digest] += 1
                if count[block.digest] == 1:
                    stored.setdefault(model, []).append(block)
            if new:
                view.swapped[seq_id] = [s.digest for s in new]
        batches.add_changes(removed, stored, SWAP_MEDIUM)

    # ---- the wire ---------------------------------------------------------------------------------------

    def _send(self, model: str, events: list[dict[str, Any]]) -> None:
        payload = msgpack.packb([time.time(), events, None], use_bin_type=True)
        seq, topic = self.next_seq, self.topic_of(model)
        self.next_seq += 1
        self.buffer.append((seq, topic, payload))
        try:
            self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1                    # no subscriber keeps up: it can replay what it missed

    async def _replaying(self) -> None:
        """Answer replay requests: [client id, b"", first sequence number (8 bytes, big-endian)]."""
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("a KV-event replay request of an unknown shape was ignored", frames=len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, topic, payload in list(self.buffer):
                if seq >= start:
                    await self.replay.send_multipart([client, b"", topic, seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([client, b"", b"", END_OF_REPLAY, b""])


def _removed(digests: list[bytes], medium: str) -> list[dict[str, Any]]:
    if not digests:
        return []
    return [{"type": "BlockRemoved", "block_hashes": [event_hash(d) for d in digests], "medium": medium}]


def _stored(blocks: list[_Stored], medium: str) -> list[dict[str, Any]]:
    """BlockStored events, parents before children, a chain of blocks in one event where they form one."""
    by_digest = {b.digest: b for b in blocks}
    ordered: list[_Stored] = []
    placed: set[bytes] = set()
    for block in blocks:
        chain = []
        while block.digest not in placed:
            chain.append(block)
            placed.add(block.digest)
            parent = by_digest.get(block.parent)
            if parent is None:
                break
            block = parent
        ordered += reversed(chain)
    events: list[dict[str, Any]] = []
    for block in ordered:
        size = len(block.tokens) // TOKEN_BYTES
        last = events[-1] if events else None
        if last is not None and last["_tail"] == block.parent and last["block_size"] == size:
            last["block_hashes"].append(event_hash(block.digest))
            last["token_ids"] += _token_ids(block.tokens)
            last["_tail"] = block.digest
            continue
        events.append({"type": "BlockStored", "block_hashes": [event_hash(block.digest)],
                       "parent_block_hash": event_hash(block.parent) if block.parent else None,
                       "token_ids": _token_ids(block.tokens), "block_size": size, "lora_id": None,
                       "medium": medium, "lora_name": None, "_tail": block.digest,
                       "_salt": block.salt if not block.parent else ""})
    for event in events:
        del event["_tail"]
        # As vLLM's: one entry per block, the salt (untagged) on the first block of a chain, the only one it
        # enters the hash of; left out when no block has one.
        if salt := event.pop("_salt"):
            event["extra_keys"] = [[salt]] + [None] * (len(event["block_hashes"]) - 1)
    return events


def _swapped_blocks(seq: Sequence) -> list[_Stored]:
    """A sequence's full blocks in the swap tier (none unless its pages are there)."""
    if not seq.slots:
        return []
    count = min(len(seq.slots), len(seq.hashes))
    raw, stride = seq.token_ids[:count * seq.block_size].tobytes(), seq.block_size * TOKEN_BYTES
    return [_Stored(seq.hashes[i], seq.hashes[i - 1] if i else b"", raw[i * stride:(i + 1) * stride], seq.salt)
            for i in range(count)]
