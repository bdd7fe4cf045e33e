"""structlog set-up shared by the daemons: JSON off a terminal, readable on one."""

from __future__ import annotations

import logging
import sys

import structlog

_level = logging.INFO


def enabled(level: int) -> bool:
    """Whether events at `level` are written: a hot path skips building events no one will see."""
    return level >= _level


def configure(level: str = "info", fmt: str = "auto") -> None:
    """`fmt` is "json", "console" or "auto" (console when stderr is a terminal, JSON under systemd)."""
    global _level
    _level = getattr(logging, level.upper())
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()) if fmt == "console"
                else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
