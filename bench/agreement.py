"""Whether two servers' greedy completions of one prompt agree: the check that keeps a speed ratio honest.

Both decode greedily on the same float32 weights; a server that computes
something else shows here, not only in its speed.
"""

from __future__ import annotations

AGREE_CHARS = 24


def same_start(ours: str, theirs: str) -> bool:
    """The first `AGREE_CHARS` characters agree. A completion that ends inside a UTF-8 character ends in
    U+FFFD on kvpool (the tokenizer's own decode of every token) and may end without it on the other side
    (vLLM holds the incomplete bytes back): the same tokens either way, so a trailing U+FFFD is not counted.
    Nor is one from a decode of the other side's token ids that ends the same way."""
    ours, theirs = ours.rstrip("\ufffd"), theirs.rstrip("\ufffd")
    return ours[:AGREE_CHARS] == theirs[:AGREE_CHARS]
