"""Retention promises: a session kept until a time, its pages perhaps swapped but never dropped.

A request asks for one (`Open.retain_s`; the HTTP API's `X-Session-Retention`
or `prompt_cache_retention`). Until it ends, memd's policies may swap the
session out but never drop it: not for pressure, a tenant's max, the idle TTL
or a fuller swap tier's room, and an operator's bulk eviction (`memctl evict
--blocks` or `--idle`) passes it over too; only an operator naming the
session (or sequence), or its own client's reset, lets it go. When it ends
the session is evicted by heat like any other. A later turn asking again
renews it (never shortens it).

Promises are paid for from the tenant's guaranteed pages (the model's, for
a sequence of no tenant, memd.quotas): the retained sessions of one holder
may hold no more pages than its guarantee. A promise that would pass it is
refused (RESOURCE_EXHAUSTED, reason "retention": the HTTP API's 429); a
holder without a guarantee cannot promise (INVALID_ARGUMENT: a 400). A
session is counted at its whole history's pages, in the pool or swapped, at
the turn that asks: its answer may take it a little past, and the next
promise is refused then. The end time is wall-clock and journaled, so a
promise outlives a memd restart.
"""

from __future__ import annotations

import time

from memd.errors import InvalidArgument, KvError
from memd.quotas import Key, Quotas, describe
from memd.sequences import Sequence, blocks_for


class NoGuarantee(InvalidArgument):
    """A promise asked of a holder with no guaranteed pages to pay for it."""

    reason = "no_guarantee"


class RetentionRefused(KvError):
    """Keeping the session would take its holder's retained pages past its guaranteed pages."""

    code = "RESOURCE_EXHAUSTED"
    reason = "retention"


def retained(seq: Sequence, now: float | None = None) -> bool:
    """Its promise has not ended (`now`: wall-clock seconds, time.time())."""
    return seq.retain_until > 0 and seq.retain_until > (time.time() if now is None else now)


def holder(seq: Sequence) -> Key:
    """Whose guarantee pays for a promise: the tenant's, else the model's."""
    return ("tenant", seq.tenant) if seq.tenant else ("model", seq.model)


def pages(seq: Sequence) -> int:
    """What a retained session is counted at: its whole history's pages, wherever they are."""
    return max(len(seq.block_ids), len(seq.slots), blocks_for(len(seq.token_ids), seq.block_size))


def promise(seq: Sequence, retain_s: float, held: int, quotas: Quotas) -> float:
    """The time `seq`'s promise runs to if it may be made (its holder's guarantee pays); refused otherwise.
    `held`: the pages the holder's other sessions under a promise hold now (memd.seq_index)."""
    if seq.session_id is None:
        raise InvalidArgument("retention keeps a session: name one (session_id)")
    key = holder(seq)
    guaranteed = quotas.quota(key).guaranteed
    if not guaranteed:
        raise NoGuarantee(f"{describe(key)} has no guaranteed pages to keep sessions in: retention needs a "
                          "guarantee (memd --quotas, memctl quota)")
    now = time.time()
    if held + pages(seq) > guaranteed:
        raise RetentionRefused(f"{describe(key)} keeps {held} pages of sessions already; this one's {pages(seq)} "
                               f"would pass its {guaranteed} guaranteed pages")
    return max(seq.retain_until, now + retain_s)
