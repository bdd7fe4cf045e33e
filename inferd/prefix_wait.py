"""A prompt whose leading blocks another request here is computing right now waits for them instead of
computing them again.

memd's prefix cache offers committed blocks only. Eight users who send the
same 1,650-token system prompt at once would each be opened with no hit and
compute it eight times, each prefill taking its share of every pass's token
budget: every first token waits for all eight. Instead the first is admitted
(the leader), and a later prompt that shares at least one full block with a
leader's history beyond what the leader has committed stays in the queue,
with the requests behind it admitted past it. The leader commits its full
blocks after every prefill pass (the scheduler's early commits), and once it
has committed the shared run the follower is opened and memd's prefix match
hands it those blocks: it computes only its own tokens.

A follower waits only on a leader that is RUNNING here and still short of the
shared run: a leader that ends, is preempted or fails releases it at the next
iteration. Across workers of one memd the early commits are what is shared: a
prompt opened on another worker finds every block the leader has committed so
far, and computes the rest itself.

Admission uses the same matching (`held_blocks`): the leading blocks of a new
prompt that a running request holds committed are what memd's prefix match
will hand it, so they are not counted as pages it must find free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferd.requests import Request


def shared_blocks(a: list[int], b: list[int], block_size: int, limit: int) -> int:
    """Leading full blocks `a` and `b` share, at most `limit`; slice comparisons, a binary search over blocks."""
    low, high = 0, min(limit, len(a) // block_size, len(b) // block_size)
    while low < high:
        mid = (low + high + 1) // 2
        end = mid * block_size
        if a[:end] == b[:end]:
            low = mid
        else:
            high = mid - 1
    return low


def waits_for(prompt: list[int], leaders: Iterable[tuple[list[int], int]], block_size: int) -> bool:
    """Whether a new prompt should wait: some leader (its history, its committed tokens) shares with it more
    full blocks than it has committed. The prompt's last token is never matched (memd leaves it to compute:
    its logits are the ones wanted)."""
    limit = (len(prompt) - 1) // block_size
    for history, committed in leaders:
        if committed // block_size >= limit:
            continue
        if shared_blocks(prompt, history, block_size, limit) > committed // block_size:
            return True
    return False


def committed_blocks(request: Request, block_size: int) -> int:
    """Full blocks of a running request memd holds committed once this iteration's Step is applied: its
    prompt's computed full blocks are committed in that Step (by an op ahead of the Opens it carries)."""
    return max(request.seq.committed, min(request.seq.computed, request.num_prompt)) // block_size


def held_blocks(prompt: list[int], requests: Iterable[Request], block_size: int) -> int:
    """Leading full blocks of `prompt` that a running request here holds committed: memd's prefix match
    hands them to the prompt's Open, so its admission needs no free page for them (a shared system prompt
    of 100 blocks is not 100 blocks more to find for every user). It counts what this iteration's Step
    commits ahead of the Open: if memd refuses that commit, the Open finds less, and is refused and
    requeued, or computes those blocks itself."""
    limit = (len(prompt) - 1) // block_size
    best = 0
    for request in requests:
        reach = min(limit, committed_blocks(request, block_size))
        if reach > best:
            best = max(best, shared_blocks(prompt, request.seq.tokens, block_size, reach))
    return best


def leading(requests: Iterable[Request], block_size: int) -> list[tuple[list[int], int]]:
    """The requests others may wait on: those still computing their prompt, with what memd holds committed
    once this iteration's Step is applied."""
    return [(r.seq.tokens, committed_blocks(r, block_size) * block_size) for r in requests
            if r.seq.computed < r.num_prompt]
