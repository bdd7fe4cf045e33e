"""A generation request as the scheduler tracks it, the events it streams back, and why one fails."""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from dataclasses import dataclass, field

import torch
from tokenizers.decoders import DecodeStream

from inferd.block_table import BlockTable
from inferd.sampling import SamplingParams, TokenLogprob

__all__ = ["Event", "GenerationError", "Request", "RequestStatus", "TokenLogprob"]


class GenerationError(Exception):
    """Why a request failed; `code` is the gRPC status name the service returns, `reason` memd's reason
    for a refusal where it gave one ("session_busy"), which the HTTP API maps to OpenAI's error code."""

    def __init__(self, code: str, message: str, reason: str = "") -> None:
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


class RequestStatus(enum.Enum):
    WAITING = enum.auto()       # queued (or a fork child waiting for its page): memd holds nothing for it yet
    RUNNING = enum.auto()       # memd gave it a sequence: it is in the batch
    PREEMPTED = enum.auto()     # gave its pages up for others: memd swaps or drops its sequence (or forgot it:
                                # seq_id 0) and it waits at the head of the queue to be resumed
    FINISHED = enum.auto()      # ended: its final event is out, or waits for memd to release the sequence


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    turn_id: str | None = None                         # the client's name for this turn (retries reuse it)
    # With session_id: prompt_ids are the whole conversation (a stateless client resends it each turn), not
    # the new turn's tokens; memd keeps what the session's history shares with it.
    whole_history: bool = False
    arrived: float = field(default_factory=time.monotonic)
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    status: RequestStatus = RequestStatus.WAITING
    seq_id: int = 0                                    # memd's sequence, once it has one (0: none)
    table: list[int] = field(default_factory=BlockTable)    # pool blocks, in order (inferd.block_table)
    tokens: list[int] = field(default_factory=list)    # the whole history: memd's, the prompt, the generated
    num_computed: int = 0                              # tokens whose K/V are in the pool
    num_known_to_memd: int = 0                         # history length memd knows
    num_committed: int = 0                             # history memd holds as computed (its prefix cache's)
    num_summed: int = 0                                # leading pages memd has (or had) a checksum for
    generated: list[int] = field(default_factory=list)
    emitted_text: str = ""
    text: str = ""                                     # the generated tokens' text so far (`detokenizer`'s)
    detokenizer: DecodeStream | None = None            # one token at a time: no re-decoding of all the text
    stops_from: int = 0                                # min_tokens: no stop string may end at or before this
                                                       # character of the text (that of the held tokens)
    num_prompt: int = 0
    num_cached: int = 0
    first_token_at: float = 0.0
    cancelled: str | None = None                       # "cancelled" or "reset"
    generator: torch.Generator | None = None
    index: int = 0                                     # completion number, for n > 1
    children: list[Request] = field(default_factory=list)
    preemptions: int = 0
    fork_of: Request | None = None                     # n > 1: the request whose prompt this one forks
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])   # or the client's x-request-id

    def cancel(self, reason: str = "cancelled") -> None:
        self.cancelled = self.cancelled or reason
        for child in self.children:
            child.cancel(reason)

    def fail(self, error: GenerationError) -> None:
        """End with `error` as the final event; only for a request that holds nothing in memd."""
        self.status = RequestStatus.FINISHED
        self.events.put_nowait(Event([], "", usage=self.usage(), error=error, index=self.index))

    def usage(self) -> dict[str, float]:
        n = len(self.generated)
        end = time.monotonic()
        ttft = (self.first_token_at - self.arrived) * 1000 if self.first_token_at else 0.0
        tpot = (end - self.first_token_at) * 1000 / (n - 1) if n > 1 else 0.0
        return {"prompt_tokens": self.num_prompt, "cached_tokens": self.num_cached,
                "completion_tokens": n, "ttft_ms": ttft, "tpot_ms": tpot}
