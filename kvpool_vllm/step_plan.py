"""The scheduler side's bookkeeping with memd: one Step per engine step that takes pages for loads and saves.

vLLM's scheduler decides each engine step which requests run and how many
tokens each computes; this decides, in the same step, what memd does for
them, in one memd Step:

- a request scheduled anew (new, or resumed after vLLM preempted it) opens
  a memd sequence over the tokens whose K/V exists once this engine step
  has run: memd shares the blocks its prefix cache holds (the ones vLLM
  was told it could load, and their checksums) and gives fresh pages for
  the rest;
- a running request whose last engine step filled blocks extends its
  sequence, which gives pages for them;
- the checksums of pages the worker wrote in the engine step before
  commit them (`Extend.commit_to`): committed full blocks enter memd's
  prefix cache, findable by any engine of the same namespace;
- a finished request frees its sequence, committing first: its blocks stay
  cached in memd for the next request that starts with them.

The worker copies between vLLM's blocks and those pages (`WorkerSide`) and
sends back each saved page's checksum; they are committed in the next
Step. A block is saved only once every token in it has its K/V in vLLM's
cache: blocks vLLM will recompute (a load that failed) are never saved.

Nothing here may break serving: a Step memd refuses for one request drops
that request's saves and is sent again without it; with memd down, loads
fail (vLLM recomputes) and nothing is saved. Sequences of an attachment that
ended (memd restarted, the link re-attached) are forgotten: memd reclaimed
them with the lease.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from shared.client import MemdClient, MemdError
from shared.ops import Extend, Free, Op, Open, OpResult

log = structlog.get_logger("kvpool.vllm")

REFUSALS_PER_STEP = 4           # Steps sent again without a refused request's op, at most, in one engine step


@dataclass(slots=True)
class Scheduled:
    """One request in this engine step, as vLLM's scheduler has it."""

    req_id: str
    token_ids: Sequence[int]         # every token known: the prompt, then what was generated
    end: int                         # tokens whose K/V is in vLLM's cache once this engine step has run
    blocks: Sequence[int]            # vLLM's block ids of the request, in order
    salt: str = ""                   # the prefix space: tenant and vLLM's cache_salt (shared.tenants.tenant_salt)
    tenant: str = ""
    load: tuple[int, int] | None = None   # blocks [start, stop) vLLM was told memd supplies
    fresh: bool = False              # new or resumed from scratch: any earlier sequence of it is over


@dataclass(slots=True)
class Load:
    req_id: str
    vllm_blocks: list[int]
    pages: list[int]
    sums: list[int]                  # memd's checksum of each page: the worker checks before it copies
    failed: list[int]                # vLLM blocks that cannot be loaded (memd no longer has them)


@dataclass(slots=True)
class Save:
    req_id: str
    seq_id: int
    first: int                       # the request's block index of vllm_blocks[0]
    vllm_blocks: list[int]
    pages: list[int]


@dataclass(slots=True)
class StepPlan:
    """What the worker does this engine step; picklable (it travels in vLLM's connector metadata)."""

    generation: int = 0              # memd's pool the pages are of: a worker mapped to another copies nothing
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


@dataclass(slots=True)
class _Seq:
    """A request's memd sequence, as this side knows it."""

    req_id: str
    seq_id: int
    epoch: int
    num_tokens: int                  # tokens memd's history holds
    table: list[int]                 # memd's pages, one per block
    committed: int                   # full blocks committed in memd
    planned: int                     # full blocks saved, or being saved (or shared from memd's cache)
    sums: dict[int, list[int]] = field(default_factory=dict)   # first block -> checksums the worker sent
    finished: bool = False


@dataclass(slots=True)
class _Pending:
    """An op of the Step being built and what to do with its result."""

    op: Op
    req_id: str
    then: Callable[[OpResult], None]


class StepPlanner:
    """The requests' memd sequences; `plan` builds and sends one engine step's Step."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seqs: dict[str, _Seq] = {}
        self.refused: set[str] = set()       # requests memd refused pages (a tenant at its max): never asked again
        self.stored: list[tuple[str, int, int]] = []   # (request, first block, end): committed in memd since taken
        self.counters = {"saved_blocks": 0, "loaded_blocks": 0, "load_misses": 0, "saves_refused": 0}

    def received(self, req_id: str, seq_id: int, first: int, sums: list[int]) -> None:
        """The worker saved blocks `first`.. of a request's sequence `seq_id`; their checksums commit next Step."""
        seq = self.seqs.get(req_id)
        if seq is not None and seq.seq_id == seq_id:
            seq.sums[first] = sums

    def load_failed(self, req_id: str) -> None:
        """The worker found a page it was to load not intact: vLLM recomputes from there, so nothing of this
        request's sequence is saved further; it is freed and opened again once vLLM has recomputed."""
        seq = self.seqs.get(req_id)
        if seq is not None:
            seq.finished = True

    def finished(self, req_id: str) -> None:
        """vLLM is done with the request: its sequence is freed (committed first) in the next Step."""
        self.refused.discard(req_id)
        seq = self.seqs.get(req_id)
        if seq is not None:
            seq.finished = True

    def pending(self) -> bool:
        """Whether a Step would commit or free something even with no request scheduled."""
        return any(seq.finished or seq.sums for seq in self.seqs.values())

    def forget_epoch(self, epoch: int) -> None:
        """Sequences of attachments before `epoch` are gone with their lease."""
        for req_id in [r for r, seq in self.seqs.items() if seq.epoch != epoch]:
            del self.seqs[req_id]

    async def plan(self, client: MemdClient, epoch: int, generation: int,
                   scheduled: list[Scheduled]) -> StepPlan:
        """This engine step's Step, sent (again without a refused request's op, a few times at most)."""
        self.forget_epoch(epoch)
        out = StepPlan(generation)
        dropped: set[str] = set()
        for _ in range(REFUSALS_PER_STEP + 1):
            pending = self._ops(scheduled, dropped, epoch, out)
            if not pending:
                break
            try:
                results = await client.step(*(p.op for p in pending))
            except MemdError as err:
                if err.op_index is None or err.op_index >= len(pending):
                    raise
                refused = pending[err.op_index]
                log.info("memd refused a request's pages: it is served without saving", request=refused.req_id,
                         why=err.message)
                self.counters["saves_refused"] += 1
                dropped.add(refused.req_id)
                self.refused.add(refused.req_id)
                self.seqs.pop(refused.req_id, None)
                continue
            for p, result in zip(pending, results, strict=True):
                p.then(result)
            break
        else:
            return failed_plan(scheduled, generation)
        for req in scheduled:            # a load whose request was dropped: vLLM recomputes it all
            if req.load and req.req_id in dropped:
                out.loads.append(_failed_load(req))
        return out


    # ---- building the Step ---------------------------------------------------------------

    def _ops(self, scheduled: list[Scheduled], dropped: set[str], epoch: int, out: StepPlan) -> list[_Pending]:
        for req in scheduled:
            if req.fresh and (seq := self.seqs.get(req.req_id)) is not None:
                seq.finished = True             # scheduled from scratch: its old sequence ends, a new one opens
        pending: list[_Pending] = []
        for req_id, seq in list(self.seqs.items()):
            if seq.finished and req_id not in dropped:
                pending.append(_Pending(Free(seq.seq_id, **self._commit(seq)), req_id,
                                        lambda result, s=seq, r=req_id: self._freed(r, s)))
        for req in scheduled:
            if req.req_id in dropped or req.req_id in self.refused:
                continue
            seq = self.seqs.get(req.req_id)
            if seq is None or seq.finished:
                if req.end // self.block_size or req.load:
                    pending.append(_Pending(Open(list(req.token_ids[:req.end]), cache_salt=req.salt or None,
                                                 tenant=req.tenant or None), req.req_id,
                                            lambda result, r=req: self._opened(r, result, epoch, out)))
                continue
            commit = self._commit(seq)
            if req.end // self.block_size > seq.planned:
                op = Extend(seq.seq_id, append=list(req.token_ids[seq.num_tokens:req.end]), **commit)
                pending.append(_Pending(op, req.req_id,
                                        lambda result, r=req, s=seq: self._extended(r, s, result, out)))
            elif commit:
                pending.append(_Pending(Extend(seq.seq_id, **commit), req.req_id,
                                        lambda result, s=seq: self._committed(s)))
        ran = {req.req_id for req in scheduled}
        for req_id, seq in self.seqs.items():          # not scheduled this step, with checksums to commit
            if not seq.finished and seq.sums and req_id not in ran and req_id not in dropped \
                    and (commit := self._commit(seq)):
                pending.append(_Pending(Extend(seq.seq_id, **commit), req_id, lambda result, s=seq: self._committed(s)))
        return pending

    def _commit(self, seq: _Seq) -> dict:
        """The commit_to / sums_from / page_sums of an op committing the checksums the worker sent, in order
        from the first uncommitted block ({} if none follows on: a run after a gap is never committed)."""
        at, sums = seq.committed, []
        while (run := seq.sums.get(at)) is not None:
            sums += run
            at += len(run)
        if not sums:
            return {}
        return {"commit_to": at * self.block_size, "sums_from": seq.committed, "page_sums": sums}

    # ---- reading its results -------------------------------------------------------------

    def _freed(self, req_id: str, seq: _Seq) -> None:
        self._committed(seq)
        if self.seqs.get(req_id) is seq:
            del self.seqs[req_id]

    def _committed(self, seq: _Seq) -> None:
        if commit := self._commit(seq):
            upto = commit["commit_to"] // self.block_size
            self.stored.append((seq.req_id, seq.committed, upto))
            seq.committed = upto
        seq.sums.clear()

    def _opened(self, req: Scheduled, result: OpResult, epoch: int, out: StepPlan) -> None:
        bs = self.block_size
        cached = result.num_cached // bs
        seq = _Seq(req.req_id, result.seq_id, epoch, req.end, list(result.block_ids), cached, cached)
        self.seqs[req.req_id] = seq
        if req.load:
            start, stop = req.load
            have = min(stop, cached)
            sums = result.cached_sums or []
            out.loads.append(Load(req.req_id, list(req.blocks[start:have]), seq.table[start:have],
                                  sums[start:have], list(req.blocks[max(start, have):stop])))
            self.counters["loaded_blocks"] += max(0, have - start)
            if have < stop:
                self.counters["load_misses"] += 1
                seq.finished = True       # vLLM recomputes from the first block it lacks: nothing to save now
                return
        self._save(req, seq, out)

    def _extended(self, req: Scheduled, seq: _Seq, result: OpResult, out: StepPlan) -> None:
        if seq.sums:
            self._committed(seq)
        seq.table[result.first_block:] = result.block_ids
        seq.num_tokens = req.end
        self._save(req, seq, out)

    def _save(self, req: Scheduled, seq: _Seq, out: StepPlan) -> None:
        """Save the blocks filled by the end of this engine step that memd does not have yet."""
        full = req.end // self.block_size
        if full <= seq.planned:
            return
        out.saves.append(Save(req.req_id, seq.seq_id, seq.planned, list(req.blocks[seq.planned:full]),
                              seq.table[seq.planned:full]))
        self.counters["saved_blocks"] += full - seq.planned
        seq.planned = full


def failed_plan(scheduled: list[Scheduled], generation: int = 0) -> StepPlan:
    """An engine step without memd: every load fails (vLLM recomputes), nothing is saved."""
    return StepPlan(generation, [_failed_load(req) for req in scheduled if req.load])


def _failed_load(req: Scheduled) -> Load:
    assert req.load is not None
    return Load(req.req_id, [], [], [], list(req.blocks[req.load[0]:req.load[1]]))
