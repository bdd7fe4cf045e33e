"""The scheduler side, in vLLM's engine-core process: lookups, one memd Step per engine step, finishes.

vLLM asks how many of a waiting request's tokens memd can supply, possibly
on every scheduler pass until it runs; that is memd's read-only Lookup, one
call per ask, which changes nothing in memd. Once vLLM has scheduled the
step, `build` hands the step's requests to the `StepPlanner`, whose one Step
takes the pages, and returns what the worker copies. Saved pages' checksums
come back with the step's output (`reported`); a finished request's
sequence is freed in the next Step, or, when no step follows soon (the last
request of a burst), by a flush on the link's own schedule.

vLLM calls all of this on its scheduler thread; the flush runs on another,
so every change to the planner is made under one lock.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog

from kvpool_vllm.memd_link import MemdDown, MemdLink
from kvpool_vllm.settings import Settings, request_tenant
from kvpool_vllm.step_plan import Scheduled, StepPlan, StepPlanner, failed_plan
from kvpool_vllm.worker_side import WorkerReport
from shared.client import MemdError
from shared.tenants import tenant_salt

log = structlog.get_logger("kvpool.vllm")

FLUSH_AFTER_S = 0.1          # a finished request's free waits this long for a next engine step to carry it
REPORT_WAIT_S = 2.0          # ...and at most this long for the worker's checksums of that request's last saves


class SchedulerSide:
    def __init__(self, link: MemdLink, block_size: int, settings: Settings, kv_cache_manager: Any = None) -> None:
        self.link, self.block_size, self.settings = link, block_size, settings
        self.kv_cache_manager = kv_cache_manager           # vLLM's: each request's block ids
        self.planner = StepPlanner(block_size)
        self.counters = {"lookups": 0, "lookup_hit_tokens": 0, "memd_down": 0}
        self._requests: dict[str, Any] = {}                 # vLLM's Request of each request it scheduled
        self._spaces: dict[str, tuple[str, str]] = {}       # ...and its (salt, tenant), read once
        self._ending: dict[str, Any] = {}                   # ...and of those finished, until their blocks are told
        self._asked: dict[str, int] = {}                    # tokens vLLM had computed itself when it asked
        self._loads: dict[str, tuple[int, int]] = {}        # blocks [start, stop) to load, once allocated
        self._fresh: set[str] = set()
        self._lock = threading.Lock()
        self._last_build = time.monotonic()
        self._report_due = 0.0                              # when saves' checksums are due back (0: none)
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_when_idle, name="kvpool-memd-flush", daemon=True)
        self._flusher.start()

    def _salt(self, request: Any) -> tuple[str, str]:
        tenant = request_tenant(getattr(request, "kv_transfer_params", None), self.settings.tenant)
        return tenant_salt(tenant, getattr(request, "cache_salt", None)) or "", tenant

    def matched(self, request: Any, num_computed: int) -> int:
        """Tokens past `num_computed` memd can supply for `request` (whole blocks, never its last token)."""
        token_ids = request.all_token_ids
        if not self.link.up or len(token_ids) <= num_computed + self.block_size:
            return 0
        salt, _ = self._salt(request)
        try:
            (found,), _ = self.link.call(lambda client: client.lookup([(token_ids, salt)]))
        except (MemdDown, MemdError) as err:
            if isinstance(err, MemdError):
                log.warning("memd refused a lookup; the request is computed", request=request.request_id,
                            why=err.message)
            return 0
        self.counters["lookups"] += 1
        hit = found * self.block_size
        if hit <= num_computed:
            return 0
        self._asked[request.request_id] = num_computed
        self.counters["lookup_hit_tokens"] += hit - num_computed
        return hit - num_computed

    def allocated(self, request: Any, num_external: int) -> None:
        """vLLM gave `request` blocks to run (anew: new or resumed): its loads, if any, are set."""
        req_id = request.request_id
        self._requests[req_id] = request
        self._spaces[req_id] = self._salt(request)
        self._fresh.add(req_id)
        if num_external:
            local = self._asked.get(req_id, 0)
            self._loads[req_id] = (local // self.block_size, (local + num_external) // self.block_size)

    def build(self, scheduler_output: Any) -> StepPlan:
        """This engine step's memd Step, sent; what the worker copies."""
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            with self._lock:
                self.planner.finished(req_id)           # vLLM let its blocks go; it opens anew when resumed
        scheduled = []
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            salt, tenant = self._spaces[req_id]
            (blocks, *_) = self.kv_cache_manager.get_block_ids(req_id)
            scheduled.append(Scheduled(req_id, request.all_token_ids, request.num_computed_tokens + count, blocks,
                                       salt, tenant, self._loads.pop(req_id, None), req_id in self._fresh))
        self._fresh.clear()
        with self._lock:
            self._last_build = time.monotonic()
            plan = self._send(scheduled)
            if plan.saves:
                self._report_due = self._last_build + REPORT_WAIT_S
        return plan

    def _send(self, scheduled: list[Scheduled]) -> StepPlan:
        if not self.link.up:
            self.counters["memd_down"] += 1
            return failed_plan(scheduled)
        try:
            plan, _ = self.link.call(lambda client: self.planner.plan(client, self.link.epoch,
                                                                      client.attachment.generation, scheduled))
        except (MemdDown, MemdError) as err:
            self.counters["memd_down"] += 1
            if isinstance(err, MemdError):
                log.warning("memd refused an engine step's Step; the step goes on without memd", why=err.message)
            return failed_plan(scheduled)
        return plan

    def reported(self, report: WorkerReport | None) -> None:
        """The worker's copies of the last engine step: saved pages' checksums, loads that failed."""
        with self._lock:
            self._report_due = 0.0
            if report is None:
                return
            for req_id, seq_id, first, sums in report.saved:
                self.planner.received(req_id, seq_id, first, sums)
            for req_id in report.load_failed:
                self.planner.load_failed(req_id)

    def finished(self, req_id: str) -> None:
        with self._lock:
            self.planner.finished(req_id)
            if (request := self._requests.pop(req_id, None)) is not None and req_id in self.planner.seqs:
                self._ending[req_id] = request
        self._spaces.pop(req_id, None)
        self._asked.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._fresh.discard(req_id)

    def take_stored(self) -> list[tuple[Any, int, int]]:
        """(vLLM's Request, first block, end) of the blocks committed in memd since the last call: what memd now
        holds for this engine, for vLLM's KV events under vLLM's own block hashes."""
        with self._lock:
            stored, self.planner.stored = self.planner.stored, []
            found = [(self._requests.get(req_id) or self._ending.get(req_id), start, end)
                     for req_id, start, end in stored]
            for req_id in [r for r in self._ending if r not in self.planner.seqs]:
                del self._ending[req_id]
        return [item for item in found if item[0] is not None]

    def _flush_when_idle(self) -> None:
        """Commits and frees no engine step will carry (vLLM went idle): sent by themselves."""
        while not self._stop.wait(FLUSH_AFTER_S / 2):
            with self._lock:
                now = time.monotonic()
                if not self.link.up or not self.planner.pending() or now - self._last_build < FLUSH_AFTER_S \
                        or (self._report_due and now < self._report_due):
                    continue
                self._send([])

    def close(self) -> None:
        self._stop.set()
        self._flusher.join(timeout=5)
        self.link.close()
