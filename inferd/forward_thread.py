"""The one thread that runs inferd's forward passes, and how many CPU cores each pass spreads over.

Every pass runs on the same thread, so torch's OpenMP team stays warm there
and the event loop stays free for HTTP, gRPC and memd meanwhile. Sampling
runs in the same job, right after the pass: the loop receives tokens, not
logits, and does no tensor work of its own.

How many cores a pass uses is chosen per pass, on CPU. OpenMP pays a fork
and a join for every parallel op, and its join waits for the slowest thread:
when the loop thread (or a client on the same host) holds one of the cores,
the whole team waits for it. A pass with little work loses more to that than
it gains: a small model's decode step runs slower on two threads than on
one while another process keeps a core busy, and neither OpenMP's passive
wait policy nor a shorter spin (GOMP_SPINCOUNT) nor the event loop's thread
at nice 10 closes the gap. So a pass of fewer than `PARALLEL_MIN_FLOPS`
runs on one thread and a bigger one on all `--threads`. A 16-sequence
decode step of a 4-layer, 256-wide model does 93 MFLOP and runs on one. A
12-layer, 768-wide model's single decode step does 123 MFLOP, and there
two threads win, for one request and for many; a threshold of 2 GFLOP
would keep all of that model's decode steps on one thread. A 1B-parameter
model does 2.4 GFLOP a token, so its every pass uses them all; only small
models' decode steps stay on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from inferd.model import Batch, PagedDecoder, build_batch
from inferd.sampling import SamplingParams, TokenLogprob, hold_eos, sample, token_logprobs

__all__ = ["PARALLEL_MIN_FLOPS", "Ahead", "ForwardThread", "PassObserver", "Sampled", "Sampling", "pass_kind"]

PARALLEL_MIN_FLOPS = 1e8        # a pass with less matrix work than this runs on one CPU thread

T = TypeVar("T")
PassObserver = Callable[[str, float], None]     # (kind, seconds), called on the forward thread after each pass


def pass_kind(batch: Batch) -> str:
    """"decode" (one new token a sequence), "prefill" (prompts only) or "mixed" (prompts joining decode rows)."""
    longest, shortest = max(batch.query_lens), min(batch.query_lens)
    return "decode" if longest == 1 else "prefill" if shortest > 1 or len(batch.query_lens) == 1 else "mixed"


@dataclass(slots=True)
class Sampling:
    """The rows of a pass that get a token, and what their requests ask of it."""

    rows: list[int]
    params: list[SamplingParams]
    generated: list[int]                          # tokens each has generated so far (for min_tokens)
    generators: list[torch.Generator | None]
    eos_token_ids: tuple[int, ...]


@dataclass(slots=True)
class Sampled:
    raw: torch.Tensor                             # [rows, vocab] logits as the model gave them
    scores: torch.Tensor                          # the same with EOS held back where min_tokens says so
    tokens: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass(slots=True)
class Ahead:
    """What the pass after this one will be if nothing changes: the same rows, each one token on.

    `owners` are the scheduler's requests, row by row (only compared by identity here);
    `positions` where each row's next token goes; `tables` their block tables.
    """

    owners: list[object]
    positions: list[int]
    tables: list[list[int]]
    block_size: int
    max_position: int


@dataclass(slots=True)
class _Speculation:
    """A pass run ahead on the forward thread, before the scheduler has said it wants it."""

    owners: list[object]
    positions: list[int]
    tokens: list[int]
    future: Future[Sampled | None]
    adopted: bool = False
    dropped: bool = False
    # finished before it was taken: the pass after it, for `take_ahead` to queue (Ahead, Sampling, tokens)
    following: tuple[Ahead, Sampling, list[int]] | None = None


class ForwardThread:
    def __init__(self, model: PagedDecoder) -> None:
        self.model = model
        self.threads = torch.get_num_threads()     # --threads, or torch's default
        self.flops_per_token = model.flops_per_token()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferd-forward")
        self._job: asyncio.Future | None = None
        self._lock = threading.Lock()
        self._ahead: _Speculation | None = None
        self._closed = False
        self.ahead_taken = self.ahead_dropped = 0   # passes run ahead and used, or thrown away
        self.on_pass: PassObserver | None = None     # told each pass's kind and time (forward and sampling)

    def threads_for(self, tokens: int) -> int:
        """CPU threads for a pass over `tokens` new tokens (an accelerator's passes do not use them)."""
        if self.model.device.type != "cpu" or tokens * self.flops_per_token >= PARALLEL_MIN_FLOPS:
            return self.threads
        return 1

    async def step(self, batch: Batch, sampling: Sampling, ahead: Ahead | None = None) -> Sampled | None:
        """One forward pass, then a token for each of `sampling.rows` (None when no row gets one).

        With `ahead`, the thread goes straight on to the next pass of the same rows with the
        tokens it sampled, while the scheduler streams these: `take_ahead` hands it over if the
        scheduler's next batch is that one, and `drop_ahead` throws it away.
        """
        return await self.run(self._step, batch, sampling, ahead, tokens=len(batch.token_ids))

    def take_ahead(self, owners: list[object], positions: list[int], tokens: list[int]) -> bool:
        """Whether the pass run ahead is the batch of `owners` at `positions` with `tokens`: then `taken` gives it."""
        with self._lock:
            spec = self._ahead
            if spec is None or spec.dropped or spec.positions != positions or spec.tokens != tokens \
                    or len(spec.owners) != len(owners) \
                    or any(mine is not theirs for mine, theirs in zip(spec.owners, owners, strict=True)):
                return False
            spec.adopted = True                     # the thread may run the one after it
            self._ahead = None
            following, spec.following = spec.following, None
        self.ahead_taken += 1
        self._job = asyncio.wrap_future(spec.future)
        if following is not None:
            # The pass was done before the scheduler came for it (streaming took longer than a pass):
            # queue the one after it now, or the thread idles while these tokens are streamed and the
            # client sees them two at a time, one pass apart, instead of one at the loop's pace.
            # Queued here, not from the thread, so that `drop_ahead` finds it before pages change.
            self._run_ahead(*following)
        return True

    async def taken(self) -> Sampled | None:
        """The result of the pass `take_ahead` took (shielded, as `run`'s)."""
        job = self._job
        assert job is not None
        try:
            return await asyncio.shield(job)
        finally:
            if job.done():
                self._job = None

    async def drop_ahead(self) -> None:
        """Throw away a pass run ahead, once it is done: it writes K/V into pages memd is about to change."""
        with self._lock:
            spec, self._ahead = self._ahead, None
            if spec is not None:
                spec.dropped = True
        if spec is not None:
            self.ahead_dropped += 1
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.wrap_future(spec.future))

    async def run(self, fn: Callable[..., T], *args: object, tokens: int) -> T:
        """`fn(*args)` on the forward thread, with as many CPU threads as `tokens` of work warrant.

        Shielded: cancelling the caller cannot stop the thread writing pages, so the job stays
        awaitable for `close`, which waits for it before the pool may be let go.
        """
        threads = self.threads_for(tokens)
        self._job = asyncio.get_running_loop().run_in_executor(self._pool, self._on_threads, threads, fn, args)
        try:
            return await asyncio.shield(self._job)
        finally:
            if self._job.done():
                self._job = None

    async def close(self) -> None:
        """Let a pass in flight finish (it writes into pages memd may hand out next), then stop."""
        with self._lock:
            self._closed = True                      # nothing more is run ahead
        if self._job is not None and not self._job.cancelled():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._job)
        await self.drop_ahead()
        self._pool.shutdown(wait=True)

    def _on_threads(self, threads: int, fn: Callable[..., T], args: tuple) -> T:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)           # OpenMP keeps its team: a smaller one parks the rest
        return fn(*args)

    def _step(self, batch: Batch, sampling: Sampling, ahead: Ahead | None) -> Sampled | None:
        start = time.perf_counter()
        logits = self.model.forward(batch)
        sampled = _sample(logits[sampling.rows], sampling) if sampling.rows else None
        self._observe(batch, start)
        if sampled is None:
            return None
        if ahead is not None:
            self._run_ahead(ahead, sampling, sampled.tokens)
        return sampled

    def _run_ahead(self, ahead: Ahead, sampling: Sampling, tokens: list[int]) -> None:
        """Queue the next pass of these rows, unless a row ends with the token it just got."""
        bs = ahead.block_size
        for token, position, table, params, generated in zip(tokens, ahead.positions, ahead.tables, sampling.params,
                                                             sampling.generated, strict=True):
            held = generated + 1 < params.min_tokens
            if generated + 1 >= params.max_tokens or position + 1 >= ahead.max_position \
                    or position >= len(table) * bs or (token in sampling.eos_token_ids and not params.ignore_eos
                                                       and not held):
                return
        rows = zip(tokens, ahead.positions, ahead.tables, strict=True)
        batch = build_batch([([t], p, table) for t, p, table in rows], bs, self.model.device)
        following = Sampling(list(range(len(tokens))), sampling.params, [g + 1 for g in sampling.generated],
                             sampling.generators, sampling.eos_token_ids)
        after = Ahead(ahead.owners, [p + 1 for p in ahead.positions], ahead.tables, bs, ahead.max_position)
        future: Future[Sampled | None] = Future()
        spec = _Speculation(ahead.owners, ahead.positions, tokens, future)
        with self._lock:
            if self._closed:
                return
            self._ahead = spec
            self._pool.submit(self._speculate, spec, batch, following, after)

    def _speculate(self, spec: _Speculation, batch: Batch, sampling: Sampling, after: Ahead) -> None:
        with self._lock:
            if spec.dropped:                          # the scheduler changed its batch meanwhile
                spec.future.set_result(None)
                return
        try:
            start = time.perf_counter()
            logits = self._on_threads(self.threads_for(len(batch.token_ids)), self.model.forward, (batch,))
            sampled = _sample(logits, sampling)                    # every row of a pass run ahead gets a token
            self._observe(batch, start)
        except BaseException as exc:
            spec.future.set_exception(exc)
            return
        with self._lock:
            go_on = spec.adopted and not spec.dropped
            if not go_on and not spec.dropped:        # `take_ahead` queues it if it takes this one
                spec.following = (after, sampling, sampled.tokens)
        if go_on:                                     # taken already: the one after it is likely wanted too
            self._run_ahead(after, sampling, sampled.tokens)
        spec.future.set_result(sampled)

    def _observe(self, batch: Batch, start: float) -> None:
        """The pass's time up to its tokens: sampling reads them back, so on a GPU the pass has finished.
        (A prompt chunk that samples nothing is not waited for there: its time is its launch's.)"""
        if self.on_pass is not None:
            self.on_pass(pass_kind(batch), time.perf_counter() - start)


def _sample(raw: torch.Tensor, sampling: Sampling) -> Sampled:
    """A token for each row of `raw` (the sampled rows' logits), EOS held back where min_tokens says so."""
    scores = hold_eos(raw, sampling.params, sampling.generated, sampling.eos_token_ids)
    tokens = sample(scores, sampling.params, sampling.generators)
    return Sampled(raw, scores, tokens, _logprobs(raw, sampling.params, tokens))


def _logprobs(raw: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenLogprob | None]:
    """Logprobs for the rows whose request asked, in one batch; the other rows cost nothing."""
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(tokens)
    if asked:
        rows = raw if len(asked) == len(params) else raw[asked]
        found = token_logprobs(rows, [tokens[i] for i in asked], [params[i].logprobs or 0 for i in asked])
        for i, logprob in zip(asked, found, strict=True):
            out[i] = logprob
    return out
