"""The checksums of the pages a worker commits, sent with the op that commits them.

memd checks a page against its checksum wherever its K/V could have rotted
(a swap-out and swap-in, a restart from the state directory, a scrub), so the
number must say what this worker wrote: it is taken here, from the pages
themselves, once the forward pass that wrote them is done, by the pool's own
function (shared.page_checksum: XXH3 on a shared-memory pool, a reduction on
the device for a CUDA pool, no page copied to the host). A page is summed
once: when it becomes full and committed, or, the partly filled last page,
when its sequence parks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.page_checksum import page_checksums

if TYPE_CHECKING:
    import torch

    from inferd.requests import Request


class PageSums:
    """Which pages of each request memd has a checksum for (`SeqProgress.summed`), and the ones to send."""

    def __init__(self, pages: torch.Tensor | None, block_size: int) -> None:
        self.pages, self.block_size = pages, block_size
        self.enabled = pages is not None          # bench/bench_verify.py turns it off to measure its cost

    def commit(self, request: Request, *, parks: bool = False) -> dict[str, object]:
        """The `sums_from`/`page_sums` fields of an op that commits what `request` computed.

        `parks`: the op parks the sequence, so its partly filled last page is
        written no more and is summed too. Counted as sent at once (as the
        tokens an op appends are); `unsent` takes it back if memd refuses the op.
        """
        bs, commit_to = self.block_size, request.seq.computed
        upto = -(-commit_to // bs) if parks else commit_to // bs
        first = request.seq.summed
        if not self.enabled or upto <= first:
            return {}
        assert self.pages is not None
        sums = page_checksums(self.pages, request.seq.table[first:upto])
        request.seq.sums_sent(commit_to // bs)
        return {"sums_from": first, "page_sums": sums}

    @staticmethod
    def unsent(request: Request, sums_from: int, page_sums: list[int]) -> None:
        """memd refused the op that carried these: they go again with the next commit."""
        if page_sums:
            request.seq.sums_refused(sums_from)
