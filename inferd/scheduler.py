"""Continuous batching over memd's pool: requests join and leave at every step.

One iteration: (1) one memd Step carrying every page operation the iteration
needs — park or free what finished, open (or continue) the sessions being
admitted, extend sequences about to cross a block boundary — made only when
there is such an operation; (2) one forward pass over every running
sequence's pending tokens (decodes first, then prefill chunks, within a token
budget) and its sampling, both on the forward thread (`inferd.forward_thread`),
which may have run that pass already, ahead, while the loop streamed the last
one's tokens; (3) stop checks, and events to the requests' queues.

Every way a request ends — finish, stop string, cancel, reset, error — goes
through `_end`, which queues its Park (a session's turn) or Free for the next
Step: no path leaves a sequence RUNNING on memd.

Memory pressure: memd itself evicts cold PARKED sequences when a Step is
short of pages, so a refusal (RESOURCE_EXHAUSTED) means the pages are held by
running sequences. Then the worker preempts its own, latest arrival first, as
vLLM does: a Park with `preempt` makes memd swap the sequence out (or drop it
when swap is full, and the worker recomputes), and the request waits at the
head of the queue to be resumed. An operator's eviction of a running sequence
arrives as a revocation and is answered the same way. No request fails for
want of memory that a later step can serve.

A refusal at a tenant's page max (reason "quota", memd.quotas) is the
tenant's alone: memd already evicted that tenant's own parked sequences, so
the worker preempts that tenant's latest running arrival, and its waiting
requests step aside for the others' until one of its requests ends here (or
QUOTA_RETRY_S passes).

A request goes WAITING -> RUNNING (<-> PREEMPTED) -> FINISHED (`inferd.requests`);
what each op of a Step does with memd's answer, or its refusal, is in `inferd.memd_ops`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from dataclasses import replace
from typing import Any, assert_never

import structlog
import torch
from grpc import StatusCode
from tokenizers.decoders import DecodeStream

from inferd.backlog import Backlog
from inferd.forward_thread import Ahead, ForwardThread, Sampling
from inferd.kv_audit import KvAudit
from inferd.memd_ops import (
    MODEL_WIDE,
    Admit,
    CommitForFork,
    Distrust,
    End,
    Ended,
    ForkChild,
    Grow,
    Outcome,
    PendingOp,
    Preempt,
    Queued,
    Requeued,
    ResetSession,
    StartedOver,
    StepAttempt,
    Unforked,
    release,
)
from inferd.model import PagedDecoder, build_batch
from inferd.page_sums import PageSums
from inferd.prefix_wait import held_blocks, leading, waits_for
from inferd.progress import SeqProgress
from inferd.requests import CancelReason, Event, GenerationError, Request, RequestStatus, TokenLogprob
from inferd.reuse_check import ReuseCheck
from inferd.sampling import sample, token_logprobs
from shared.client import MemdClient, MemdError
from shared.ops import Extend, Fork, Free, Open, Park, Resume

__all__ = ["DRAINING", "Event", "GenerationError", "Request", "RequestStatus", "Scheduler", "TokenLogprob"]

log = structlog.get_logger("inferd.scheduler")

IDLE_POLL_S = 0.05     # how often waiting requests re-check memd's free pages when nothing else runs
# How long a tenant memd refused at its max waits before its requests are tried again, unless one of its
# requests here ends first (its pages may come back on another worker, or by memd's own evictions).
QUOTA_RETRY_S = 0.25

DRAINING = "this worker is draining (memctl drain): send the request to another worker"


class Scheduler:
    def __init__(self, client: MemdClient, model: PagedDecoder, tokenizer: Any, *, max_num_seqs: int = 16,
                 max_batch_tokens: int = 2048, prefill_beside_decode: int = 512, lookahead_blocks: int = 4,
                 audit_kv: bool = False, verify_reuse: float = 0.0, quota_wait_s: float = 30.0) -> None:
        self.client, self.model, self.tokenizer = client, model, tokenizer
        self.block_size = client.geometry.block_size
        self.max_num_seqs, self.max_batch_tokens = max_num_seqs, max_batch_tokens
        # Prompt tokens a pass takes beside decode rows: a running stream's next token waits for at most
        # that much prefill, while a pass of prompts alone (a burst of new users) takes the whole budget.
        self.prefill_beside_decode = min(prefill_beside_decode, max_batch_tokens)
        # Pages asked for ahead of need: a sequence then calls memd once per this many
        # blocks instead of at every block boundary (never past its max_tokens).
        self.lookahead = lookahead_blocks * self.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._backlog = Backlog()                        # page operations owed to memd's next Step
        # The Step memd is applying now: its requests are in no other list meanwhile.
        self._inflight: list[PendingOp] = []
        self._wake = asyncio.Event()
        self._wanted = 0                                 # free blocks the head of the queue waits for
        # Tenants at their page max (memd.quotas), since when: their waiting requests let others pass.
        self._over_quota: dict[str, float] = {}
        self.quota_wait_s = quota_wait_s                 # then a request waiting there fails (--quota-wait)
        self.preemptions = 0
        self.draining = False                            # an operator's drain: admit nothing new
        self.carried: list[Request] = []                 # unstarted when memd failed: for the next attachment
        client.on_revoke = self._on_revoke
        self.audit = KvAudit(model.kv) if audit_kv else None     # --audit-kv
        self.page_sums = PageSums(client.pool.pages if client.pool is not None else None, self.block_size)
        self.reuse_check = ReuseCheck(model, verify_reuse, chunk_tokens=max_batch_tokens) \
            if verify_reuse else None                                                     # --verify-reuse
        self.forward_thread = ForwardThread(model)

    # ---- the outside ---------------------------------------------------

    def submit(self, request: Request) -> None:
        if self.draining:
            raise GenerationError(StatusCode.UNAVAILABLE, DRAINING)
        request.params.check()
        limit = self.model.config.max_position
        if len(request.prompt_ids) + request.params.max_tokens > limit:
            raise GenerationError(StatusCode.INVALID_ARGUMENT, f"prompt of {len(request.prompt_ids)} tokens plus "
                                  f"max_tokens {request.params.max_tokens} exceeds the model's {limit} positions")
        if not request.prompt_ids:
            raise GenerationError(StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        pool = self.client.geometry.num_blocks
        if math.ceil((len(request.prompt_ids) + 1) / self.block_size) > pool:
            raise GenerationError(StatusCode.INVALID_ARGUMENT, f"a prompt of {len(request.prompt_ids)} tokens does "
                                  f"not fit the KV pool ({pool} blocks of {self.block_size} tokens)")
        if request.params.n > 1 and request.session_id:
            raise GenerationError(StatusCode.INVALID_ARGUMENT, "n > 1 cannot continue a session: which completion "
                                  "would be its history?")
        if request.whole_history and not request.session_id:
            raise GenerationError(StatusCode.INVALID_ARGUMENT, "whole_history names a session's whole conversation: "
                                  "give its session_id")
        if request.params.seed is not None:
            request.generator = torch.Generator().manual_seed(request.params.seed)
        self.waiting.append(request)
        self._wake.set()

    def drain(self, on: bool) -> None:
        """An operator's drain: requests that have not started fail (a balancer retries them elsewhere),
        new ones are refused, and running ones finish — preempted ones too, as they were running."""
        self.draining = on
        if not on:
            return
        for request in [r for r in self.waiting if r.status is RequestStatus.WAITING]:
            self.waiting.remove(request)
            request.fail(GenerationError(StatusCode.UNAVAILABLE, DRAINING))

    def cancel(self, request: Request, reason: CancelReason = "cancelled") -> None:
        request.cancel(reason)
        self._wake.set()

    async def reset(self, session_id: str) -> None:
        """Forget a session's KV: a turn in flight ends ("reset"), then memd frees the sequence.

        Raises GenerationError NOT_FOUND when memd has no such session.
        """
        preempting = [p.request for p in self._backlog.preempting]
        for request in [*self.waiting, *self.running, *self._inflight_requests(), *preempting]:
            if request.session_id == session_id:
                request.cancel("reset")
        done = asyncio.get_running_loop().create_future()
        self._backlog.resets.append(ResetSession(done, Free(session_id=session_id)))
        self._wake.set()
        await done

    def _inflight_requests(self) -> list[Request]:
        taking = [p.request for p in self._inflight if isinstance(p, Admit | ForkChild | Grow | Preempt | Distrust)]
        return taking + [p.request for p in self._inflight if isinstance(p, End)]

    def _on_revoke(self, seq_id: int, reason: str) -> None:
        self._backlog.revoked.add(seq_id)
        self._wake.set()

    async def run(self) -> None:
        """Serve until memd fails as a whole (not one op), or a bug: every request fails, the error rises."""
        while True:
            if not (self.waiting or self.running or self._backlog):
                self._wake.clear()
                await self._wake.wait()
            try:
                if not await self.iteration():
                    await self._idle()
            except MemdError as err:
                # The same words as when the lease is seen lost first: which of the two notices a dead
                # memd first is a race, and a client should not see two stories for one event.
                gone = GenerationError(StatusCode.UNAVAILABLE,
                                       f"memd went away ({err.message}); the worker is reconnecting")
                self.carried += self.fail_all(gone, keep_unstarted=True)
                raise
            except Exception as err:
                log.exception("scheduler failed")
                self.fail_all(GenerationError(StatusCode.INTERNAL, f"the scheduler failed: {err}"))
                raise

    async def _idle(self) -> None:
        """Requests wait for pages that other workers hold: nap until woken, then ask memd how many are free."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
        await self.client.step(wanted_blocks=self._wanted)   # only the free-page count comes back

    def fail_all(self, error: GenerationError, *, keep_unstarted: bool = False) -> list[Request]:
        """memd is gone (or the scheduler broke): requests and resets fail; memd reclaims with the lease.

        `keep_unstarted`: requests that never reached memd (queued, nothing
        generated) do not fail: they are returned, to wait for the next
        attachment (`adopt`); they hold nothing that memd's going could lose.
        """
        kept = [r for r in self.waiting if r.status is RequestStatus.WAITING and not r.generated
                and not r.cancelled and r.fork_of is None] if keep_unstarted else []
        for request in kept:
            self.waiting.remove(request)
        pending = self._backlog.requests() + self._inflight_requests()
        failed: set[int] = set()
        for request in [*self.waiting, *self.running, *pending]:
            if id(request) not in failed:
                failed.add(id(request))
                request.fail(error)
        resets = [*self._backlog.resets, *(p for p in self._inflight if isinstance(p, ResetSession))]
        for reset in resets:
            if not reset.done.done():
                reset.done.set_exception(error)
        self.waiting.clear()
        self.running.clear()
        self._backlog.clear()
        self._wanted = 0
        self._inflight = []
        return kept

    def adopt(self, requests: list[Request]) -> None:
        """Queue requests an earlier attachment kept (`fail_all(keep_unstarted=True)`), in arrival order."""
        self.waiting.extend(requests)
        if requests:
            self._wake.set()

    async def close(self) -> None:
        """Let a forward pass in flight finish (it writes into pages memd may hand out next), then stop."""
        await self.forward_thread.close()

    # ---- one iteration -------------------------------------------------

    async def iteration(self) -> bool:
        """One scheduler step; False when it could do nothing at all (no memd op, no forward pass)."""
        self._retire_cancelled()
        self._take_revocations()
        preempted = bool(self._backlog.preempting)
        if preempted:
            await self._memd_step(list(self._backlog.preempting))
            self._backlog.preempting = []
            self._retire_cancelled()          # a reset or cancel that came while memd swapped them out
        ops, forks = self._fork_ops()
        ops += self._backlog.ending
        ops += self._backlog.resets
        ops += self._backlog.distrusts
        self._backlog.ending, self._backlog.resets, self._backlog.distrusts = [], [], []
        growing = 0                                         # running sequences first, then newcomers
        bs = self.block_size
        for request in self.running:
            needed = len(request.seq.tokens)                    # positions this pass writes up to
            grows = needed > len(request.seq.table) * bs
            # A prompt's blocks are committed as its prefill computes them, not at its first growth: others
            # opening the same prefix find them then (inferd.prefix_wait).
            if grows or min(request.seq.computed, request.num_prompt) // bs > request.seq.committed // bs:
                extend = Extend(request.seq.id, append=request.seq.tell(), commit_to=request.seq.computed,
                                reserve=self._reserve(request) if grows else 0, **self.page_sums.commit(request))
                ops.append(Grow(request, extend))
                if grows:
                    growing += math.ceil((needed + extend.reserve) / bs) - len(request.seq.table)
        admitted = self._admit(ops, self.client.free_blocks - growing)
        step = await self._memd_step(ops, self._wanted)
        stalled = step.stalled
        # A preempted request whose Resume memd refused is back at the head of the queue, still preempted
        # (and still naming its sequence): it runs only once a Resume succeeds.
        self.running += [r for r in admitted + forks if r.status is RequestStatus.RUNNING]
        if self.reuse_check is not None:
            await self._check_reuse(admitted)
        at_max_forks = [c for c in self._backlog.unforked if self._refused_at_max(c, step)]
        unforked = self._refork()
        holding = {id(parent) for parent, _, _ in self._backlog.forks}      # a parent decodes once its children forked
        ready = [r for r in self.running if r not in stalled and id(r) not in holding
                 and len(r.seq.tokens) <= len(r.seq.table) * self.block_size]
        if ready:
            await self._forward(ready)
        else:
            await self.forward_thread.drop_ahead()
        if stalled or unforked:
            stalled_here = [r for r in stalled if r in self.running]
            at_max = [r for r in stalled_here if self._refused_at_max(r, step)]
            self._preempt_within_quota({r.tenant or "" for r in [*at_max, *at_max_forks]})
            self._preempt_for([r for r in stalled_here if r not in at_max], extra=unforked - len(at_max_forks))
        return bool(ops or ready or preempted or self._backlog.preempting)      # ops: those memd applied

    async def _check_reuse(self, admitted: list[Request]) -> None:
        """--verify-reuse: recompute the cached prefix of a chosen few new requests and compare it."""
        check = self.reuse_check
        assert check is not None
        for request in admitted:
            if request not in self.running or request.session_id is not None or request.generated \
                    or not check.chosen(request.num_cached):
                continue
            try:
                bad = await self.forward_thread.run(check.first_mismatch, request.seq.tokens, request.seq.table,
                                                    request.num_cached, tokens=request.num_cached)
            except Exception as exc:          # a check that cannot run (out of memory, say) fails no request
                log.warning("could not recompute a prefix hit to check it", request=request.request_id,
                            error=str(exc))
                continue
            if bad is None:
                continue
            blocks = list(range(bad, request.num_cached // self.block_size))
            log.error("cached K/V differs from a recompute: it leaves memd's prefix cache and the request starts "
                      "over", request=request.request_id, seq=request.seq.id,
                      blocks=[request.seq.table[i] for i in blocks])
            self.running.remove(request)
            self._backlog.distrusts.append(Distrust(request, Free(request.seq.id, distrusted=blocks)))

    def _start_over(self, request: Request) -> None:
        """A new request again, in its place in the queue (memd freed its sequence)."""
        request.seq.started_over()
        request.num_cached = 0
        self._requeue(request)

    def _refork(self) -> int:
        """Children memd could not give a page: their Fork goes again in the next Step."""
        groups: dict[int, tuple[Request, list[Request]]] = {}
        for child in self._backlog.unforked:
            if child.fork_of is not None and child.status is not RequestStatus.FINISHED:
                groups.setdefault(id(child.fork_of), (child.fork_of, []))[1].append(child)
        self._backlog.forks += [(parent, Extend(parent.seq.id), group) for parent, group in groups.values()]
        count, self._backlog.unforked = len(self._backlog.unforked), []
        return count

    def _preempt_for(self, stalled: list[Request], extra: int = 0) -> None:
        """Running sequences (and `extra` forks) cannot get pages: preempt the latest arrivals for the shortfall."""
        bs = self.block_size
        need = {id(r): math.ceil((len(r.seq.tokens) + 1) / bs) - len(r.seq.table) for r in stalled}
        short = sum(need.values()) + extra - self.client.free_blocks
        forking = {id(parent) for parent, _, _ in self._backlog.forks}
        for victim in sorted(self.running, key=lambda r: r.arrived, reverse=True):
            if short <= 0:
                break
            if id(victim) in forking:
                continue                                     # its children fork from it in the next Step
            short -= len(victim.seq.table) + need.get(id(victim), 0)
            self._preempt(victim)

    @staticmethod
    def _refused_at_max(request: Request, step: StepAttempt) -> bool:
        return (request.tenant or "") in step.over_quota or MODEL_WIDE in step.over_quota

    def _preempt_within_quota(self, tenants: set[str]) -> None:
        """Tenants memd refused a page for a running request (or a fork) at their max: each gives up its own
        latest arrival (no other tenant's request pays for it; at the model's max, the latest of any), one per
        iteration, as memd says how far over it is only by refusing again."""
        if not tenants:
            return
        forking = {id(parent) for parent, _, _ in self._backlog.forks}
        model_wide = MODEL_WIDE in self._over_quota
        for tenant in {MODEL_WIDE} if model_wide else tenants:
            own = [r for r in self.running if (model_wide or (r.tenant or "") == tenant) and id(r) not in forking]
            if own:
                self._preempt(max(own, key=lambda r: r.arrived))

    def _at_max(self, request: Request) -> bool:
        """Its tenant was refused at its max a moment ago and has not given a page back here since."""
        if not self._over_quota:
            return False
        for key in (request.tenant or "", MODEL_WIDE):
            since = self._over_quota.get(key)
            if since is not None and time.monotonic() - since < QUOTA_RETRY_S:
                return True
            self._over_quota.pop(key, None)
        return False

    def _out_of_patience(self, request: Request) -> bool:
        """A request that has waited `quota_wait_s` at its tenant's max (since memd first refused it there) fails
        (a 429): its tenant's own pages (running elsewhere, promised) are not coming back for it soon. True if it
        was failed."""
        if not request.quota_since or time.monotonic() - request.quota_since < self.quota_wait_s:
            return False
        error = GenerationError(StatusCode.RESOURCE_EXHAUSTED, f"waited {self.quota_wait_s:g} s at its tenant's page "
                                "max (memctl quota); try again later", "quota")
        final = Event([], "", usage=request.usage(), error=error, index=request.index)
        if (end := release(request, final)) is not None:
            self._backlog.ending.append(end)
        else:
            request.events.put_nowait(final)
        request.seq.finished()
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.seq.preempting()
        request.preemptions += 1
        self.preemptions += 1
        park = Park(request.seq.id, append=request.seq.tell(), commit_to=request.seq.computed,
                    preempt=True)                                       # its page sums: `_summed`
        self._backlog.preempting.append(Preempt(request, park))
        log.info("preempting", request=request.request_id, session=request.session_id, seq=request.seq.id,
                 tokens=len(request.seq.tokens), computed=request.seq.computed)

    def _take_revocations(self) -> None:
        """memd revoked sequences (an operator evicted them): preempt those running here."""
        if not self._backlog.revoked:
            return
        forking = {parent.seq.id for parent, _, _ in self._backlog.forks}     # its children fork from it first
        for request in [r for r in self.running if r.seq.id in self._backlog.revoked and r.seq.id not in forking]:
            self._preempt(request)
        self._backlog.revoked &= forking           # preempted once forked; the others ended already

    def _fork_ops(self) -> tuple[list[PendingOp], list[Request]]:
        """Forks of n > 1 requests go first in the Step, before anything frees their parent."""
        ops: list[PendingOp] = []
        children: list[Request] = []
        for parent, commit, group in self._backlog.forks:
            for child in group:
                if child.cancelled and child.status is not RequestStatus.FINISHED:
                    self._end(child, reason=child.cancel_reason)
            live = [c for c in group if c.status is not RequestStatus.FINISHED]
            if live:
                ops.append(CommitForFork(parent, commit))
                ops += [ForkChild(child, Fork(parent.seq.id)) for child in live]
                children += live
        self._backlog.forks = []
        return ops, children

    def _retire_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            final = Event([], "", finish_reason=request.cancel_reason, usage=request.usage(), index=request.index)
            if (end := release(request, final)) is not None:
                self._backlog.ending.append(end)
            else:
                request.events.put_nowait(final)
            request.seq.finished()
        for request in [r for r in self.running if r.cancelled]:
            self._end(request, reason=request.cancel_reason)

    def _admit(self, ops: list[PendingOp], budget: int) -> list[Request]:
        """Open or resume waiting requests in arrival order while seats and pages last; a new prompt whose
        leading blocks a running request is computing now waits for them, and those behind it go first."""
        admitted: list[Request] = []
        seats = self.max_num_seqs - len(self.running)
        self._wanted = 0
        leaders = leading(self.running, self.block_size)
        followers = []
        while self.waiting and self._seats(self.waiting[0]) <= seats:
            request = self.waiting[0]
            behind_leader = request.status is RequestStatus.WAITING and waits_for(request.prompt_ids, leaders,
                                                                                  self.block_size)
            if behind_leader:
                followers.append(self.waiting.popleft())         # waits; those behind it go first
                continue
            if self._out_of_patience(request):
                self.waiting.popleft()
                continue
            if self._at_max(request):
                self.waiting.popleft()
                followers.append(request)                        # waits at its tenant's max; others go first
                continue
            need = math.ceil((len(request.seq.tokens or request.prompt_ids) + self._reserve(request)) / self.block_size)
            held = held_blocks(request.prompt_ids, self.running, self.block_size) \
                if request.status is RequestStatus.WAITING else 0
            need -= held
            if need > budget:
                # Wait for pages; memd evicts cold parked sequences to make them.
                self._wanted = self.client.free_blocks + need - budget
                break
            budget -= need
            seats -= self._seats(request)
            self.waiting.popleft()
            admitted.append(request)
            ops.append(Admit(request, self._admission(request)))
            if request.status is RequestStatus.WAITING:
                # Opened in this Step: what it will hold committed is what memd's prefix match hands it. A
                # prompt behind it that shares no more than that (the same system prompt) does not wait.
                leaders.append((request.prompt_ids, held * self.block_size))
        self.waiting.extendleft(reversed(followers))         # still first in the queue, in arrival order
        return admitted

    @staticmethod
    def _seats(request: Request) -> int:
        """n > 1: its forks will need seats too, unless it was preempted after forking them."""
        return 1 if request.status is RequestStatus.PREEMPTED and request.generated else request.params.n

    def _admission(self, request: Request) -> Open | Resume:
        reserve = self._reserve(request)
        preempted = request.status is RequestStatus.PREEMPTED
        if preempted and request.seq.held:
            return Resume(request.seq.id, reserve=reserve)    # swapped back in, or recomputed if dropped
        if preempted:                                       # memd forgot it: start over from the history
            return Open(request.seq.tokens, reserve=reserve, cache_salt=request.cache_salt, tenant=request.tenant)
        return Open(request.prompt_ids, reserve=reserve, session_id=request.session_id,
                    continue_session=request.session_id is not None, turn_id=request.turn_id,
                    whole_history=request.whole_history, cache_salt=request.cache_salt, tenant=request.tenant,
                    retain_s=request.retain_s)

    def _reserve(self, request: Request) -> int:
        """Writable positions to ask for past the known tokens: the lookahead, capped by what may still come.

        A preempted request asks for one: it ran without lookahead before it gave way, and must not
        come back needing more than it had.
        """
        if request.status is RequestStatus.PREEMPTED:
            return 1
        return max(1, min(self.lookahead, request.params.max_tokens - len(request.generated)))

    async def _memd_step(self, ops: list[PendingOp], wanted_blocks: int = 0) -> StepAttempt:
        """Run the iteration's page operations as one Step; an op memd refuses is taken out and the rest retried.

        Returns what memd left to do: the running requests it had no page for, the tenants it refused at their max.
        """
        if ops:
            await self.forward_thread.drop_ahead()         # its pass writes into pages these ops may change
            ops[:] = [self._summed(pending) for pending in ops]
        step = StepAttempt(ops)
        self._inflight = ops
        try:
            await self._memd_step_rounds(step, wanted_blocks)
        except BaseException:
            self.waiting.extendleft(reversed(step.requeued))      # fail_all finds them there
            raise
        self._inflight = []
        self.waiting.extendleft(reversed(step.requeued))          # back to the head of the queue, in order
        now = time.monotonic()
        self._over_quota.update(dict.fromkeys(step.over_quota, now))
        return step

    def _summed(self, pending: PendingOp) -> PendingOp:
        """A Park gets its page sums as it is sent, not when it was queued: a pass the forward thread ran
        ahead may have been writing the partly filled last page until `drop_ahead` returned."""
        op = pending.op
        if isinstance(op, Park) and not op.page_sums and isinstance(pending, End | Preempt):
            sums = self.page_sums.commit(pending.request, parks=True)
            if sums:
                return replace(pending, op=replace(op, **sums))
        return pending

    async def _memd_step_rounds(self, step: StepAttempt, wanted_blocks: int) -> None:
        ops = step.ops
        while ops:
            try:
                results = await self.client.step(*[pending.op for pending in ops], wanted_blocks=wanted_blocks)
            except MemdError as err:
                if err.op_index is None:
                    raise
                rejected = ops[err.op_index]
                retry = rejected.retry(err)
                if retry is not None:
                    ops[err.op_index] = retry
                    continue
                ops.pop(err.op_index)
                outcome = rejected.refused(err, step)
                for each in outcome if isinstance(outcome, list) else [outcome]:
                    self._apply(each)
                continue
            for pending, result in zip(ops, results, strict=True):
                self._apply(pending.applied(self, result))
            break

    def _apply(self, outcome: Outcome | None) -> None:
        """What an op of a Step asks of the scheduler once memd has answered it (`inferd.memd_ops`)."""
        match outcome:
            case None:
                pass
            case Ended(request, error, keep, reason):
                self._end(request, reason=reason, error=error, keep=keep)
            case Requeued(request):
                self._requeue(request)
            case StartedOver(request):
                self._start_over(request)
            case Unforked(request):
                self._backlog.unforked.append(request)
            case Queued(End() as end):
                self._backlog.ending.append(end)
            case Queued(Distrust() as distrust):
                self._backlog.distrusts.append(distrust)
            case _:
                assert_never(outcome)

    @property
    def max_position(self) -> int:
        """Positions the model has: a history at or past it cannot take another token."""
        return self.model.config.max_position

    def _requeue(self, request: Request) -> None:
        """A preempted request waits ahead of every later arrival (a cancel meanwhile is retired from there)."""
        index = 0
        while index < len(self.waiting) and self.waiting[index].arrived <= request.arrived:
            index += 1
        self.waiting.insert(index, request)
        self._wake.set()

    async def _forward(self, ready: list[Request]) -> None:
        decodes = sum(len(r.seq.tokens) - r.seq.computed == 1 for r in ready)
        budget = min(self.max_batch_tokens, decodes + self.prefill_beside_decode) if decodes else \
            self.max_batch_tokens
        chunks: list[tuple[Request, list[int]]] = []
        for request in sorted(ready, key=lambda r: len(r.seq.tokens) - r.seq.computed):   # decodes first
            pending = request.seq.tokens[request.seq.computed:]
            take = pending[:max(budget, 1 if not chunks else 0)]
            if not take:
                break
            chunks.append((request, take))
            budget -= len(take)
        if self.audit is not None:
            chunks = self._audited(chunks)
            if not chunks:
                return
        owners = [r for r, _ in chunks]
        if all(len(take) == 1 for _, take in chunks) and self.forward_thread.take_ahead(
                owners, [r.seq.computed for r in owners], [take[0] for _, take in chunks]):
            sampled = await self.forward_thread.taken()       # the forward thread ran this pass already
            requests = owners
        else:
            await self.forward_thread.drop_ahead()
            batch = build_batch([(take, r.seq.computed, r.seq.table) for r, take in chunks], self.block_size,
                                self.model.device)
            # A row gets a token once the pass takes in the rest of its history.
            rows = [row for row, (r, take) in enumerate(chunks) if r.seq.computed + len(take) == len(r.seq.tokens)]
            requests = [owners[row] for row in rows]
            sampled = await self.forward_thread.step(batch, Sampling(
                rows, [r.params for r in requests], [len(r.generated) for r in requests],
                [r.generator for r in requests], self.model.config.eos_token_ids), self._ahead(chunks, requests))
        for request, take in chunks:
            if self.audit is not None:
                self.audit.record(id(request), request.seq.table, request.seq.computed,
                                  request.seq.computed + len(take))
            request.seq.wrote(len(take))
        if sampled is None:
            return
        now = time.monotonic()
        for i, (request, token, logprob) in enumerate(zip(requests, sampled.tokens, sampled.logprobs, strict=True)):
            if request.params.n > 1 and not request.generated:
                self._fork(request, sampled.raw[i], sampled.scores[i], now)
            request.first_token_at = request.first_token_at or now
            request.seq.sampled(token)
            request.generated.append(token)
            self._emit(request, token, logprob)

    def _ahead(self, chunks: list[tuple[Request, list[int]]], sampling: list[Request]) -> Ahead | None:
        """The next pass, for the forward thread to run while this one's tokens stream: the same rows, one
        token on each. Only when that is what the next iteration will most likely ask for: every row gets a
        token now, nothing waits for a seat, no page operation is pending, and no row's sampling must
        repeat (a seeded generator), forks, or is audited. The thread itself stops at a row that ends."""
        if self.audit is not None or len(sampling) != len(chunks) or (self.waiting and len(self.running) <
                                                                      self.max_num_seqs):
            return None
        if self._backlog:
            return None
        if any(r.generator is not None or (r.params.n > 1 and not r.generated) for r in sampling):
            return None
        return Ahead(sampling, [r.seq.computed + len(take) for r, take in chunks], [r.seq.table for r in sampling],
                     self.block_size, self.model.config.max_position)

    def _audited(self, chunks: list[tuple[Request, list[int]]]) -> list[tuple[Request, list[int]]]:
        """--audit-kv: a sequence whose K/V changed under it since this worker wrote (or found) it fails."""
        assert self.audit is not None
        kept = []
        for request, take in chunks:
            tampered = self.audit.check(id(request), request.seq.table, request.seq.computed)
            if tampered is None:
                kept.append((request, take))
                continue
            log.error("K/V changed under a running sequence", request=request.request_id, seq=request.seq.id,
                      session=request.session_id, position=tampered.position, block=tampered.block,
                      slot=tampered.offset)
            self._end(request, error=GenerationError(StatusCode.INTERNAL, f"sequence {request.seq.id}: {tampered}; "
                                                     "the turn is failed rather than answered from it"))
        return kept

    def _fork(self, parent: Request, raw: torch.Tensor, scores: torch.Tensor, now: float) -> None:
        """n > 1: the prompt is in; n - 1 children share its KV (memd Fork) and sample their own first token.

        They sample from the parent's `scores` (its EOS already held back for min_tokens) and report
        logprobs from its `raw` row, as the parent does.
        """
        p = parent.params
        children = []
        for index in range(1, p.n):
            seed = None if p.seed is None else p.seed + index
            params = replace(p, n=1, seed=seed)
            generator = None if seed is None else torch.Generator().manual_seed(seed)
            token = sample(scores[None], [params], [generator])[0]
            child = Request(parent.prompt_ids, params, events=parent.events, arrived=parent.arrived, index=index,
                            num_prompt=parent.num_prompt, num_cached=parent.num_cached, fork_of=parent,
                            first_token_at=now,
                            cancel_reason=parent.cancel_reason,      # a cancel that came during the prefill
                            generator=generator, generated=[token], cache_salt=parent.cache_salt,
                            tenant=parent.tenant, seq=SeqProgress(tokens=[*parent.seq.tokens, token]))
            children.append(child)
        logprobs: list[TokenLogprob | None] = [None] * len(children)
        if p.logprobs is not None and children:       # one row for every child: one log_softmax
            logprobs = list(token_logprobs(raw[None], [c.generated[0] for c in children], [p.logprobs] * len(children)))
        for child, logprob in zip(children, logprobs, strict=True):
            parent.children.append(child)
            self._emit(child, child.generated[0], logprob)
        # memd forks what it knows: the prompt, committed, and none of the parent's own sampled tokens.
        commit = Extend(parent.seq.id, append=parent.seq.tell(upto=parent.seq.computed),
                        commit_to=parent.seq.computed, **self.page_sums.commit(parent))
        self._backlog.forks.append((parent, commit, parent.children))

    def _emit(self, request: Request, token: int, logprob: TokenLogprob | None = None) -> None:
        p, config = request.params, self.model.config
        held = len(request.generated) < p.min_tokens       # min_tokens: neither EOS nor a stop string ends it yet
        eos = token in config.eos_token_ids and not p.ignore_eos and not held
        text = self._text(request, token, eos)
        reason = None
        if held:
            request.stops_from = len(text)
        else:
            for stop in p.stop:
                # A stop the held tokens' text already holds was passed over there: only one ending later counts.
                if (cut := text.find(stop, max(0, request.stops_from - len(stop) + 1))) >= 0:
                    text, reason = text[:cut], "stop"
        if eos:
            reason = "stop"
        elif reason is None and (len(request.generated) >= p.max_tokens
                                 or len(request.seq.tokens) >= config.max_position):
            reason = "length"
        if reason is not None and request.detokenizer is not None and text is request.text:
            # The last text, whole: a character the tokens left half-made is shown as the tokenizer shows it.
            text = self.tokenizer.decode(request.generated[:-1] if eos else request.generated)
        hold = 0 if reason else max((len(s) - 1 for s in p.stop), default=0)
        if reason is None and text.endswith("\ufffd"):
            hold = max(hold, 1)                              # half a UTF-8 character: wait for the rest
        visible = text[:len(text) - hold] if hold else text
        delta = visible[len(request.emitted_text):] if visible.startswith(request.emitted_text) else ""
        request.emitted_text += delta
        request.events.put_nowait(Event([token], delta, index=request.index, ends=reason,
                                        logprobs=None if logprob is None else [logprob]))
        if reason:
            self._end(request, reason=reason)

    def _text(self, request: Request, token: int, eos: bool) -> str:
        """The generated text with `token` (not an EOS that ends it), decoded one token at a time.

        Re-decoding every generated token at every step costs each step in
        proportion to the text so far, so a request's decoding grows with the
        square of its length; the tokenizer's DecodeStream decodes only what
        is new, and holds a token back while it is half a UTF-8 character.
        """
        if eos:
            return request.text
        if request.detokenizer is None:
            request.detokenizer = DecodeStream(skip_special_tokens=True)
        if (chunk := request.detokenizer.step(self.tokenizer, token)) is not None:
            request.text += chunk
        return request.text

    def _end(self, request: Request, *, reason: str | None = None, error: GenerationError | None = None,
             keep: bool = False) -> None:
        """Leave the batch: queue the sequence's Park (a session keeps its history) or Free."""
        self._over_quota.pop(request.tenant or "", None)      # its pages come back: its tenant's next may fit
        self._over_quota.pop(MODEL_WIDE, None)
        request.seq.finished()
        if request in self.running:
            self.running.remove(request)
        if self.audit is not None:
            self.audit.forget(id(request))
        final = Event([], "", finish_reason=reason, usage=request.usage(), error=error, index=request.index)
        if request.seq.held:
            # A session keeps its turn (a reset's Free follows in the same Step); an error frees.
            keep = request.session_id is not None and (error is None or keep)
            progress = {"append": request.seq.tell(), "commit_to": request.seq.computed}
            if keep:
                op: Park | Free = Park(request.seq.id, **progress)            # its page sums: `_summed`
            elif error is None:               # its full blocks stay in the prefix cache for the next same prompt
                op = Free(request.seq.id, **progress, **self.page_sums.commit(request))
            else:                             # an error: what it computed is not offered to anyone
                op = Free(request.seq.id)
            self._backlog.ending.append(End(request, final, op))   # its final event waits for memd's answer
        else:
            request.events.put_nowait(final)
        self._wake.set()

