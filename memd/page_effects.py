"""What a committed Step asks of the pages, and the one place that does it.

A Step changes only bookkeeping (`memd.manager`); the page contents its
changes imply come back as effects, in order: zero a reused page before its
new tenant may read it, copy the partly written page a fork must not share,
copy a swapped-out page back in. They are done before the worker hears back
(`memd.page_copier` runs them off the event loop).

A swap-in of a long session makes thousands at once, so they are values never
changed once built, but not frozen dataclasses (as `shared.ops` explains).
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
    """A swapped-out page back from its swap slot into a pool page, checked against `checksum` (0: unknown)."""

    slot: int
    page: int
    checksum: int = 0


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
    """Every pool page the effects read or write (a swap-in reads a slot, not a page)."""
    return [page for e in effects for page in ((e.src, e.page) if isinstance(e, Copy) else (e.page,))]


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
                pairs = [(e.slot, e.page) for e in run]                         # type: ignore[union-attr]
                if any(e.checksum for e in run):                                # type: ignore[union-attr]
                    found = swap.copy_in_checked(pairs)
                    bad += [e.page for e, got in zip(run, found, strict=True)   # type: ignore[union-attr]
                            if e.checksum and got != e.checksum]                # type: ignore[union-attr]
                else:
                    swap.copy_in(pairs)
            else:
                memory.apply(run)                                       # type: ignore[arg-type]
            start = i
    return bad


def _kind(effect: PageEffect) -> type:
    """Effects run together: zeroing and copies on the pool, swap-ins, fetches."""
    return type(effect) if isinstance(effect, SwapIn | Fetch) else Zero


def _fetch(memory: PoolMemory, remote: RemotePages | None, run: list[Fetch]) -> list[int]:
    pages = [e.page for e in run]
    arrived = remote.get_pages([e.key for e in run], pages) if remote is not None else [False] * len(run)
    found = memory.checksums(pages)
    return [e.page for e, ok, got in zip(run, arrived, found, strict=True) if not ok or got != e.checksum]
