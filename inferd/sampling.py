"""Sampling parameters and the choice of the next token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SEED = 2**63 - 1        # torch generators take a signed 64-bit seed
MAX_LOGPROBS = 20           # alternatives per token: OpenAI's top_logprobs limit, and vLLM's default


class BadParams(ValueError):
    """Sampling parameters no request can be served with."""


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0      # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                # 0: no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1                    # completions of one prompt; the prompt's KV is forked, not recomputed
    logprobs: int | None = None   # None: none; k: each token's logprob and the k likeliest alternatives
    min_tokens: int = 0           # no end by EOS or stop string before this many tokens (vLLM's)

    def check(self) -> None:
        if not 1 <= self.n <= 16:
            raise BadParams(f"n must be in [1, 16], not {self.n}")
        if self.max_tokens < 1:
            raise BadParams(f"max_tokens must be at least 1, not {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise BadParams(f"temperature must be in [0, 100], not {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadParams(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise BadParams(f"top_k must not be negative, not {self.top_k}")
        if any(not s for s in self.stop):
            raise BadParams("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadParams(f"logprobs must be in [0, {MAX_LOGPROBS}] or unset, not {self.logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise BadParams(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], not {self.min_tokens}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED - (self.n - 1):
            raise BadParams(f"seed must be in [0, {MAX_SEED - (self.n - 1)}] (n completions use seed .. seed + n - 1)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's raw logits, and the `k` likeliest alternatives.

    Raw: before temperature, top-k, top-p and min_tokens' EOS mask, as vLLM reports by default, so the
    numbers describe the model rather than the sampler's settings.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]      # (token id, logprob), likeliest first


def hold_eos(logits: torch.Tensor, params: list[SamplingParams], generated: list[int],
             eos_token_ids: tuple[int, ...] | list[int]) -> torch.Tensor:
    """min_tokens: rows still short of it (`generated` tokens so far) cannot pick EOS, greedy or sampled.

    Returns `logits` itself when no row is held, else a masked copy: the raw rows stay for logprobs.
    ignore_eos rows are left alone, as in vLLM: there EOS is an ordinary token that ends nothing.
    """
    rows = [row for row, (p, n) in enumerate(zip(params, generated, strict=True))
            if n < p.min_tokens and not p.ignore_eos]
    if not rows or not eos_token_ids:
        return logits
    masked = logits.clone()
    masked[torch.tensor(rows, device=logits.device)[:, None],
           torch.tensor(list(eos_token_ids), device=logits.device)[None, :]] = float("-inf")
    return masked


def token_logprobs(logits: torch.Tensor, chosen: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Logprobs of the `chosen` tokens and each one's `ks[i]` likeliest alternatives, in a few batched ops.

    `logits` [B, vocab] are raw rows, one per choice; a single row serves every choice (the n > 1
    children's first tokens all come from their parent's row). Only rows that asked belong here: a
    log_softmax over the vocabulary is not free on the decode path.
    """
    logprobs = torch.log_softmax(logits.float(), -1)
    rows = logprobs.expand(len(chosen), -1) if logprobs.shape[0] == 1 else logprobs     # a view, not a copy
    index = torch.tensor(chosen, device=logprobs.device)[:, None]
    picked = rows.gather(1, index)[:, 0].tolist()
    k = min(max(ks, default=0), logprobs.shape[-1])
    if k:
        values, ids = logprobs.topk(k, -1)       # sorted: likeliest first
        top_values, top_ids = values.tolist(), ids.tolist()
    else:
        top_values, top_ids = [[]], [[]]
    shared = len(top_ids) == 1
    return [TokenLogprob(token, lp, list(zip(top_ids[0 if shared else i][:n], top_values[0 if shared else i][:n],
                                             strict=True)))
            for i, (token, lp, n) in enumerate(zip(chosen, picked, ks, strict=True))]


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first on ties, as torch's), on the CPU through numpy.

    It runs on the forward thread after every pass. torch's CPU argmax walks
    the row without SIMD, numpy's with it; both give the same indices, ties
    and NaN included."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [B, vocab]; greedy rows in one argmax."""
    chosen = argmax_rows(logits)
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        scores = logits[row].float() / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, -1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest head whose mass reaches top_p (the top token always stays).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if gen is not None and probs.device != gen.device:
            probs = probs.to(gen.device)        # a seed's generator lives on the CPU: same draws on any device
        chosen[row] = int(torch.multinomial(probs, 1, generator=gen))
    return chosen
