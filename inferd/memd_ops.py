"""The scheduler's memd operations while a Step carries them: each op with whoever waits on its outcome.

An iteration's Step holds, in this order, the forks of n > 1 requests and
their parent's commit, then the Park/Free of requests that ended, session
resets, Extends of running sequences, and admissions (preemptions go in a
Step of their own, first). memd applies a Step all or nothing: when it
refuses one op it says which, and the scheduler takes that op out, lets it
settle with its owner (`refused`), and sends the rest again. Once a Step is
applied, each op hands its result to its owner (`applied`).

An op changes only its own request's fields. What it asks of the scheduler
(end the request, put it back in the queue, send an op in the next Step, ...)
it returns as an `Outcome`, a value the scheduler applies
(`Scheduler._apply`): no op reaches into the scheduler's lists.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import structlog
from grpc import StatusCode

from inferd.kv_audit import KvAudit
from inferd.page_sums import PageSums
from inferd.requests import Event, GenerationError, Request, RequestStatus
from shared.client import MemdError
from shared.ops import Extend, Fork, Free, Op, Open, OpResult, Park, Resume

log = structlog.get_logger("inferd.scheduler")     # the scheduler's own log lines, split out for reading


class OpContext(Protocol):
    """What an op reads of the worker while it takes memd's answer (the scheduler is one)."""

    @property
    def audit(self) -> KvAudit | None: ...           # --audit-kv

    @property
    def page_sums(self) -> PageSums: ...

    @property
    def max_position(self) -> int: ...


# ---- what an op asks of the scheduler ----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Ended:
    """The request leaves the batch (`Scheduler._end`): with `error`, its sequence is freed unless `keep`."""

    request: Request
    error: GenerationError | None = None
    keep: bool = False
    reason: str | None = None                # its finish reason when it ends without an error


MODEL_WIDE = "\0model"        # in StepAttempt.over_quota: the model's max was reached, not one tenant's


@dataclass(frozen=True, slots=True)
class Requeued:
    """A preempted request waits again, ahead of every later arrival."""

    request: Request


@dataclass(frozen=True, slots=True)
class StartedOver:
    """memd freed the request's sequence: it is a new request again, in its place in the queue."""

    request: Request


@dataclass(frozen=True, slots=True)
class Unforked:
    """n > 1: a child memd had no page for: its Fork goes again in the next Step, its parent waiting with it."""

    request: Request


@dataclass(frozen=True, slots=True)
class Queued:
    """An op for the next Step (a release, a distrust sent again)."""

    op: End | Distrust


Outcome = Ended | Requeued | StartedOver | Unforked | Queued


def release(request: Request, final: Event) -> End | None:
    """How a preempted request that ends before it runs again gives its sequence back: memd still holds
    a sequence without a session (its Free releases `final`); a session's preempted turn stays parked, and
    a request memd forgot holds nothing (None: `final` goes to the client now)."""
    if request.status is RequestStatus.PREEMPTED and request.seq.held and request.session_id is None:
        return End(request, final, Free(request.seq.id))
    return None


@dataclass(eq=False)
class StepAttempt:
    """A Step on its way through memd, and what the ops it refused leave for the iteration."""

    ops: list[PendingOp]              # shrinks as memd refuses ops; the scheduler's `_inflight` is this very list
    stalled: set[Request] = field(default_factory=set)       # running sequences memd had no page for
    requeued: list[Request] = field(default_factory=list)    # admissions to put back at the head of the queue
    # Tenants ("" for none) memd refused pages at their max (or their model's): their requests wait on their own.
    over_quota: set[str] = field(default_factory=set)

    def refused_pages(self, request: Request, err: MemdError) -> None:
        """memd had no page for `request`: at its tenant's max (reason "quota"), its model's ("model_quota":
        every tenant of this worker waits), or the pool's."""
        if err.reason in ("quota", "model_quota"):
            self.over_quota.add(request.tenant or "" if err.reason == "quota" else MODEL_WIDE)
            request.quota_since = request.quota_since or time.monotonic()     # its wait there began


class PendingOp:
    """One memd op of a Step and its owner; subclasses are frozen dataclasses with an `op` field."""

    __slots__ = ()
    op: Op

    def retry(self, err: MemdError) -> PendingOp | None:
        """What to send in this op's place after memd refused it with `err`; None takes it out of the Step."""
        return None

    def applied(self, worker: OpContext, result: OpResult) -> Outcome | None:
        return None

    def refused(self, err: MemdError, step: StepAttempt) -> Outcome | list[Outcome] | None:
        return None


def _error(err: MemdError, prefix: str = "") -> GenerationError:
    return GenerationError(err.code, prefix + err.message, err.reason)


@dataclass(frozen=True, eq=False, slots=True)
class Admit(PendingOp):
    """A waiting request's Open (new, or a preempted one memd forgot) or Resume (a preempted one memd holds)."""

    request: Request
    op: Open | Resume

    def retry(self, err: MemdError) -> PendingOp | None:
        if err.reason == "quota_size" and self.op.reserve > 1:     # its lookahead past its tenant's max: no lookahead
            return Admit(self.request, replace(self.op, reserve=1))
        return None

    def applied(self, worker: OpContext, result: OpResult) -> Outcome | None:
        request = self.request
        request.quota_since = 0.0                      # admitted: a wait at its tenant's max, if any, is over
        if worker.audit is not None:
            worker.audit.forget(id(request))           # a new table: its positions are taken as found when it runs
        block_size = worker.page_sums.block_size
        if request.status is RequestStatus.PREEMPTED:            # the rest of its history is recomputed
            request.seq.placed(result, list(result.token_ids) if result.token_ids else request.seq.tokens,
                               block_size)
            return None
        # A session's history (memd's tokens then this turn's, or with whole_history the conversation as sent,
        # memd having kept only the prefix its history shared with it): usage counts all of it as prompt, and
        # what memd had committed as cached; computing resumes from there.
        request.seq.placed(result, list(result.token_ids) if result.token_ids else list(request.prompt_ids),
                           block_size)
        request.num_cached = result.num_committed
        request.num_prompt = len(request.seq.tokens)
        limit = worker.max_position
        if request.whole_history and request.seq.tokens != request.prompt_ids:
            # A memd without whole_history takes the conversation as a new turn, appended to the old one:
            # answering from that would answer a conversation the client never sent. Free it, and fail.
            log.error("memd's history is not the conversation sent", request=request.request_id,
                      session=request.session_id, sent=len(request.prompt_ids), memd=len(request.seq.tokens))
            return Ended(request, GenerationError(
                StatusCode.FAILED_PRECONDITION, f"session {request.session_id!r}: memd kept a history of "
                f"{len(request.seq.tokens)} tokens for a conversation of {len(request.prompt_ids)}; "
                "does this memd take whole_history?"))
        if len(request.seq.tokens) >= limit:                 # a session's history can outgrow the model
            return Ended(request, GenerationError(
                StatusCode.INVALID_ARGUMENT, f"session {request.session_id!r} holds {len(request.seq.tokens)} tokens "
                f"with this message; the model has {limit} positions: reset the session"), keep=True)
        return None

    def refused(self, err: MemdError, step: StepAttempt) -> Outcome | None:
        request = self.request
        preempted = request.status is RequestStatus.PREEMPTED
        if err.code is StatusCode.RESOURCE_EXHAUSTED and err.reason != "retention":
            step.requeued.append(request)            # back to the head of the queue, in order
            step.refused_pages(request, err)
        elif preempted and err.code is StatusCode.NOT_FOUND and request.session_id is None:
            request.seq.forgotten()                  # forgotten while it waited: recompute it all
            step.requeued.append(request)
        else:
            final = Event([], "", usage=request.usage(), error=_error(err), index=request.index)
            end = release(request, final)
            request.seq.finished()
            if end is not None:
                return Queued(end)
            request.events.put_nowait(final)
        return None


@dataclass(frozen=True, eq=False, slots=True)
class Grow(PendingOp):
    """A running sequence's Extend: its new tokens, its commit, and pages for the next pass (and lookahead)."""

    request: Request
    op: Extend

    def retry(self, err: MemdError) -> PendingOp | None:
        if (err.code is StatusCode.RESOURCE_EXHAUSTED or err.reason == "quota_size") and self.op.reserve > 1:
            return Grow(self.request, replace(self.op, reserve=1))    # the lookahead can wait
        return None

    def applied(self, worker: OpContext, result: OpResult) -> Outcome | None:
        request = self.request
        if result.first_block != len(request.seq.table) or result.num_committed != request.seq.computed:
            # memd's table or committed length is not the one this worker computed against: the K/V
            # the next pass would read cannot be trusted. Fail the turn rather than answer it wrong.
            log.error("memd and this worker disagree about a sequence", request=request.request_id,
                      seq=request.seq.id, blocks=len(request.seq.table), memd_first_block=result.first_block,
                      computed=request.seq.computed, memd_committed=result.num_committed)
            return Ended(request, GenerationError(
                StatusCode.INTERNAL, f"sequence {request.seq.id}: memd's block table or committed length differs "
                "from this worker's; the turn is failed rather than answered from unknown K/V"))
        request.seq.grew(result)
        return None

    def refused(self, err: MemdError, step: StepAttempt) -> Outcome | None:
        self.request.seq.untold(len(self.op.append))          # memd did not take them
        PageSums.unsent(self.request, self.op.sums_from, self.op.page_sums)
        if err.code is StatusCode.RESOURCE_EXHAUSTED:
            step.stalled.add(self.request)
            step.refused_pages(self.request, err)
            return None
        if err.reason == "quota_size":            # as long as its tenant's max allows: a length stop, kept
            return Ended(self.request, keep=True, reason="length")
        return Ended(self.request, _error(err))


@dataclass(frozen=True, eq=False, slots=True)
class CommitForFork(PendingOp):
    """n > 1: the parent's Extend that commits its prompt, so that memd forks all of it."""

    parent: Request
    op: Extend

    def refused(self, err: MemdError, step: StepAttempt) -> list[Outcome]:
        """No prompt to fork from: its children's Forks leave the Step and the children fail."""
        PageSums.unsent(self.parent, self.op.sums_from, self.op.page_sums)
        dropped = [p for p in step.ops if isinstance(p, ForkChild) and p.request in self.parent.children]
        step.ops[:] = [p for p in step.ops if p not in dropped]
        return [Ended(fork.request, _error(err)) for fork in dropped]


@dataclass(frozen=True, eq=False, slots=True)
class ForkChild(PendingOp):
    """n > 1: a child's Fork of its parent's prompt."""

    request: Request
    op: Fork

    def applied(self, worker: OpContext, result: OpResult) -> Outcome | None:
        request = self.request
        if worker.audit is not None:
            worker.audit.forget(id(request))           # a new table: its positions are taken as found when it runs
        # memd knows the prompt it forked, not the child's own first token
        request.seq.placed(result, request.seq.tokens, worker.page_sums.block_size, told=result.num_committed)
        return None

    def refused(self, err: MemdError, step: StepAttempt) -> Outcome | None:
        if err.code is StatusCode.RESOURCE_EXHAUSTED:
            step.refused_pages(self.request, err)
            return Unforked(self.request)              # no page for its copy yet: the parent waits with it
        return Ended(self.request, _error(err))


@dataclass(frozen=True, eq=False, slots=True)
class End(PendingOp):
    """An ended request's Park (a session keeps its turn) or Free; its final event waits for memd's answer."""

    request: Request
    final: Event
    op: Park | Free

    def retry(self, err: MemdError) -> PendingOp | None:
        if isinstance(self.op, Free) and (self.op.append or self.op.commit_to):
            # Its last progress was refused (memd no longer agrees it runs here): free it all the same.
            return End(self.request, self.final, Free(self.op.seq_id, self.op.session_id))
        return None

    def applied(self, worker: OpContext, result: OpResult) -> Outcome | None:
        self.request.events.put_nowait(self.final)
        return None

    def refused(self, err: MemdError, step: StepAttempt) -> Outcome | None:
        log.warning("memd refused to release a sequence", error=str(err))
        self.request.events.put_nowait(self.final)
        return None


@dataclass(frozen=True, eq=False, slots=True)
class ResetSession(PendingOp):
    """A session reset's Free; `done` answers the caller of `Scheduler.reset`."""

    done: asyncio.Future[None]
    op: Free

    def applied(self, worker: OpContext, result: OpResult) -> Outcome | None:
        if not self.done.done():                     # its caller may have gone away
            self.done.set_result(None)
        return None

    def refused(self, err: MemdError, step: StepAttempt) -> Outcome | None:
        if not self.done.done():
            self.done.set_exception(_error(err))
        return None


@dataclass(frozen=True, eq=False, slots=True)
class Preempt(PendingOp):
    """A running request's Park with `preempt`: memd swaps its sequence out (or drops it) to free pages."""

    request: Request
    op: Park

    def applied(self, worker: OpContext, result: OpResult) -> Outcome | None:
        if worker.audit is not None:
            worker.audit.forget(id(self.request))      # a new table: its positions are taken as found when it runs
        self.request.seq.pages_given_up()
        return Requeued(self.request)

    def refused(self, err: MemdError, step: StepAttempt) -> Outcome | None:
        return Ended(self.request, _error(err, "preemption failed: "))


@dataclass(frozen=True, eq=False, slots=True)
class Distrust(PendingOp):
    """--verify-reuse found a prefix hit's K/V different: free the sequence, those blocks leave the prefix
    cache, and the request starts over (it computes them itself this time)."""

    request: Request
    op: Free

    def applied(self, worker: OpContext, result: OpResult) -> Outcome | None:
        return StartedOver(self.request)

    def refused(self, err: MemdError, step: StepAttempt) -> Outcome | None:
        log.warning("memd refused to take distrusted blocks out of its prefix cache", error=str(err),
                    request=self.request.request_id)
        if self.op.distrusted:               # free the sequence all the same, then start over
            return Queued(Distrust(self.request, Free(self.op.seq_id)))
        return StartedOver(self.request)     # memd holds no such sequence (anymore)
