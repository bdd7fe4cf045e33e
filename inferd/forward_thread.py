"""The one thread that runs inferd's forward passes, and how many CPU cores each pass spreads over.

Every pass runs on the same thread, so torch's OpenMP team stays warm there
and the event loop stays free for HTTP, gRPC and memd meanwhile. Sampling
runs in the same job, right after the pass: the loop receives tokens, not
logits, and does no tensor work of its own.

How many cores a pass uses is chosen per pass, on CPU. OpenMP pays a fork
and a join for every parallel op, and its join waits for the slowest thread:
when the loop thread (or a client on the same host) holds one of the cores,
the whole team waits for it. A pass with little work loses more to that than
it gains. Measured with a 4-layer, 256-wide model on 2 cores: a 16-sequence
decode step took 7.6 ms on one thread and 13.2 ms on two while another
process kept one core busy, and two threads only began to win at 512-token
prefill chunks (41 ms on one, 35 ms on two). So a pass of fewer than
`PARALLEL_MIN_FLOPS` runs on one thread and a bigger one on all `--threads`.
A 1B-parameter model does 2.4 GFLOP a token, so its every pass uses them all;
only small models' decode steps stay on one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from inferd.model import Batch, PagedDecoder
from inferd.sampling import SamplingParams, TokenLogprob, hold_eos, sample, token_logprobs

__all__ = ["PARALLEL_MIN_FLOPS", "ForwardThread", "Sampled", "Sampling"]

PARALLEL_MIN_FLOPS = 2e9        # a pass with less matrix work than this runs on one CPU thread

T = TypeVar("T")


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


class ForwardThread:
    def __init__(self, model: PagedDecoder) -> None:
        self.model = model
        self.threads = torch.get_num_threads()     # --threads, or torch's default
        self.flops_per_token = model.flops_per_token()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferd-forward")
        self._job: asyncio.Future | None = None

    def threads_for(self, tokens: int) -> int:
        """CPU threads for a pass over `tokens` new tokens (an accelerator's passes do not use them)."""
        if self.model.device.type != "cpu" or tokens * self.flops_per_token >= PARALLEL_MIN_FLOPS:
            return self.threads
        return 1

    async def step(self, batch: Batch, sampling: Sampling) -> Sampled | None:
        """One forward pass, then a token for each of `sampling.rows` (None when no row gets one)."""
        return await self.run(self._step, batch, sampling, tokens=len(batch.token_ids))

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
        if self._job is not None and not self._job.cancelled():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._job)
        self._pool.shutdown(wait=True)

    @staticmethod
    def _on_threads(threads: int, fn: Callable[..., T], args: tuple) -> T:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)           # OpenMP keeps its team: a smaller one parks the rest
        return fn(*args)

    def _step(self, batch: Batch, sampling: Sampling) -> Sampled | None:
        logits = self.model.forward(batch)
        if not sampling.rows:
            return None
        raw = logits[sampling.rows]
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
