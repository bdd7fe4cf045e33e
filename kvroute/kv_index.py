"""Which blocks each host's pool holds, from the KV events its memd publishes (`kvroute --kv-events`).

A subscriber per memd reads its batches (memd.kv_events, vLLM's format: a
SUB socket, and the replay socket for what it missed: from the start, and
after any gap in the sequence numbers) and keeps an index of the pool's
prefix cache. The events name blocks by memd's own hashes, keyed and new on
every memd run, so the index keys blocks by a chain of its own over the token
ids the events carry, parent first, as llm-d's indexer does: the same tokens
after the same prefix are the same key on every host, and a request's prompt
is keyed the same way (`keys`). Only the pool ("GPU") counts: blocks in the
swap tier serve only their own session, which its directory entry routes.

A pool holds several models' caches, and a model's cache is split by salt
(a request's `cache_salt`, a tenant's name): memd sends each model's batches
under its own topic (`kv@<host>@<model>`, llm-d's form) and a salted chain's
first block carries its salt in `extra_keys`, as vLLM's do. So there is an
index per model, and a salted chain starts from a key of its salt: a prompt
is matched only against the blocks its model and salt would reuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio

from shared.kv_event_endpoints import replay_beside, tcp_host_port

log = structlog.get_logger("kvroute.kv_index")

POOL_MEDIUM = "GPU"
RETRY_S = 1.0                   # a replay that did not answer is asked again after this


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The index's key of a block: its parent's key and its token ids (b"" for a chain's first block)."""
    return hashlib.blake2b(parent + array("I", tokens).tobytes(), digest_size=16).digest()


def root_key(salt: str) -> bytes:
    """The parent key of a chain's first block: b"" unsalted, else one of the salt's own."""
    return hashlib.blake2b(b"salt\0" + salt.encode(), digest_size=16).digest() if salt else b""


def keys(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[bytes]:
    """The keys of a prompt's full blocks, in order, as cached under `salt`."""
    out, parent = [], root_key(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out


@dataclass
class PoolIndex:
    """One pool's prefix cache: its blocks' keys (by memd's hash), how many of memd's hashes hold each key."""

    key_of: dict[int, bytes] = field(default_factory=dict)
    held: Counter[bytes] = field(default_factory=Counter)
    block_size: int = 0

    def apply(self, events: list[Any]) -> None:
        for event in events:
            if not isinstance(event, dict):
                continue
            kind = event.get("type")
            if kind == "AllBlocksCleared":
                self.key_of.clear()
                self.held.clear()
            elif event.get("medium") != POOL_MEDIUM:
                continue
            elif kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                for digest in event.get("block_hashes") or ():
                    key = self.key_of.pop(digest, None)
                    if key is not None:
                        self.held[key] -= 1
                        if self.held[key] <= 0:
                            del self.held[key]

    def _stored(self, event: dict[str, Any]) -> None:
        size, tokens = event.get("block_size") or 0, event.get("token_ids") or []
        parent_hash = event.get("parent_block_hash")
        parent = root_key(_salt(event.get("extra_keys"))) if parent_hash is None else self.key_of.get(parent_hash)
        if parent is None or size <= 0:
            return                               # its parent left before it came: no prompt can reach it
        self.block_size = size
        for i, digest in enumerate(event.get("block_hashes") or ()):
            parent = chain_key(parent, tokens[i * size:(i + 1) * size])
            if self.key_of.get(digest) != parent:
                self.key_of[digest] = parent
                self.held[parent] += 1

    def matched(self, prompt_keys: list[bytes]) -> int:
        """How many of a prompt's leading full blocks this pool holds."""
        count = 0
        for key in prompt_keys:
            if key not in self.held:
                break
            count += 1
        return count


def _salt(extra_keys: Any) -> str:
    """The salt a chain's first block names in its extra keys (vLLM's: untagged, the salt its one string after
    a LoRA name); "" if none."""
    first = extra_keys[0] if isinstance(extra_keys, list | tuple) and extra_keys else None
    if not isinstance(first, list | tuple):
        return ""
    return next((key for key in reversed(first) if isinstance(key, str)), "")


def model_of(topic: bytes) -> str:
    """The model a batch's topic names (`kv@<host>@<model>`); "" for a topic of another form (one index)."""
    parts = topic.decode(errors="replace").split("@", 2)
    return parts[2] if len(parts) == 3 and parts[0] == "kv" else ""


@dataclass(eq=False)
class EventSource:
    """One memd's events and the workers that draw from its pool."""

    endpoint: str
    replay: str
    workers: list[str]
    indexes: dict[str, PoolIndex] = field(default_factory=dict)      # by model ("": a topic naming none)
    last_seq: int = -1
    batches: int = 0
    gaps: int = 0

    async def run(self, context: zmq.asyncio.Context) -> None:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        try:
            await self._catch_up(context)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq <= self.last_seq and seq != 0:
                    continue                         # the replay gave it already
                if (seq == 0 and self.last_seq >= 0) or seq > self.last_seq + 1:
                    # A new memd (its numbers start again) or batches missed: what is buffered, from the start.
                    self.gaps += 1
                    if seq == 0:
                        self.last_seq = -1
                        self.indexes.clear()             # the new one says what it holds, model by model
                    await self._catch_up(context)
                    if seq <= self.last_seq:
                        continue
                self._take(seq, frames[0], frames[2])
        finally:
            sub.close()

    async def _catch_up(self, context: zmq.asyncio.Context) -> None:
        """Ask the replay socket for every batch after the last one taken, until its end marker."""
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay)
        try:
            while True:
                await dealer.send_multipart([b"", (self.last_seq + 1).to_bytes(8, "big")])
                try:
                    while True:
                        frames = await asyncio.wait_for(dealer.recv_multipart(), RETRY_S)
                        if len(frames) != 4:
                            continue
                        seq = int.from_bytes(frames[2], "big", signed=True)
                        if seq < 0:
                            return
                        if seq > self.last_seq:
                            self._take(seq, frames[1], frames[3])
                except TimeoutError:
                    log.info("memd's KV-event replay does not answer yet", replay=self.replay)
        finally:
            dealer.close()

    def index(self, model: str) -> PoolIndex | None:
        """`model`'s blocks in this pool (those of a topic naming no model, if that is how memd sends them)."""
        return self.indexes.get(model) or self.indexes.get("")

    def _take(self, seq: int, topic: bytes, payload: bytes) -> None:
        with contextlib.suppress(ValueError, msgpack.UnpackException, TypeError):
            batch = msgpack.unpackb(payload, raw=False)
            if isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list):
                model = model_of(topic)
                index = self.indexes.get(model)
                if index is None:
                    index = self.indexes[model] = PoolIndex()
                index.apply(batch[1])
        self.last_seq = seq
        self.batches += 1


def parse_source(text: str, workers: list[str]) -> EventSource:
    """`tcp://HOST:PORT[=URL,URL...]`: a memd's KV events and the workers on its pool (by default those whose
    URL names the same host). The replay socket is the next port, as memd opens it by default."""
    endpoint, _, named = text.partition("=")
    found, replay = tcp_host_port(endpoint), replay_beside(endpoint)
    if found is None or replay is None:
        raise ValueError(f"expected tcp://HOST:PORT[=WORKER_URL,...], not {text!r}")
    host = found[0]
    urls = [u.rstrip("/") for u in named.split(",") if u] if named else \
        [w for w in workers if w.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]") == host.strip("[]")]
    unknown = [u for u in urls if u not in workers]
    if unknown or not urls:
        raise ValueError(f"--kv-events {text}: " + (f"{', '.join(unknown)} is not a --worker" if unknown else
                                                     "no --worker on that host: name them (=URL,URL)"))
    return EventSource(endpoint, replay, urls)
