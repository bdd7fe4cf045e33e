"""A generation request as the scheduler tracks it, the events it streams back, and why one fails."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

import grpc
import torch
from tokenizers.decoders import DecodeStream

from inferd.progress import RequestStatus, SeqProgress
from inferd.sampling import SamplingParams, TokenLogprob

__all__ = ["CancelReason", "Event", "GenerationError", "Request", "RequestStatus", "TokenLogprob"]

# Why a request ended before its own end: its client went away or asked, or its session was reset.
CancelReason = Literal["cancelled", "reset"]


class GenerationError(Exception):
    """Why a request failed: `code`, the gRPC status inferd's gRPC service ends the call with and its HTTP API
    maps to a status (`openai_api.HTTP_STATUS`); `reason`, memd's reason for a refusal where it gave one
    ("session_busy"), which the HTTP API maps to OpenAI's error code (`openai_api.API_CODES`)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code, self.message, self.reason = code, message, reason


@dataclass(slots=True)
class Event:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None       # "stop", "length", "cancelled", "reset"
    usage: dict[str, float] | None = None
    error: GenerationError | None = None
    index: int = 0                         # which of the request's n completions
    # SamplingParams.logprobs set: one per token of `token_ids` (None on an event that carries no token).
    logprobs: list[TokenLogprob] | None = None
    # On a token's event: this token ends the completion, for this reason. The final event (finish_reason,
    # usage) follows once memd has the sequence back; a stream can say "this was the last" at once.
    ends: str | None = None


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    turn_id: str | None = None                         # the client's name for this turn (retries reuse it)
    # With session_id: prompt_ids are the whole conversation (a stateless client resends it each turn), not
    # the new turn's tokens; memd keeps what the session's history shares with it.
    whole_history: bool = False
    cache_salt: str | None = None                      # vLLM's: its prefix-cache namespace (memd's Open.cache_salt)
    tenant: str | None = None                          # whose it is (shared.tenants): memd counts its pages for it
    retain_s: float = 0.0                              # keep its session this long (memd's Open.retain_s)
    quota_since: float = 0.0                           # when it began to wait at its tenant's page max (0: not)
    arrived: float = field(default_factory=time.monotonic)
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    seq: SeqProgress = field(default_factory=SeqProgress)   # its sequence, in the pool and in memd's books
    generated: list[int] = field(default_factory=list)
    emitted_text: str = ""
    text: str = ""                                     # the generated tokens' text so far (`detokenizer`'s)
    detokenizer: DecodeStream | None = None            # one token at a time: no re-decoding of all the text
    stops_from: int = 0                                # min_tokens: no stop string may end at or before this
                                                       # character of the text (that of the held tokens)
    num_prompt: int = 0
    num_cached: int = 0
    first_token_at: float = 0.0
    cancel_reason: CancelReason | None = None          # set once its client cancelled it, or reset its session
    generator: torch.Generator | None = None
    index: int = 0                                     # completion number, for n > 1
    children: list[Request] = field(default_factory=list)
    preemptions: int = 0
    fork_of: Request | None = None                     # n > 1: the request whose prompt this one forks
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])   # or the client's x-request-id

    @property
    def status(self) -> RequestStatus:
        return self.seq.status

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    def cancel(self, reason: CancelReason = "cancelled") -> None:
        """Ask it to end at the next step; the first reason given is the one its final event says."""
        self.cancel_reason = self.cancel_reason or reason
        for child in self.children:
            child.cancel(reason)

    def fail(self, error: GenerationError) -> None:
        """End with `error` as the final event; only for a request that holds nothing in memd."""
        self.seq.finished()
        self.events.put_nowait(Event([], "", usage=self.usage(), error=error, index=self.index))

    def usage(self) -> dict[str, float]:
        n = len(self.generated)
        end = time.monotonic()
        ttft = (self.first_token_at - self.arrived) * 1000 if self.first_token_at else 0.0
        tpot = (end - self.first_token_at) * 1000 / (n - 1) if n > 1 else 0.0
        return {"prompt_tokens": self.num_prompt, "cached_tokens": self.num_cached,
                "completion_tokens": n, "ttft_ms": ttft, "tpot_ms": tpot}
