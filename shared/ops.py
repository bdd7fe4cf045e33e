"""The operations of a Step, as plain values.

Workers build these (through `shared.client`), memd applies them
(`memd.manager`); `shared.packed_steps` is their form on the wire. A Step is a
list of them, applied in order, all or nothing.

They are values, never changed once built, but not frozen dataclasses: a
frozen one's constructor sets each field through object.__setattr__, seven
times slower, and a decode Step builds 16 of them at each end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Open:
    """A new RUNNING sequence for `token_ids`; cached full blocks are shared, not recomputed."""

    token_ids: list[int]
    reserve: int = 0                 # writable positions wanted past the tokens
    session_id: str | None = None
    continue_session: bool = False   # resume the session's sequence if it has one; token_ids join its history
    turn_id: str | None = None       # names the turn: sent again, it replaces the session's last turn of that name
    # With continue_session: token_ids are the whole conversation (a stateless client resends it every turn);
    # memd keeps the longest prefix the session's history shares with it, with its K/V, and replaces the rest.
    whole_history: bool = False
    # A new sequence's prefix-cache namespace (vLLM's cache_salt): its blocks are found by, and find, only
    # sequences of the same salt, here and in the cluster store. A continued session keeps its own.
    cache_salt: str | None = None
    # Whose the new sequence is (the HTTP API's tenant, shared.tenants): memd counts its pages for it. A
    # continued session keeps its own.
    tenant: str | None = None
    # Keep the session this many seconds from now (0: no promise): its pages may be swapped, never dropped, and
    # they count against its tenant's guaranteed pages (memd.retention).
    retain_s: float = 0.0


@dataclass(slots=True)
class Extend:
    """`append` joins the history; the first `commit_to` tokens have K/V written (0: unchanged)."""

    seq_id: int
    append: list[int] = field(default_factory=list)
    commit_to: int = 0
    reserve: int = 0
    # Checksums of the pages this commit fills, from block `sums_from` on (shared.page_checksum).
    sums_from: int = 0
    page_sums: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Park:
    """End of turn: commit, release pages past the committed tokens, hand the sequence to memd.

    `preempt`: the worker gives the sequence up mid-request to make room; memd
    swaps its pages out (or drops them) before replying.
    """

    seq_id: int
    append: list[int] = field(default_factory=list)
    commit_to: int = 0
    preempt: bool = False
    sums_from: int = 0                       # as Extend's; a Park may include its partly filled last page
    page_sums: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Resume:
    """Take a PARKED, SWAPPED or DROPPED sequence, by id or session, back to RUNNING on this worker."""

    seq_id: int | None = None
    session_id: str | None = None
    reserve: int = 0


@dataclass(slots=True)
class Free:
    """Forget a sequence. `append`/`commit_to` (its worker only, RUNNING): commit first, as Extend does,
    so its full blocks stay in the prefix cache once freed."""

    seq_id: int | None = None
    session_id: str | None = None
    append: list[int] = field(default_factory=list)
    commit_to: int = 0
    sums_from: int = 0                       # as Extend's
    page_sums: list[int] = field(default_factory=list)
    # Full blocks (table indices) whose K/V a recompute found different: out of the prefix cache.
    distrusted: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Fork:
    """A child sharing the parent's full committed blocks; the partly written tail is copied."""

    seq_id: int
    session_id: str | None = None


Op = Open | Extend | Park | Resume | Free | Fork


@dataclass(slots=True)
class OpResult:
    """What one operation left: `block_ids` replaces the block table from `first_block` on."""

    seq_id: int
    state: str
    first_block: int
    block_ids: list[int]
    num_blocks: int
    num_committed: int
    num_cached: int = 0
    # A new sequence's blocks shared from the prefix cache (its first num_cached // block_size): their pages'
    # checksums, for a reader that checks each page before it uses it (the vLLM connector); else None.
    cached_sums: list[int] | None = None
    # Resume, fork, a continued session: the whole history (in memd, a copy of its uint32 array; a client's is a list).
    token_ids: Sequence[int] | None = None
