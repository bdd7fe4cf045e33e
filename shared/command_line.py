"""What every kvpool program does with its command line: one-line errors, --version, a quiet closed pipe.

An operator reads a failed start in `systemctl status` or a journal, where
argparse's usage block pushes the one line that matters out of view; a
script piping `memctl stats` into `head` must not see a traceback when
`head` stops reading.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NoReturn

import grpc

EXIT_CLOSED_PIPE = 141       # 128 + SIGPIPE: what a shell reports for a program its reader stopped reading


def kvpool_version() -> str:
    try:
        return version("kvpool")
    except PackageNotFoundError:         # run from a source tree that was never installed
        return "unknown (not installed)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the flag, exit 2; `version=True` adds --version."""

    def __init__(self, *args: Any, version: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if version:
            self.add_argument("--version", action="version", version=f"%(prog)s (kvpool) {kvpool_version()}")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True, slots=True)
class Ignored:
    """`flag` has no effect `without` another setting, or `alongside` one; `why` tells the operator which."""

    flag: str
    why: str
    without: str | None = None
    alongside: str | None = None


def ignored(given: Iterable[str], rules: Iterable[Ignored]) -> list[str]:
    """A warning for each setting given where it does nothing (settings by their dest names).

    A warning, not a refusal: a config file may hold a setting that a flag
    for one run turns off (--disable-swap over a file's swap-ratio).
    """
    given = set(given)
    return [f"--{r.flag.replace('_', '-')} is ignored: {r.why}" for r in rules
            if r.flag in given and (r.without is None or r.without not in given)
            and (r.alongside is None or r.alongside in given)]


def entry_point(program: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a main(): a closed stdout ends it quietly, and an unexpected OSError or gRPC error is one line.

    The causes are checked where the command line is read; this is the net
    under them, so that no operator ever reads a traceback for a bad setting.
    """
    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> int:
            try:
                return main(*args, **kwargs)
            except BrokenPipeError:
                # Python would report the pipe again when it flushes stdout at exit: point stdout nowhere.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                return EXIT_CLOSED_PIPE
            except grpc.RpcError as err:
                code = err.code() if callable(getattr(err, "code", None)) else None
                details = err.details() if callable(getattr(err, "details", None)) else str(err)
                what = code.name.lower().replace("_", " ") if code is not None else "gRPC error"
                print(f"{program}: {what}: {details}", file=sys.stderr)
                return 1
            except OSError as err:
                print(f"{program}: {err.strerror or err}" + (f": {err.filename}" if err.filename else ""),
                      file=sys.stderr)
                return 1
        return run
    return wrap
