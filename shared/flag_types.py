"""argparse types for numeric flags: one place that says, in one line, which range a value must lie in.

A value out of range is refused while the command line (or a config file,
which goes through the same types) is read, so a daemon never starts with a
setting that fails later — a request that hangs, a port the kernel refuses —
and a CLI never sends memd a number its protocol cannot carry.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from shared.sizes import format_size, parse_size

UINT32_MAX = 2**32 - 1       # the widest value of the protocols' uint32 fields (token counts, block sizes)
UINT64_MAX = 2**64 - 1       # and of their uint64 fields (sequence and worker ids, block counts)
PORT_MAX = 65535


def number(kind: type[int] | type[float] = float, *, above: float | None = None, at_least: float | None = None,
           below: float | None = None, at_most: float | None = None) -> Callable[[str], int | float]:
    """A parser for a finite `kind` in the range the bounds give; its error names the range and the text."""
    named = (("above", above), ("at least", at_least), ("below", below), ("at most", at_most))
    words = [f"{w} {_bound(b)}" for w, b in named if b is not None]
    noun = "a whole number" if kind is int else "a number"
    wanted = f"{noun} " + " and ".join(words) if words else noun

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}: {text}") from None
        if (not math.isfinite(value) or (above is not None and value <= above)
                or (at_least is not None and value < at_least) or (below is not None and value >= below)
                or (at_most is not None and value > at_most)):
            raise argparse.ArgumentTypeError(f"must be {wanted}: {text}")
        return value
    parse.__name__ = kind.__name__          # argparse names the type in "invalid ... value" messages
    return parse


def _bound(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.0f}" if value.is_integer() else f"{value:g}"


def proto_id(what: str, listed_by: str) -> Callable[[str], int]:
    """An id memd hands out (from 1, a uint64 on the wire); the error says where to find the ids."""
    check = number(int, at_least=1, at_most=UINT64_MAX)

    def parse(text: str) -> int:
        try:
            return int(check(text))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be a {what} id from 1 ({listed_by} lists them): {text}") from None
    parse.__name__ = "int"
    return parse


def count(at_most: int = UINT32_MAX) -> Callable[[str], int]:
    """How many of something, at least one: zero of them would leave a daemon unable to do anything."""
    return number(int, at_least=1, at_most=at_most)  # type: ignore[return-value]


def byte_size(at_least: int = 1) -> Callable[[str], int]:
    """A byte size as operators write them (64MiB, 1.5GiB, 4096), at least `at_least` bytes."""
    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value < at_least:
            raise argparse.ArgumentTypeError(f"must be at least {format_size(at_least)}: {text}")
        return value
    parse.__name__ = "size"
    return parse


# gRPC turns a deadline past int64 nanoseconds from now (about 292 years) into one already expired.
MAX_WAIT_S = 365 * 86400.0

port = number(int, at_least=0, at_most=PORT_MAX)
seconds = number(float, above=0)                 # an interval: zero would spin
seconds_or_zero = number(float, at_least=0)      # where 0 says "never"
timeout = number(float, above=0, at_most=MAX_WAIT_S)        # a deadline: zero would fail every call at once
wait = number(float, at_least=0, at_most=MAX_WAIT_S)        # how long to wait on top of a deadline; 0: not at all
