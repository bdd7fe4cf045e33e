"""The one place page contents change: a Step's effects and swap-out copies, off the event loop.

Effects on the same pages land in Step order: one FIFO thread takes every
queued effect, and a Step whose pages a queued effect still touches queues
behind it. A small Step on other pages runs inline, so it need not wait behind
another worker's large swap-in. Swap-outs copy on a thread of their own, so
Steps' small effects never queue behind them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from memd.background import give_way
from memd.memory import PoolMemory
from memd.page_effects import Fetch, PageEffect, SwapIn, Zero, pages_touched
from memd.sequences import CopyTicket
from memd.swap import SwapMemory

# Effects larger than this run off the event loop, so other workers' Steps
# are answered while a big page copy is in flight.
INLINE_EFFECT_BYTES = 1 << 20


class RemotePages(Protocol):
    def get_pages(self, keys: list[str], pages: list[int]) -> list[bool]: ...   # fetched whole, key by key


class PageCopier:
    """Runs page effects and swap-out copies off the event loop, in an order that keeps pages consistent."""

    def __init__(self, memory: PoolMemory, swap: SwapMemory | None, block_bytes: int) -> None:
        self.memory, self.swap, self.block_bytes = memory, swap, block_bytes
        self._effects = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memd-pages", initializer=give_way)
        self._swap_outs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memd-swap", initializer=give_way)
        self._busy: Counter[int] = Counter()      # pages that queued effects still touch
        self.remote: RemotePages | None = None    # the cluster store, for Fetch effects (memd.cluster)

    async def apply(self, effects: list[PageEffect]) -> list[int]:
        """Zero, copy and swap in pages before the reply; the Step's state change is already made.

        Shielded: a client that cancels or times out must not leave its pages
        unzeroed, since memd has handed them out all the same.
        """
        if self.inline(effects):
            return run_effects(self.memory, self.swap, effects)
        pages = pages_touched(effects)
        self._busy.update(pages)
        job = asyncio.get_running_loop().run_in_executor(self._effects, run_effects, self.memory, self.swap,
                                                         effects, self.remote)
        job.add_done_callback(lambda _job: self._unbusy(pages))
        return await asyncio.shield(job)

    def inline(self, effects: list[PageEffect]) -> bool:
        """Whether `apply` would run these effects at once, on the loop: few bytes, and on no page that queued
        effects still touch (those must land first)."""
        return len(effects) * self.block_bytes <= INLINE_EFFECT_BYTES and \
            not any(isinstance(e, SwapIn | Fetch) for e in effects) and \
            (not self._busy or self._busy.keys().isdisjoint(pages_touched(effects)))

    def apply_inline(self, effects: list[PageEffect]) -> list[int]:
        """`apply` of effects `inline` accepts, without a coroutine."""
        return run_effects(self.memory, self.swap, effects)

    async def queued_effects_done(self) -> None:
        """Returns once every effect queued so far has landed (the queue is FIFO: a no-op waits behind them)."""
        await asyncio.get_running_loop().run_in_executor(self._effects, lambda: None)

    async def swap_out(self, pairs: list[tuple[int, int]], ticket: CopyTicket | None = None) -> list[int] | None:
        """Copy (page, slot) pairs to the swap tier; returns the pages' checksums, taken once copied.

        The swap-in checks the page it brings back against them (the copy out,
        the slot while it waits and the copy in, all at once); memd checks them
        against what the worker sent when it committed the page (rot while parked).
        Pages with effects queued are copied once those landed. None: `ticket`
        was called off, before the copy started or part way through it.
        """
        assert self.swap is not None
        swap = self.swap
        if self._busy and not self._busy.keys().isdisjoint(page for page, _ in pairs):
            await self.queued_effects_done()     # a swap-in or a fork's copy: copy what the pages will hold

        def copy() -> list[int] | None:
            if ticket is not None and not ticket.begin():
                return None
            return swap.copy_out_checked(pairs, ticket.halt if ticket is not None else None)
        return await asyncio.get_running_loop().run_in_executor(self._swap_outs, copy)

    def _unbusy(self, pages: list[int]) -> None:
        busy = self._busy
        busy.subtract(pages)
        for page in pages:
            if busy.get(page, 0) <= 0:
                busy.pop(page, None)

    def close(self) -> None:
        """Wait for every queued copy: the pool must outlive them."""
        self._swap_outs.shutdown(wait=True)
        self._effects.shutdown(wait=True)


def run_effects(memory: PoolMemory, swap: SwapMemory | None, effects: list[PageEffect],
                remote: RemotePages | None = None) -> list[int]:
    """The effects in order: zeroing and copies on the pool, runs of swap-ins from the swap tier, fetches.

    Returns the pages a swap-in or a fetch brought back with other bytes than
    their checksum says (or, a fetch, not at all).
    """
    start, bad = 0, []
    for i in range(1, len(effects) + 1):
        if i == len(effects) or _kind(effects[i]) != _kind(effects[start]):
            run = effects[start:i]
            if isinstance(run[0], Fetch):
                bad += _fetch(memory, remote, run)                              # type: ignore[arg-type]
            elif isinstance(run[0], SwapIn):
                assert swap is not None
                bad += _swap_in(swap, run)                                      # type: ignore[arg-type]
            else:
                memory.apply(run)                                       # type: ignore[arg-type]
            start = i
    return bad


def _kind(effect: PageEffect) -> type:
    """Effects run together: zeroing and copies on the pool, swap-ins, fetches."""
    return type(effect) if isinstance(effect, SwapIn | Fetch) else Zero


def _swap_in(swap: SwapMemory, run: list[SwapIn]) -> list[int]:
    """Consecutive swap-ins (sequences resumed in one Step) as one copy; returns the pages that came back wrong."""
    slots = [slot for e in run for slot in e.slots] if len(run) > 1 else run[0].slots
    pages = [page for e in run for page in e.pages] if len(run) > 1 else run[0].pages
    sums = [value for e in run for value in e.checksums] if len(run) > 1 else run[0].checksums
    pairs = list(zip(slots, pages, strict=True))
    if not any(sums):
        swap.copy_in(pairs)
        return []
    found = swap.copy_in_checked(pairs)
    return [page for page, want, got in zip(pages, sums, found, strict=True) if want and got != want]


def _fetch(memory: PoolMemory, remote: RemotePages | None, run: list[Fetch]) -> list[int]:
    pages = [e.page for e in run]
    arrived = remote.get_pages([e.key for e in run], pages) if remote is not None else [False] * len(run)
    found = memory.checksums(pages)
    return [e.page for e, ok, got in zip(run, arrived, found, strict=True) if not ok or got != e.checksum]
