"""What memd does with a page that failed its check: its K/V is never read again, its tokens stay.

A page is checked against the checksum its worker sent when it committed the
page (`BlockPool.checksum`), a swap slot against the checksum of the page it
was copied from (`SwapSlots.checksum`). A sequence whose page fails keeps its
token ids and the K/V before that page; the worker that resumes it recomputes
the rest, so the answer is the one an uninterrupted run gives. A cached page
that fails leaves the prefix cache. Each failure is counted by where it was
found (`integrity_failures` and `integrity_failures_<where>`) and logged with
its block, sequence and session.

Called on memd's event loop, outside Steps (a swap-in's failure, found inside
a Step's effects, is handled by `KvManager.effects_landed`).
"""

from __future__ import annotations

from collections import Counter
from enum import Enum
from typing import TYPE_CHECKING

import structlog

from memd.sequences import SeqState, Sequence

if TYPE_CHECKING:
    from memd.kv_state import KvState

log = structlog.get_logger("memd.integrity")


class Where(Enum):
    """Where a page was found rotten: the label of `kvpool_memd_integrity_failures_total`."""

    SWAP_IN = "swap_in"          # a swapped-out page copied back
    SWAP_OUT = "swap_out"        # a parked page on its way to the swap tier
    RESTART = "restart"          # a page reopened from the state directory by a new memd
    SCRUB = "scrub"              # a parked, swapped or cached page, checked by `memctl scrub`
    SPOT_CHECK = "spot_check"    # cached K/V a worker recomputed and found different (--verify-reuse)

    @property
    def counter(self) -> str:
        return f"integrity_failures_{self.value}"


def count(counters: Counter[str], where: Where) -> None:
    """One page that failed its check, in `counters` (the manager's, or a Step's until it stands)."""
    counters["integrity_failures"] += 1
    counters[where.counter] += 1


def cut(manager: KvState, seq: Sequence, index: int) -> None:
    """A PARKED or SWAPPED sequence keeps its tokens and its pages (or slots) before `index`; the rest go."""
    bs = seq.block_size
    seq.num_committed = min(seq.num_committed, index * bs)
    if seq.state is SeqState.SWAPPED:
        assert manager.swap is not None
        manager.swap.give(seq.slots[index:])
        del seq.slots[index:]
    else:
        manager.release_blocks(seq.block_ids[index:])
        del seq.block_ids[index:]
    del seq.hashes[index:]
    if not seq.num_committed and not seq.block_ids and not seq.slots:
        seq.state = SeqState.DROPPED
    manager.mark_changed(seq)


def page_failed(manager: KvState, block: int, where: Where) -> bool:
    """Pool page `block` does not hold what its checksum says: counted, and nobody reads it as K/V again.

    Returns False when the page is no longer one to act on (a swap-out is
    copying it: the swap-out's own check handles it).
    """
    if any(block in seq.block_ids for seq in (job.seq for job in manager.swap_jobs.values())):
        return False
    count(manager.counters, where)
    forget_page(manager, block, where)
    return True


def forget_page(manager: KvState, block: int, where: Where) -> None:
    """Parked sequences holding a rotten page are cut before it; the prefix cache forgets it.

    A running sequence holding it is left to its worker (its pages are in
    use): the page keeps its checksum, and a scrub after the turn parks cuts it.
    """
    holders = [(seq, seq.block_ids.index(block)) for seq in manager.seqs.values() if block in seq.block_ids]
    manager.pool.unregister(block)
    for seq, index in holders:
        log.error("a page failed its check: its K/V is recomputed", where=where.value, block=block,
                  seq=seq.seq_id, session=seq.session_id, state=seq.state.value, index=index)
        if seq.state is SeqState.PARKED:
            # A swap-out copying it now would copy the rot and the whole table: it no longer counts.
            if (job := manager.swap_jobs.get(seq.seq_id)) is not None:
                manager.call_off(job)
            cut(manager, seq, index)
    if not holders:
        log.error("a cached page failed its check: it left the prefix cache", where=where.value, block=block)
    if not manager.pool.ref[block]:
        manager.pool.set_checksum(block, 0)       # free and uncached: nothing to check until it is written again


def slot_failed(manager: KvState, seq: Sequence, index: int, where: Where) -> None:
    """Swap slot `index` of a SWAPPED sequence does not hold what was swapped out: cut before it."""
    count(manager.counters, where)
    log.error("a swapped page failed its check: its K/V is recomputed", where=where.value, slot=seq.slots[index],
              seq=seq.seq_id, session=seq.session_id, index=index)
    cut(manager, seq, index)
