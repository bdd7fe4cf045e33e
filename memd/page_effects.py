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


@dataclass(slots=True)
class Zero:
    """A page handed out again: its last tenant's K/V must not be read as the new one's."""

    page: int


@dataclass(slots=True)
class Copy:
    """A page a sequence must write but may not share: a fork's partly written last page (each side gets its
    own), or the full block a resent conversation parts from its session inside (the K/V before that point)."""

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


def pages_touched(effects: list[PageEffect]) -> list[int]:
    """Every pool page the effects read or write (a swap-in reads slots, not pages)."""
    pages: list[int] = []
    for e in effects:
        if isinstance(e, SwapIn):
            pages += e.pages
        else:
            pages += (e.src, e.page) if isinstance(e, Copy) else (e.page,)
    return pages
