"""What a committed Step asks of the pages, and the one place that does it.

A Step changes only bookkeeping (`memd.manager`); the page contents its
changes imply come back as effects, in order: zero a reused page before its
new tenant may read it, copy the partly written page a fork must not share,
copy a sequence's swapped-out pages back in. They are done before the worker
hears back (`memd.page_copier` runs them off the event loop).

A long prompt's pages make thousands of Zero effects at once, so effects are
values never changed once built but not frozen dataclasses (as `shared.ops`
explains); and a swap-in is one effect for all of a sequence's pages: a 128k-token
session's 8,192, one by one, cost memd's loop more than the rest of its Resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from memd.memory import PoolMemory
    from memd.swap import SwapMemory


@dataclass(slots=True)
class Zero:
    """A page handed out again: its last tenant's K/V must not be read as the new one's."""

    page: int


@dataclass(slots=True)
class Copy:
    """A fork's partly written last page: each side gets its own, since each will write it."""

    src: int
    page: int


@dataclass(slots=True)
class SwapIn:
    """Swapped-out pages back from their swap slots into pool pages, `pages[i]` from `slots[i]`, each checked
    against `checksums[i]` (0: unknown)."""

    slots: list[int]
    pages: list[int]
    checksums: list[int]


@dataclass(slots=True)
class Fetch:
    """A page of a session another host published, fetched from the cluster store into a pool page and
    checked against the checksum its worker sent (memd.cluster)."""

    key: str
    page: int
    checksum: int


PageEffect = Zero | Copy | SwapIn | Fetch


class RemotePages(Protocol):
    def get_pages(self, keys: list[str], pages: list[int]) -> list[bool]: ...   # fetched whole, key by key


def pages_touched(effects: list[PageEffect]) -> list[int]:
    """Every pool page the effects read or write (a swap-in reads slots, not pages)."""
    pages: list[int] = []
    for e in effects:
        if isinstance(e, SwapIn):
            pages += e.pages
        else:
            pages += (e.src, e.page) if isinstance(e, Copy) else (e.page,)
    return pages


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
