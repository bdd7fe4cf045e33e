"""One request's events as a door reads them: until each of its n completions has ended.

The gRPC service and the HTTP API both read a request this way: each final
event is counted in the metrics and logged ("request finished", "request
failed"), an error ends the request's other completions too and is raised,
and a client that goes away cancels what is left (its sequences park or free).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from inferd.requests import Event, Request

if TYPE_CHECKING:
    from inferd.metrics import InferdMetrics

log = structlog.get_logger("inferd")


@dataclass(eq=False)
class Completions:
    """The events of one request (n completions), read until each has ended; an error event raises it."""

    request: Request
    cancel: Callable[[Request], None]
    metrics: InferdMetrics | None
    remaining: int = 0
    finals: dict[int, Event] = field(default_factory=dict)
    last_token_at: dict[int, float] = field(default_factory=dict)     # by completion: for the gaps between tokens

    def __post_init__(self) -> None:
        self.remaining = self.request.params.n

    async def next(self) -> Event | None:
        if not self.remaining:
            return None
        event = await self.request.events.get()
        if self.metrics is not None:
            self._count(event, self.metrics)
        if event.error is not None:
            self.remaining = 0
            self.cancel(self.request)                  # n > 1: the other completions stop too
            log.info("request failed", request=self.request.request_id, session=self.request.session_id,
                     seq=self.request.seq.id, code=event.error.code.name, error=event.error.message)
            raise event.error
        if event.finish_reason is not None:
            self.remaining -= 1
            self.finals[event.index] = event
            log.info("request finished", request=self.request.request_id, session=self.request.session_id,
                     seq=self.request.seq.id, index=event.index, finish_reason=event.finish_reason,
                     **(event.usage or {}))
        return event

    def _count(self, event: Event, metrics: InferdMetrics) -> None:
        now = time.monotonic()
        if event.token_ids:
            last = self.last_token_at.get(event.index)
            if last is not None:
                metrics.token_gap(now - last)
            elif not self.last_token_at:
                metrics.first_token(self.request, now)
            self.last_token_at[event.index] = now
        if event.error is not None or event.finish_reason is not None:
            metrics.finished(event, self.request, now)

    def stop(self) -> None:
        """End the request early; its completions still end as usual (finish reason "abort")."""
        if self.remaining:
            self.cancel(self.request)

    def abandon(self) -> None:
        """The client went away: the sequences park or free."""
        if self.remaining:
            self.remaining = 0
            log.info("request cancelled by its client", request=self.request.request_id,
                     session=self.request.session_id)
            self.cancel(self.request)

    def usage(self) -> dict[str, Any]:
        finals = [e.usage or {} for e in self.finals.values()]
        prompt = int(finals[0].get("prompt_tokens", 0)) if finals else 0
        completion = sum(int(u.get("completion_tokens", 0)) for u in finals)
        cached = int(finals[0].get("cached_tokens", 0)) if finals else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}
