"""How far a request's sequence has come: in this worker's pool, and in memd's books.

A request holds one `SeqProgress`, and it changes only by the transitions
below, each named for what happened: memd placed the sequence (opened,
resumed or forked it), a pass wrote K/V, a Step told memd of new tokens (or
was refused), memd grew the table, the sequence gave its pages up to a
preemption, memd forgot it, or the request starts over. The counters keep
one order at every instant (tests/test_progress.py checks it):

    committed <= computed <= len(tokens),  told <= len(tokens)

What a Step tells memd is counted when the op is built, not when memd
answers: one Step can carry two ops of one sequence (an n > 1 parent's
commit before its forks, then its growth), and the second must not send the
first's tokens again. An op memd refuses takes its part back (`untold`,
`sums_refused`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inferd.block_table import BlockTable

if TYPE_CHECKING:
    from shared.ops import OpResult


class RequestStatus(enum.Enum):
    WAITING = enum.auto()       # queued (or a fork child waiting for its page): memd holds nothing for it yet
    RUNNING = enum.auto()       # memd gave it a sequence: it is in the batch
    PREEMPTED = enum.auto()     # gave its pages up for others: memd swaps or drops its sequence (or forgot it)
                                # and it waits at the head of the queue to be resumed
    FINISHED = enum.auto()      # ended: its final event is out, or waits for memd to release the sequence


@dataclass(slots=True, eq=False)
class SeqProgress:
    status: RequestStatus = RequestStatus.WAITING
    id: int | None = None                              # memd's sequence; None: memd holds none for this request
    table: BlockTable = field(default_factory=BlockTable)   # pool blocks, in order (inferd.block_table)
    tokens: list[int] = field(default_factory=list)    # the whole history: memd's, the prompt, the generated
    computed: int = 0                                  # tokens whose K/V are in the pool
    told: int = 0                                      # history length memd knows (or a Step in flight tells it)
    committed: int = 0                                 # history memd holds as computed (its prefix cache's)
    summed: int = 0                                    # leading pages memd has (or is sent) a checksum for
    placed_at: float = 0.0                             # when memd first placed the sequence (monotonic clock)

    @property
    def held(self) -> bool:
        """memd holds a sequence for this request (running, parked by a preemption, swapped or dropped)."""
        return self.id is not None

    def placed(self, result: OpResult, tokens: list[int], block_size: int, *, told: int | None = None) -> None:
        """memd opened, resumed or forked the sequence: its table, and the first `num_committed` tokens of
        `tokens` it holds computed (and summed, if ever). `told`: the history memd knows, if not all of it
        (a fork child's own first token is not yet memd's)."""
        self.status = RequestStatus.RUNNING
        self.placed_at = self.placed_at or time.monotonic()
        self.id, self.table, self.tokens = result.seq_id, BlockTable(result.block_ids), tokens
        self.computed = self.committed = result.num_committed
        self.told = len(tokens) if told is None else told
        self.summed = result.num_committed // block_size

    def wrote(self, count: int) -> None:
        """A forward pass wrote the K/V of the next `count` tokens."""
        self.computed += count

    def sampled(self, token: int) -> None:
        self.tokens.append(token)

    def tell(self, upto: int | None = None) -> list[int]:
        """The tokens an op tells memd of (up to `upto`, else all), counted as told from now on."""
        end = len(self.tokens) if upto is None else upto
        news, self.told = self.tokens[self.told:end], max(self.told, end)
        return news

    def untold(self, count: int) -> None:
        """memd refused the op that told it of the last `count` tokens: they go with the next."""
        self.told -= count

    def sums_sent(self, upto_block: int) -> None:
        self.summed = upto_block

    def sums_refused(self, sums_from: int) -> None:
        """memd refused the op that carried checksums from page `sums_from` on: they go with the next commit."""
        self.summed = min(self.summed, sums_from)

    def grew(self, result: OpResult) -> None:
        """memd took an Extend: the table from `first_block` on, and what it now holds committed."""
        self.table[result.first_block:] = result.block_ids
        self.committed = result.num_committed

    def preempting(self) -> None:
        """It gives its pages up for others (a preempting Park is queued): it waits to be resumed."""
        self.status = RequestStatus.PREEMPTED

    def pages_given_up(self) -> None:
        """memd took the preempting Park: the pages are no longer this request's, the sequence still is."""
        self.table = BlockTable()

    def forgotten(self) -> None:
        """memd no longer has the preempted sequence: it is opened again from its history."""
        self.id = None

    def started_over(self) -> None:
        """memd freed the sequence; the request is new again, to be opened from its prompt."""
        self.status, self.id, self.table, self.tokens = RequestStatus.WAITING, None, BlockTable(), []
        self.computed = self.told = self.committed = self.summed = 0

    def finished(self) -> None:
        self.status = RequestStatus.FINISHED
