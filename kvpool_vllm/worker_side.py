"""The worker side: each engine step, check and load the blocks the scheduler side was given, save the new ones.

It runs in vLLM's worker process, beside the model, and never calls memd
in a step: it maps memd's pool through an attachment of its own (which is
also its lease: a worker killed leaves nothing behind in memd) and copies
whole blocks (`BlockCopier`). A page to load is checked against the
checksum memd holds for it first; from the first page that fails, the
request's remaining blocks are reported to vLLM as load errors (vLLM
recomputes them) and none of its blocks is saved this step, since what
vLLM computes past a failed load is not that request's K/V. Saved pages'
checksums go back to the scheduler side in the step's worker report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog
import torch

from kvpool_vllm.block_copy import BlockCopier, LayoutError
from kvpool_vllm.memd_link import MemdLink
from kvpool_vllm.step_plan import StepPlan

log = structlog.get_logger("kvpool.vllm")


@dataclass(slots=True)
class WorkerReport:
    """What one engine step's copies did, for the scheduler side: picklable, merged across workers."""

    saved: list[tuple[str, int, int, list[int]]] = field(default_factory=list)    # req, seq, first block, sums
    load_failed: set[str] = field(default_factory=set)                             # requests vLLM recomputes

    def merge(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(self.saved + other.saved, self.load_failed | other.load_failed)


class WorkerSide:
    """Loads and saves of one vLLM worker, over its own mapping of memd's pool."""

    def __init__(self, link: MemdLink) -> None:
        self.link = link
        self.caches: dict[str, torch.Tensor] = {}
        self.block_dim = 0
        self._copier: BlockCopier | None = None
        self._copier_epoch = 0
        self._errors: set[int] = set()
        self._report = WorkerReport()
        self.counters = {"loaded_blocks": 0, "bad_pages": 0, "saved_blocks": 0, "skipped_steps": 0}

    def register(self, caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """vLLM's KV cache tensors, one per layer (a tensor two layers share is copied once)."""
        seen: set[int] = set()
        self.caches = {}
        for name, cache in caches.items():
            if cache.data_ptr() not in seen:
                seen.add(cache.data_ptr())
                self.caches[name] = cache
        first = next(iter(self.caches.values()))
        self.block_dim = list(first.shape).index(num_blocks)

    def _copier_for(self, plan: StepPlan) -> BlockCopier | None:
        """The copier over the pool `plan`'s pages are of, or None (not attached, or memd's pool changed)."""
        client = self.link.client
        if client is None or not self.link.up or client.pool is None or not self.caches:
            return None
        if client.attachment.generation != plan.generation:
            return None
        if self._copier_epoch != self.link.epoch:           # a new attachment: a new mapping of the pool
            self._copier_epoch = self.link.epoch
            try:
                self._copier = BlockCopier(self.caches, self.block_dim, client.pool.pages)
            except LayoutError as err:        # vLLM serves on without memd: said once per attachment
                self._copier = None
                log.error("vLLM's KV cache cannot be copied to memd's pages; serving without memd", why=str(err))
        return self._copier

    def load(self, plan: StepPlan) -> None:
        """Every load of `plan` checked, then copied; what cannot be loaded is reported (`take_errors`)."""
        if not plan.loads:
            return
        copier = self._copier_for(plan)
        for load in plan.loads:
            good = 0
            if copier is not None and load.pages:
                found = copier.checksums(load.pages)
                good = next((i for i, (got, want) in enumerate(zip(found, load.sums, strict=True))
                             if got != want or not want), len(load.pages))
                if good < len(load.pages):
                    self.counters["bad_pages"] += 1
                    log.error("a page memd holds for vLLM is not what was saved: vLLM recomputes from it",
                              request=load.req_id, page=load.pages[good], block=load.vllm_blocks[good])
                copier.load(load.pages[:good], load.vllm_blocks[:good])
                self.counters["loaded_blocks"] += good
            failed = load.vllm_blocks[good:] + load.failed
            if failed:
                self._errors.update(failed)
                self._report.load_failed.add(load.req_id)

    def save(self, plan: StepPlan) -> None:
        """Every save of `plan` copied to memd's pages and summed, but those of a request whose load failed."""
        if not plan.saves:
            return
        copier = self._copier_for(plan)
        if copier is None:
            self.counters["skipped_steps"] += 1
            return
        for save in plan.saves:
            if save.req_id in self._report.load_failed:
                continue
            sums = copier.save(save.vllm_blocks, save.pages)
            self._report.saved.append((save.req_id, save.seq_id, save.first, sums))
            self.counters["saved_blocks"] += len(sums)

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> WorkerReport | None:
        report, self._report = self._report, WorkerReport()
        return report if report.saved or report.load_failed else None
