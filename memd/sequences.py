"""Sequences, their block tables and the content hashes of their full blocks.

A block table is a two-level index: a dict from sequence id to a compact
list of the block ids the sequence holds, block i holding tokens
[i*bs, (i+1)*bs). Finding a token's page is one dict lookup and one list
index (`locate`), and a table costs only the blocks in use.
Token ids are the sequence's history; the first `num_committed` of them have
their K/V written in the blocks. Tokens past that are known but not yet
written (a sampled token, or the history of a dropped sequence) and are
recomputed by whichever worker resumes it.

Under memory pressure a PARKED sequence loses its pages in one of two ways:
swapped out (its pages copied to slots of the host swap tier: a resume copies
them back, nothing is recomputed) or dropped (only the token ids stay: a
resume recomputes, helped by whatever prefix blocks are still cached).

States, and what moves a sequence from one to another:

          Open, or Fork (a child of a RUNNING sequence)
            |
            v
   +---> RUNNING <------------------+----------------------------+
   |        |                       |                            |
   | Resume | Park (end of turn,    | Resume (its pages copied   | Resume (recompute;
   |        | or preempt);          | back into fresh ones)      | still-cached prefix
   |        | worker reclaimed [1]  |                            | blocks are shared)
   |        v                       |                            |
   +---- PARKED -----------------> SWAPPED -----------------> DROPPED
            |     swap-out [2]                drop [3]           ^
            |                                                    |
            +------------------------ drop [3] ------------------+

   Free, in any state (a RUNNING one only by its worker): the sequence is
   gone. So is a DROPPED one without a session, after the idle TTL.
   [1] Its lease expired, its stream broke, or it said goodbye: the
       sequence is parked at its committed tokens (its whole blocks, when
       the worker may still write) and marked interrupted; those it had
       preempted keep their state and are marked too. A sequence without a
       session is freed instead: only that worker knew its id. A restarted
       memd parks what was RUNNING the same way (memd.recovery).
   [2] memd.eviction, under pressure, for a preempting Park or for
       `memctl evict`. The sequence is SWAPPED once the copy is done; a
       Resume, Free or drop before that calls the swap-out off (`SwapOut`).
   [3] memd.eviction: an eviction that swap cannot take (swap off, or full
       of hotter sequences), the idle TTL, `memctl evict --drop`, or room in
       a full swap tier for a hotter swap-out. A restarted memd drops what it
       cannot reopen.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from memd.errors import InvalidArgument, PositionError

TOKEN_BYTES = array("I").itemsize              # a token id's bytes in a history and in `token_bytes`


class SeqState(StrEnum):
    RUNNING = "running"   # owned by one worker, never evicted by policy
    PARKED = "parked"     # between turns: owned by memd, resumable by any worker of its model
    SWAPPED = "swapped"   # pages copied to the host swap tier; a resume copies them back
    DROPPED = "dropped"   # pages released; token ids kept so a resume recomputes


@dataclass(slots=True)
class Sequence:
    seq_id: int
    model: str
    block_size: int
    owner: int | None                  # worker id; None once memd owns it
    state: SeqState
    block_ids: list[int]
    num_committed: int
    # uint32 in an array, not a list of ints: a list's every item is visited by each full garbage
    # collection, on memd's loop, so parked sessions' token ids would make each one walk every token held.
    token_ids: array[int]
    hashes: list[bytes] = field(default_factory=list)   # of the leading full committed blocks
    session_id: str | None = None
    last_access: float = 0.0
    heat: float = 0.0
    heat_at: float = 0.0
    slots: list[int] = field(default_factory=list)      # swap slots of its pages, in block order (SWAPPED)
    preempted_by: int | None = None     # the worker that preempted it and waits to resume it (a drain waits too)
    turn_start: int = 0                 # tokens of history before the turn now running (or last run) began
    interrupted: bool = False           # that turn never ended: its worker died, or memd did
    turn_id: str = ""                   # the client's name for that turn: sent again, it replaces the turn
    salt: str = ""                      # its prefix-cache namespace within its model (Open.cache_salt)
    tenant: str = ""                    # whose it is (Open.tenant): "" for no tenant
    retain_until: float = 0.0           # wall-clock time its retention promise ends (Open.retain_s; memd.retention)

    @property
    def prefix_space(self) -> str:
        """What its blocks' hashes and cluster keys cover beside their tokens: the model, and the salt if any."""
        return prefix_space(self.model, self.salt)

    @property
    def num_full_blocks(self) -> int:
        return self.num_committed // self.block_size

    @property
    def capacity(self) -> int:
        """Tokens the block table has slots for."""
        return len(self.block_ids) * self.block_size


class CopyTicket:
    """Whether a queued copy may still start, and, once it has, the flag that asks it to stop.

    The copy thread and memd's loop race for it under a lock: exactly one of
    `begin` (the copy starts) and `call_off` before it (the copy never runs)
    wins, so the loop knows whether a called-off copy's slots are its own again.
    """

    __slots__ = ("_lock", "_started", "halt")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self.halt = threading.Event()     # set: the copy stops at its next chunk (or skips its delay)

    def begin(self) -> bool:
        """On the copy's thread: False if the copy was called off before it could start."""
        with self._lock:
            if self.halt.is_set():
                return False
            self._started = True
            return True

    @property
    def started(self) -> bool:
        return self._started

    def call_off(self) -> bool:
        """On the loop: stop the copy; True if it never started (and now never will)."""
        with self._lock:
            self.halt.set()
            return not self._started


@dataclass(slots=True, eq=False)
class SwapOut:
    """A swap-out in flight: the pages still belong to the (PARKED) sequence, the slots to the copy.

    Until the copy is done the pages stay referenced, so nobody is handed a
    page that is still being read. A resume, free or drop meanwhile calls the
    job off (`KvManager.call_off`): the sequence keeps its pages, and the
    copy's slots go back at once if it had not started, else as soon as it
    stops, which it does within one chunk; whatever called it off answers
    only then (`StepRunner.settle`), so a client that reads `stats` after a
    reset sees every slot back.
    """

    seq: Sequence
    blocks: list[int]
    slots: list[int]
    reason: EvictionReason | None      # None for a worker's own preemption
    blocks_freed: int = 0              # set when the copy is done and the pages are released
    checksums: list[int] = field(default_factory=list)   # of the slots, once the copy is done
    ticket: CopyTicket = field(default_factory=CopyTicket)
    slots_back: bool = False           # the slots went back to the free stack (a copy called off, or failed)


class EvictionReason(StrEnum):
    """Why memd took a sequence's pages (a worker's own preemption has none)."""

    IDLE = "idle"              # untouched for the idle TTL
    PRESSURE = "pressure"      # a Step, a waiting worker or the free-block watermark needed the pages
    FORCED = "forced"          # an operator's memctl evict
    QUOTA = "quota"            # its tenant or model held more than its max pages (memd.quotas)

    @property
    def counter(self) -> str:
        """Its key in memd's counters (Stats, metrics): evictions_<reason>."""
        return f"evictions_{self.value}"


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)          # in ints: exact at any size


def shareable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt that may come from the prefix cache: all but the one holding its last token,
    which is always computed (its logits are what the worker needs)."""
    return (num_tokens - 1) // block_size if num_tokens else 0


def locate(seq: Sequence, pos: int) -> tuple[int, int]:
    """Block id and offset of token `pos`; positions are never negative."""
    if not 0 <= pos < seq.num_committed:
        raise PositionError(seq.seq_id, pos, seq.num_committed)
    return seq.block_ids[pos // seq.block_size], pos % seq.block_size


def token_bytes(token_ids: array[int] | list[int]) -> bytes:
    """Token ids as the prefix cache hashes and keeps them: the bytes of a uint32 array.

    A block's 16 tokens are one 64-byte string rather than a tuple of 16 int
    objects: a fifth of the memory per cached page, and comparing a swapped-in
    history's pages with what the cache holds is one `bytes` comparison per
    page (or one for the whole run) instead of building a tuple per page.
    """
    return (token_ids if type(token_ids) is array else array("I", token_ids)).tobytes()


class PrefixHasher:
    """Chained, keyed content hashes of full blocks: (parent, model, token ids) -> digest.

    Keyed BLAKE2b with a per-process secret: a client cannot craft two prompts
    whose blocks collide, and lookups compare token ids anyway. A block's
    tokens are passed as `token_bytes`. Each hash starts from a copy of one
    keyed state rather than keying a new one, the model and block size hashed
    as one string: a 128k-token prompt is 8,192 blocks, so each block's
    fixed cost counts.
    """

    __slots__ = ("_keyed",)

    def __init__(self, key: bytes) -> None:
        self._keyed = hashlib.blake2b(key=key[:64], digest_size=16)

    def block_hash(self, parent: bytes, model: str, tokens: bytes) -> bytes:
        return self._hash(parent, _head(model, len(tokens) // TOKEN_BYTES), tokens)

    def _hash(self, parent: bytes, head: bytes, tokens: bytes) -> bytes:
        h = self._keyed.copy()
        h.update(parent)
        h.update(head)
        h.update(tokens)
        return h.digest()

    def walk(self, model: str, token_ids: array[int] | list[int], block_size: int, start: int, parent: bytes,
             stop: int) -> Iterator[tuple[bytes, bytes]]:
        """Hash and token bytes of each full block `start` .. `stop`-1, one at a time: a reader that stops
        at a cache miss hashes no further."""
        raw, stride = token_bytes(token_ids[start * block_size:stop * block_size]), block_size * TOKEN_BYTES
        head = _head(model, block_size)
        for at in range(0, (stop - start) * stride if stop > start else 0, stride):
            tokens = raw[at:at + stride]
            parent = self._hash(parent, head, tokens)
            yield parent, tokens

    def chain(self, model: str, token_ids: array[int] | list[int], block_size: int, start: int, parent: bytes,
              stop: int) -> list[tuple[bytes, bytes]]:
        """Hashes and token bytes of full blocks `start` .. `stop`-1."""
        return list(self.walk(model, token_ids, block_size, start, parent, stop))


def prefix_space(model: str, salt: str) -> str:
    """A model's prefix cache, or a salted part of it: blocks of one space never serve another's."""
    return f"{model}\0salt\0{salt}" if salt else model


def _head(model: str, num_tokens: int) -> bytes:
    """What a block hash covers between its parent and its tokens: the model, and how many tokens."""
    return model.encode() + b"\0" + num_tokens.to_bytes(4, "little")


@dataclass(frozen=True, slots=True)
class RemoteSession:
    """A session another host's memd published to the cluster store (memd.cluster): what to fetch."""

    model: str
    block_size: int
    token_ids: list[int]
    keys: list[str]               # store keys of its leading full blocks
    checksums: list[int]          # their workers' checksums
    salt: str = ""                # the cache salt it was opened with: its keys cover it
    tenant: str = ""
    retain_until: float = 0.0     # when its retention promise ends (wall clock; 0: none), kept where it lands


@dataclass(frozen=True, slots=True)
class RemotePrefix:
    """Full blocks of a new sequence's prompt that other hosts published, from block `start` on (memd.cluster)."""

    start: int
    keys: list[str]
    checksums: list[int]


@dataclass(slots=True)
class RemoteLookups:
    """What the cluster store said before one Step (memd.cluster_lookup): read by that Step's ops only."""

    sessions: dict[str, RemoteSession] = field(default_factory=dict)
    prefixes: dict[int, RemotePrefix] = field(default_factory=dict)     # by id() of the Step's Open op


MAX_NAME = 256                  # characters of a session id, model or worker name


MAX_SALT = 256                  # characters of a salt: a tenant's name, then the 128 of a request's cache_salt


def check_salt(salt: str) -> None:
    if len(salt) > MAX_SALT or "\0" in salt:
        raise InvalidArgument(f"a cache salt is at most {MAX_SALT} characters, none of them NUL")


def check_name(what: str, value: str) -> None:
    """A session id, turn id, model or worker name memd keeps (and journals) is of bounded length."""
    if len(value) > MAX_NAME:
        raise InvalidArgument(f"{what} of {len(value)} characters; at most {MAX_NAME}")
