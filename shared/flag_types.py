"""argparse types for numeric flags: one place that says, in one line, which range a value must lie in."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(kind: type[int] | type[float] = float, *, above: float | None = None, at_least: float | None = None,
           at_most: float | None = None) -> Callable[[str], int | float]:
    """A parser for a finite `kind` in the range the bounds give; its error names the range and the text."""
    words = [w for w, v in (("above", above), ("at least", at_least), ("at most", at_most)) if v is not None]
    bounds = [v for v in (above, at_least, at_most) if v is not None]
    noun = "a whole number" if kind is int else "a number"
    wanted = f"{noun} " + " and ".join(f"{w} {b:g}" for w, b in zip(words, bounds, strict=True)) if words else noun

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}: {text}") from None
        if (not math.isfinite(value) or (above is not None and value <= above)
                or (at_least is not None and value < at_least) or (at_most is not None and value > at_most)):
            raise argparse.ArgumentTypeError(f"must be {wanted}: {text}")
        return value
    parse.__name__ = kind.__name__          # argparse names the type in "invalid ... value" messages
    return parse
