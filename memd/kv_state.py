"""What memd's state offers those who act on it: the Step's transaction, eviction, integrity repairs,
the invariant checks and the state copy.

`KvManager` (memd.manager) holds the state and is the one implementation;
the modules that change or read it ask for a `KvState` and use only what is
declared here, so none of them imports the manager and the manager imports
them all: the layers run pool and sequences, then this state, then the
transaction, eviction, integrity and checks, then the manager and its runner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from memd.pool import BlockPool, SwapSlots, UndoLog
from memd.quotas import Quotas
from memd.sequences import PrefixHasher, Sequence, SwapOut

if TYPE_CHECKING:
    from memd.seq_index import SeqIndex


@dataclass(slots=True)
class Worker:
    worker_id: int
    name: str
    pid: int
    model: str
    block_size: int
    last_seen: float
    lease: bytes = b""            # the secret its Steps and Session stream must present
    streaming: bool = False


class KvState(Protocol):
    pool: BlockPool
    swap: SwapSlots | None
    swap_jobs: dict[int, SwapOut]           # by sequence id: swap-outs being copied
    seqs: dict[int, Sequence]
    sessions: dict[str, int]
    workers: dict[int, Worker]
    revoked: dict[int, str]                 # running sequences an operator evicted: mode
    fences: dict[int, list[int]]            # pages a reclaimed worker's pid may still write
    counters: Counter[str]
    hasher: PrefixHasher
    heat_decay: float
    heat_interval_s: float
    watches: list[set[int]]                 # sequences changed, per reader copying them a slice at a time
    quotas: Quotas                          # tenants' and models' page quotas
    index: SeqIndex                         # counts, holders' pages, eviction and idle order (memd.seq_index)

    def find(self, seq_id: int | None, session_id: str | None) -> Sequence: ...

    def add(self, seq: Sequence) -> None: ...

    def new_seq_id(self) -> int: ...

    def forget(self, seq: Sequence, undo: UndoLog | None = None) -> None: ...

    def check_fits(self, num_tokens: int, block_size: int) -> None: ...

    def check_session_free(self, session_id: str | None) -> None: ...

    def offer(self, seq: Sequence, indices: Iterable[int], blocks: list[int], tokens: Iterable[bytes]) -> None: ...

    def park(self, seq: Sequence, fence: list[int] | None = None) -> None: ...

    def release(self, seq: Sequence) -> int: ...

    def release_blocks(self, blocks: list[int]) -> int: ...

    def call_off(self, job: SwapOut) -> None: ...

    def give_back(self, job: SwapOut) -> None: ...

    def evictable(self, seq: Sequence) -> bool: ...

    def mark_changed(self, seq: Sequence) -> None: ...

    def heat(self, seq: Sequence, now: float) -> float: ...

    def note_sum_set(self, seq: Sequence, index: int) -> None: ...

    def note_tokens_cut(self, seq_id: int) -> None: ...
