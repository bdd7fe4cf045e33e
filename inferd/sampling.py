"""Sampling parameters and the choice of the next token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SEED = 2**63 - 1        # torch generators take a signed 64-bit seed


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
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED - (self.n - 1):
            raise BadParams(f"seed must be in [0, {MAX_SEED - (self.n - 1)}] (n completions use seed .. seed + n - 1)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [B, vocab]; greedy rows in one argmax."""
    chosen = logits.argmax(-1).tolist()
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
