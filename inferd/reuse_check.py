"""`inferd serve --verify-reuse FRACTION`: recompute that fraction of prefix hits and compare the K/V.

Checksums prove a page holds the bytes its worker wrote; they cannot prove
the worker wrote the right K/V (a kernel bug, a worker that lied about its
weights). For the paranoid, a chosen fraction of the requests that reuse
cached blocks recompute those tokens into scratch pages of their own (never
into the pool: the cached pages are shared) and compare. Within a tolerance
set by the K/V dtype, as the same tokens computed in another batch shape
differ in their last bits; a wrong page differs everywhere. A mismatch is
counted and logged; memd takes the blocks from the first one on out of the
prefix cache, and the request starts again without them.
"""

from __future__ import annotations

import random

import structlog
import torch

from inferd.model import PagedDecoder, build_batch

log = structlog.get_logger("inferd.reuse_check")

# Largest difference allowed, relative to the largest K/V value of the block (at least 1).
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}


class ReuseCheck:
    """Which prefix hits to recompute, and the comparison."""

    def __init__(self, model: PagedDecoder, fraction: float, *, chunk_tokens: int = 512,
                 seed: int | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"--verify-reuse is a fraction from 0 to 1, not {fraction}")
        self.model, self.fraction = model, fraction
        self.chunk_tokens = max(chunk_tokens, 1)      # per forward pass, as the scheduler's (--max-batch-tokens)
        self.rng = random.Random(seed)
        self.checks = self.mismatches = 0

    def chosen(self, num_cached: int) -> bool:
        """Whether a request that reused `num_cached` tokens of cached K/V is recomputed and compared."""
        return num_cached >= self.model.block_size and self.rng.random() < self.fraction

    def first_mismatch(self, tokens: list[int], table: list[int], num_cached: int) -> int | None:
        """Recompute the K/V of the first `num_cached` tokens; the first block that differs from the pool's.

        Runs a forward pass: call it where forward passes run (the scheduler's compute thread).
        """
        model, bs = self.model, self.model.block_size
        blocks = num_cached // bs
        scratch = torch.zeros((blocks, *model.kv.shape[1:]), dtype=model.kv.dtype, device=model.kv.device)
        for start in range(0, blocks * bs, self.chunk_tokens):
            take = tokens[start:min(start + self.chunk_tokens, blocks * bs)]
            model.forward(build_batch([(take, start, list(range(blocks)))], bs, model.device), kv=scratch)
        cached = model.kv[torch.tensor(table[:blocks], device=model.kv.device)].float()
        fresh = scratch.float()
        worst = (cached - fresh).abs().flatten(1).amax(dim=1)
        scale = fresh.abs().flatten(1).amax(dim=1).clamp(min=1.0)
        bad = (worst > TOLERANCE.get(model.kv.dtype, 1e-3) * scale).nonzero()
        self.checks += 1
        if not len(bad):
            return None
        self.mismatches += 1
        return int(bad[0])
