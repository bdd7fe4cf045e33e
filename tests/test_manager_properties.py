"""KvManager driven by random Steps, in-process: invariants, all-or-nothing Steps, no leaks."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memd.errors import KvError, NotFound, OpError
from memd.eviction import Evicted
from memd.manager import KvManager
from memd.page_effects import Copy, PageEffect, SwapIn, Zero
from memd.quotas import Quota, Quotas
from memd.sequences import EvictionReason, SeqState, SwapOut, token_bytes
from memd.step_outcome import StepOutcome
from shared.geometry import PoolGeometry
from shared.ops import Extend, Fork, Free, Op, Open, OpResult, Park, Resume

BLOCK_SIZE = 4
NUM_BLOCKS = 24
GEOMETRY = PoolGeometry(num_blocks=NUM_BLOCKS, block_bytes=4096, block_size=BLOCK_SIZE)
MODELS = ("m", "m", "n")                 # worker slots: two share a model, one serves another
SESSIONS = ("s1", "s2", "s3")
NO_SUCH_SEQ = 10**6
SWAP_SLOTS = 6

# Histories built from a few whole blocks plus a short tail: prefix hits are common.
CHUNKS = ((1, 2, 3, 4), (5, 6, 7, 8), (1, 1, 1, 1))
tokens = st.one_of(
    st.builds(lambda chunks, tail: [t for c in chunks for t in c] + tail,
              st.lists(st.sampled_from(CHUNKS), min_size=1, max_size=3), st.lists(st.integers(0, 3), max_size=3)),
    st.lists(st.integers(0, 3), max_size=3),
)
appended = st.lists(st.integers(0, 3), max_size=6)
reserves = st.integers(0, 5)
sessions = st.sampled_from((None, None, None, *SESSIONS))


TENANTS = st.sampled_from((None, "a", "b"))      # tenant "a" has a guarantee and a max, "b" neither


def new_manager() -> KvManager:
    quotas = Quotas({("tenant", "a"): Quota(guaranteed=3, max=12)})
    return KvManager(GEOMETRY, hash_key=b"k" * 32, swap_slots=SWAP_SLOTS, watermark_blocks=4, quotas=quotas)


def after_step(manager: KvManager, outcome: StepOutcome, jobs: list[SwapOut]) -> None:
    """What memd's service does after a Step: effects done, slots back, preempted sequences evicted."""
    manager.release_slots(outcome.read_slots)
    for eviction in outcome.evictions:
        if manager.evictable(eviction.seq):
            jobs += manager.evictions.evict(eviction.seq, eviction.mode, eviction.reason).jobs


def attach(manager: KvManager, model: str) -> int:
    return manager.attach(f"worker-{model}", 1000, model, BLOCK_SIZE, 0).worker_id


def dump(manager: KvManager) -> dict[str, Any]:
    """Everything a Step may change, in comparable form."""
    pool = manager.pool
    return {
        "seqs": {sid: (s.model, s.block_size, s.owner, s.state, tuple(s.block_ids), s.num_committed,
                       tuple(s.token_ids), tuple(s.hashes), s.session_id, tuple(s.slots), s.preempted_by)
                 for sid, s in manager.seqs.items()},
        "swap_jobs": {sid: id(job) for sid, job in manager.swap_jobs.items()},
        "swap_free": manager.swap.free_slots() if manager.swap else [],
        "in_copy": sorted(manager.swap.in_copy) if manager.swap else [],
        "sessions": dict(manager.sessions),
        "ref": list(pool.ref),
        "free": list(pool.free),
        "num_free": pool.num_free,
        "by_hash": dict(pool.by_hash),
        "hash_of": list(pool.hash_of),
        "tokens_of": list(pool.tokens_of),
        "dirty": bytes(pool.dirty),
        "last_access": list(pool.last_access),
        "checksum": list(pool.checksum),
    }


def free_everything(manager: KvManager, jobs: list[SwapOut] = ()) -> None:
    """Finish the copies in flight, reclaim every worker, free what is left through a fresh worker of each model."""
    for job in jobs:
        manager.evictions.finish_swap_out(job)
    for worker_id in list(manager.workers):
        manager.reclaim(worker_id)
    assert all(s.state is not SeqState.RUNNING for s in manager.seqs.values())
    for model in {s.model for s in manager.seqs.values()}:
        worker = attach(manager, model)
        ids = [sid for sid, s in manager.seqs.items() if s.model == model]
        manager.release_slots(manager.step(worker, [Free(sid) for sid in ids]).read_slots)
    for pid in list(manager.fences):
        manager.lift(pid)
    assert manager.seqs == {}
    assert manager.sessions == {}
    assert manager.pool.num_free == NUM_BLOCKS
    assert manager.swap is None or manager.swap.num_free == manager.swap.num_slots
    assert manager.violations() == []


class KvManagerMachine(RuleBasedStateMachine):
    """Three workers send random Steps; memd evicts and reclaims in between.

    After every rule the manager's invariants hold; a refused Step changes
    nothing; an Open whose first block is cached hits it; a dirty page is never
    handed out without a zero or copy effect; at the end, freeing everything
    returns every page.
    """

    def __init__(self) -> None:
        super().__init__()
        self.manager = new_manager()
        self.slots = [attach(self.manager, model) for model in MODELS]
        self.jobs: list[SwapOut] = []            # swap-out copies "in flight", cancelled or not

    # ---- building ops from the state they will meet ---------------------

    def seq_ids(self, worker: int | None = None, extra: int = 0) -> st.SearchStrategy[int]:
        """Live sequences, the ids the next ops of this Step would create, and one that never exists.

        Weighted towards sequences `worker` may touch, so that most Steps can succeed.
        """
        usable = [sid for sid, s in self.manager.seqs.items() if s.owner in (worker, None)]
        nxt = self.manager._next_seq
        return st.sampled_from([*usable * 4, *self.manager.seqs, *[*range(nxt, nxt + extra)] * 2, NO_SUCH_SEQ])

    def commit_to(self, data: st.DataObject, seq_id: int, append: list[int]) -> int:
        seq = self.manager.seqs.get(seq_id)
        if seq is None:
            return data.draw(st.integers(0, 12))
        known = len(seq.token_ids) + len(append)
        most = min(known, seq.capacity)
        return data.draw(st.one_of(
            st.just(0),                                            # unchanged
            st.just(most),                                         # everything it can
            st.integers(min(seq.num_committed, most), most),       # usually valid
            st.integers(0, known + 2),                             # often invalid: rolls back
        ))

    def sums(self, data: st.DataObject, seq_id: int, commit_to: int) -> dict:
        """Page checksums with the commit: usually for pages it fills, sometimes past them (refused)."""
        seq = self.manager.seqs.get(seq_id)
        full = (max(commit_to, seq.num_committed if seq else 0)) // BLOCK_SIZE + 1
        first = data.draw(st.integers(0, full))
        count = data.draw(st.integers(0, full + 1 - first))
        return {"sums_from": first, "page_sums": data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=count,
                                                                    max_size=count))}

    def draw_op(self, data: st.DataObject, worker: int, extra: int) -> Op:
        kind = data.draw(st.sampled_from(("open", "extend", "park", "resume", "free", "fork", "conversation")))
        if kind == "conversation":            # a stateless client resending a conversation, edited or grown
            return Open(self.conversation(data), data.draw(reserves), data.draw(sessions), data.draw(st.booleans()),
                        whole_history=True)
        if kind == "open":     # a session's next turn (or the retry of one that failed) half of the time
            return Open(data.draw(tokens), data.draw(reserves), data.draw(sessions), data.draw(st.booleans()),
                        data.draw(st.sampled_from((None, "t1", "t2"))),     # a turn id: its retry replaces it
                        tenant=data.draw(TENANTS))                          # whose pages memd counts them as
        if kind == "resume":
            if data.draw(st.booleans()):
                return Resume(session_id=data.draw(st.sampled_from((*SESSIONS, "nope"))),
                              reserve=data.draw(reserves))
            return Resume(seq_id=data.draw(self.seq_ids(worker, extra)), reserve=data.draw(reserves))
        seq_id = data.draw(self.seq_ids(worker, extra))
        if kind == "free":
            if data.draw(st.booleans()):               # its last progress committed as it goes
                append = data.draw(appended)
                commit_to = self.commit_to(data, seq_id, append)
                return Free(seq_id, append=append, commit_to=commit_to, **self.sums(data, seq_id, commit_to))
            return Free(seq_id)
        if kind == "fork":
            return Fork(seq_id, data.draw(sessions))
        append = data.draw(appended)
        commit_to = self.commit_to(data, seq_id, append)
        if kind == "park":
            return Park(seq_id, append, commit_to, data.draw(st.booleans()), **self.sums(data, seq_id, commit_to))
        return Extend(seq_id, append, commit_to, data.draw(reserves), **self.sums(data, seq_id, commit_to))

    def conversation(self, data: st.DataObject, session: str | None = None) -> list[int]:
        """A session's history cut anywhere, then something else: a new message, an edit, or nothing."""
        seq_id = self.manager.sessions.get(session or data.draw(st.sampled_from(SESSIONS)))
        history = self.manager.seqs[seq_id].token_ids if seq_id is not None else []
        keep = data.draw(st.integers(0, len(history)))
        return [*history[:keep], *data.draw(appended)] or [1]

    @rule(slot=st.integers(0, len(MODELS) - 1), data=st.data(), session=st.sampled_from(SESSIONS),
          reserve=reserves)
    def resend_a_conversation(self, slot: int, data: st.DataObject, session: str, reserve: int) -> None:
        """Only the part the session's history shares with the conversation keeps its own K/V; past it, K/V
        comes only from the prefix cache's pages of these very tokens (computed under the same weights)."""
        seq_id = self.manager.sessions.get(session)
        before = self.manager.seqs[seq_id] if seq_id is not None else None
        history = list(before.token_ids) if before is not None else []
        conversation = self.conversation(data, session)
        op = Open(conversation, reserve, session, continue_session=True, whole_history=True)
        copies = self.manager.counters["blocks_copied_on_write"]
        if not self.run_step(slot, [op]):
            return                                              # refused: run_step checked it changed nothing
        result = self.manager.seqs[self.manager.sessions[session]]
        assert list(result.token_ids) == conversation
        assert result.num_committed < len(conversation)     # the last token is computed: its logits are needed
        same = next((i for i, (a, b) in enumerate(zip(history, conversation, strict=False)) if a != b),
                    min(len(history), len(conversation)))
        own = same if before is not None and before.model == result.model else 0    # other weights: none its own
        if self.manager.counters["blocks_copied_on_write"] > copies:   # the cut fell inside a full block
            assert result.num_committed == min(own, len(conversation) - 1) and result.num_committed % BLOCK_SIZE
            event("conversation resent: the full block at the cut copied")
        if result.num_committed > own:                       # the rest of what is kept: prefix hits alone
            assert result.num_committed % BLOCK_SIZE == 0, "K/V kept past where the conversation changed"
            chain = self.manager.hasher.chain(result.model, conversation, BLOCK_SIZE, 0, b"",
                                              result.num_committed // BLOCK_SIZE)
            for b, (digest, _) in enumerate(chain):
                if (b + 1) * BLOCK_SIZE > own:
                    assert self.manager.pool.hash_of[result.block_ids[b]] == digest, \
                        f"block {b} kept past where the conversation changed, and not a prefix hit"
            event("conversation resent: prefix hits past the history")
        event("conversation resent: kept K/V" if result.num_committed else "conversation resent: none kept")

    def run_step(self, slot: int, ops: list[Op]) -> bool:
        """Whether the Step was applied."""
        manager, worker = self.manager, self.slots[slot]
        before = dump(manager)
        # Releases never evict a cached block, takes may: predict hits only up to the first take.
        takes = [i for i, op in enumerate(ops) if not isinstance(op, Free | Park)]
        # An Open that continues a session already there resumes it: its cached count is the history's.
        resuming = {i for i, op in enumerate(ops) if isinstance(op, Open) and op.continue_session
                    and op.session_id in manager.sessions}
        expected_hit = bool(takes) and isinstance(ops[takes[0]], Open) and takes[0] not in resuming \
            and self.expected_cached(ops[takes[0]], worker)
        try:
            outcome = manager.step(worker, ops)
        except KvError as exc:
            event(f"step rejected: {exc.code}")
            assert isinstance(exc, OpError)
            assert 0 <= exc.index < len(ops)
            after = dump(manager)
            assert after == before, f"rejected step {ops} left a trace ({exc}): " + str(
                {k: (before[k], after[k]) for k in before if before[k] != after[k]})
            return False
        event(f"step of {len(ops)} op(s) applied")
        assert len(outcome.results) == len(ops)
        for i, (op, result) in enumerate(zip(ops, outcome.results, strict=True)):
            if isinstance(op, Open) and i not in resuming:
                limit = (len(op.token_ids) - 1) // BLOCK_SIZE if op.token_ids else 0
                assert result.num_cached % BLOCK_SIZE == 0
                assert result.num_cached <= limit * BLOCK_SIZE
                event("open: prefix hit" if result.num_cached else "open: no hit")
        if expected_hit:
            hit = outcome.results[takes[0]]
            assert hit.num_cached >= BLOCK_SIZE, f"{ops[takes[0]]} missed a cached first block"
        self.check_effects(before, ops, outcome.effects)
        after_step(manager, outcome, self.jobs)
        return True

    def check_effects(self, before: dict[str, Any], ops: list[Op], effects: list[PageEffect]) -> None:
        """A page is zeroed only if written before, and a written page is never handed out as it is."""
        pool, targets = self.manager.pool, set()
        # The retry of an interrupted turn (an Open continuing its session) releases what it does not keep; so
        # does a resume under other weights (another model's worker), whose pages are never read again.
        releases = any(isinstance(op, Free | Park | Resume) or (isinstance(op, Open) and op.continue_session)
                       for op in ops)
        for effect in effects:
            assert isinstance(effect, Zero | Copy | SwapIn)
            if isinstance(effect, SwapIn):
                assert len(effect.slots) == len(effect.pages) == len(effect.checksums) > 0
                # read before anyone may reuse the slots
                assert self.manager.swap.in_copy.issuperset(effect.slots)
                event("resume: swapped back in")
                dsts = effect.pages
            else:
                dsts = [effect.page]
            for dst in dsts:
                # A clean page is zeroed only if this Step took it, released it and takes it again.
                assert before["dirty"][dst] or not isinstance(effect, Zero) or releases
                # Only a page released by this very Step may be reused while it was referenced before.
                assert before["ref"][dst] == 0 or releases
                targets.add(dst)
        for block in range(NUM_BLOCKS):
            was_free_and_written = before["ref"][block] == 0 and before["dirty"][block]
            prefix_hit = before["hash_of"][block] is not None and pool.hash_of[block] == before["hash_of"][block]
            if was_free_and_written and pool.ref[block] and not prefix_hit:
                assert block in targets, f"block {block} handed out by {ops} without zeroing"

    def expected_cached(self, op: Open, worker: int) -> bool:
        """Whether the first block of `op` is a prefix hit as things stand before the Step."""
        if (len(op.token_ids) - 1) // BLOCK_SIZE < 1:
            return False
        model = self.manager.workers[worker].model
        chunk = token_bytes(op.token_ids[:BLOCK_SIZE])
        digest = self.manager.hasher.block_hash(b"", model, chunk)
        return self.manager.pool.lookup(digest, chunk) is not None

    # ---- rules ----------------------------------------------------------

    @rule(slot=st.integers(0, len(MODELS) - 1), data=st.data())
    def one_op(self, slot: int, data: st.DataObject) -> None:
        self.run_step(slot, [self.draw_op(data, self.slots[slot], extra=0)])

    @rule(slot=st.integers(0, len(MODELS) - 1), token_ids=tokens, reserve=reserves, session=sessions)
    def open_and_commit(self, slot: int, token_ids: list[int], reserve: int, session: str | None) -> None:
        """A prefill: the usual way blocks become cached, so later Opens can hit them."""
        new = self.manager._next_seq
        self.run_step(slot, [Open(token_ids, reserve, session), Extend(new, commit_to=len(token_ids))])

    @rule(slot=st.integers(0, len(MODELS) - 1), blocks=st.integers(1, NUM_BLOCKS))
    def open_a_large_reservation(self, slot: int, blocks: int) -> None:
        """Crowds the pool: evicts cached blocks, or is refused as RESOURCE_EXHAUSTED."""
        self.run_step(slot, [Open([], blocks * BLOCK_SIZE)])

    @rule(slot=st.integers(0, len(MODELS) - 1), data=st.data(), append=appended, park=st.booleans())
    def commit_a_running_sequence(self, slot: int, data: st.DataObject, append: list[int], park: bool) -> None:
        worker = self.slots[slot]
        mine = sorted(sid for sid, s in self.manager.seqs.items() if s.owner == worker)
        if not mine:
            return
        seq = self.manager.seqs[data.draw(st.sampled_from(mine))]
        commit_to = min(len(seq.token_ids) + len(append), seq.capacity)
        op = Park if park else Extend
        self.run_step(slot, [op(seq.seq_id, append, commit_to)])

    @rule(slot=st.integers(0, len(MODELS) - 1), data=st.data(), count=st.integers(2, 4))
    def several_ops(self, slot: int, data: st.DataObject, count: int) -> None:
        ops = [self.draw_op(data, self.slots[slot], extra=count) for _ in range(count)]
        self.run_step(slot, ops)

    @rule(slot=st.integers(0, len(MODELS) - 1), data=st.data(), count=st.integers(1, 3),
          failing=st.sampled_from((Free(NO_SUCH_SEQ), Resume(session_id="nope"),
                                   Open([0] * (NUM_BLOCKS * BLOCK_SIZE + 1)), Extend(NO_SUCH_SEQ))))
    def ops_then_a_failing_one(self, slot: int, data: st.DataObject, count: int, failing: Op) -> None:
        ops = [self.draw_op(data, self.slots[slot], extra=count) for _ in range(count)]
        before = dump(self.manager)
        with pytest.raises(OpError) as caught:
            self.manager.step(self.slots[slot], [*ops, failing])
        assert caught.value.index <= len(ops)
        assert dump(self.manager) == before

    @rule(data=st.data(), mode=st.sampled_from(("swap", "drop")))
    def evict(self, data: st.DataObject, mode: str) -> None:
        seq_id = data.draw(self.seq_ids())
        seq = self.manager.seqs.get(seq_id)
        before = dump(self.manager)
        if seq is None:
            with pytest.raises(NotFound):
                self.manager.evictions.force(seq_id=seq_id, mode=mode)
            assert dump(self.manager) == before
            return
        state = seq.state
        done = self.manager.evictions.force(seq_id=seq_id, mode=mode)
        self.jobs += done.jobs
        if state is SeqState.RUNNING:
            assert done == Evicted(revoked=[(seq_id, seq.owner)]) and self.manager.revoked[seq_id] == mode
            assert dump(self.manager) == before
        elif seq.state is SeqState.DROPPED:
            assert (seq.block_ids, seq.num_committed, seq.hashes, seq.slots) == ([], 0, [], [])
            assert tuple(seq.token_ids) == before["seqs"][seq_id][6]
            event(f"evict {mode}: dropped")
        else:
            assert (mode == "swap" and seq.seq_id in self.manager.swap_jobs) or seq.state is SeqState.SWAPPED
            event(f"evict {mode}: swapping")

    @precondition(lambda self: any(not job.ticket.started for job in self.jobs))
    @rule(data=st.data())
    def a_swap_copy_starts(self, data: st.DataObject) -> None:
        """The copy thread takes a queued swap-out: it starts unless it was called off before."""
        job = data.draw(st.sampled_from([job for job in self.jobs if not job.ticket.started]))
        assert job.ticket.begin() == (job in self.manager.swap_jobs.values())

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), fails=st.booleans(), stops=st.booleans())
    def a_swap_copy_finishes(self, data: st.DataObject, fails: bool, stops: bool) -> None:
        """As memd.step_runner: a copy that failed, never ran, or stopped when called off is aborted."""
        job = self.jobs.pop(data.draw(st.integers(0, len(self.jobs) - 1)))
        current = self.manager.swap_jobs.get(job.seq.seq_id) is job
        if not job.ticket.begin() or (stops and job.ticket.halt.is_set()):
            assert not current
            self.manager.evictions.abort_swap_out(job)
            assert job not in self.manager.stopping
            return
        if fails:
            self.manager.evictions.abort_swap_out(job)
            assert job.seq.state is not SeqState.SWAPPED or not current
            return
        assert self.manager.evictions.finish_swap_out(job) == current
        if current:
            assert job.seq.state is SeqState.SWAPPED and job.seq.slots == job.slots and not job.seq.block_ids
            event("swap-out finished")

    @precondition(lambda self: any(s.state is SeqState.PARKED for s in self.manager.seqs.values()))
    @rule(data=st.data(), finish=st.booleans())
    def swap_out_a_parked_sequence(self, data: st.DataObject, finish: bool) -> None:
        parked = sorted(sid for sid, s in self.manager.seqs.items() if s.state is SeqState.PARKED)
        done = self.manager.evictions.force(seq_id=data.draw(st.sampled_from(parked)), mode="swap")
        if finish:
            for job in done.jobs:
                assert self.manager.evictions.finish_swap_out(job)
                event("swap-out finished at once")
        else:
            self.jobs += done.jobs

    @precondition(lambda self: any(s.state is SeqState.SWAPPED for s in self.manager.seqs.values()))
    @rule(data=st.data(), reserve=reserves)
    def resume_a_swapped_sequence(self, data: st.DataObject, reserve: int) -> None:
        swapped = sorted(sid for sid, s in self.manager.seqs.items() if s.state is SeqState.SWAPPED)
        seq = self.manager.seqs[data.draw(st.sampled_from(swapped))]
        committed, tokens = seq.num_committed, list(seq.token_ids)
        slot = MODELS.index(seq.model)
        self.run_step(slot, [Resume(seq.seq_id, reserve=reserve)])
        if seq.state is SeqState.RUNNING:
            assert (seq.num_committed, list(seq.token_ids), seq.slots) == (committed, tokens, [])

    @rule(data=st.data())
    def pressure(self, data: st.DataObject) -> None:
        """The policy's sweep (watermark of 4 free blocks), or a Step's demand for room."""
        if data.draw(st.booleans()):
            self.jobs += self.manager.evictions.sweep(0.0).jobs
        else:
            self.jobs += self.manager.evictions.make_room(data.draw(st.integers(1, NUM_BLOCKS)),
                                                          reason=EvictionReason.PRESSURE).jobs

    @rule(slot=st.integers(0, len(MODELS) - 1), fence=st.booleans())
    def reclaim_and_reattach(self, slot: int, fence: bool) -> None:
        gone = self.slots[slot]
        running = {sid: (s.num_committed, s.session_id) for sid, s in self.manager.seqs.items()
                   if s.owner == gone or s.preempted_by == gone}
        for sid, (committed, session) in running.items():
            seq = self.manager.seqs[sid]
            if fence and seq.state is SeqState.RUNNING:    # a live worker may still write its partial page
                running[sid] = (committed - committed % seq.block_size, session)
        self.manager.reclaim(gone, fence=fence)
        self.slots[slot] = attach(self.manager, MODELS[slot])
        for sid, (committed, session) in running.items():
            seq = self.manager.seqs.get(sid)
            if session is None:
                assert seq is None
            else:
                assert seq is not None and seq.state is not SeqState.RUNNING and seq.owner is None
                assert seq.num_committed == committed and seq.interrupted and seq.preempted_by is None

    @precondition(lambda self: self.manager.fences)
    @rule(data=st.data())
    def a_fenced_worker_exits(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.manager.fences)))
        held = len(self.manager.fences[pid])
        free = self.manager.pool.num_free
        assert self.manager.lift(pid) == held and self.manager.pool.num_free == free + held

    @precondition(lambda self: self.manager.seqs)
    @rule(data=st.data())
    def running_belongs_to_its_worker(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.manager.seqs)))
        seq = self.manager.seqs[seq_id]
        others = [w for w in self.slots if w != seq.owner]
        if seq.state is SeqState.RUNNING:
            before = dump(self.manager)
            for op in (Extend(seq_id), Park(seq_id), Free(seq_id), Fork(seq_id), Resume(seq_id)):
                with pytest.raises(OpError) as caught:
                    self.manager.step(others[0], [op])
                assert caught.value.code in ("PERMISSION_DENIED", "FAILED_PRECONDITION")
            assert dump(self.manager) == before

    # ---- invariants -----------------------------------------------------

    @invariant()
    def no_violations(self) -> None:
        assert self.manager.violations() == []

    @invariant()
    def slots_in_copy_belong_to_a_copy_that_may_still_write_them(self) -> None:
        """A swap-out called off gives its slots back at once if its copy never began, else once it stops."""
        m = self.manager
        assert m.swap is not None
        owned = [slot for job in [*m.swap_jobs.values(), *m.stopping] for slot in job.slots]
        assert sorted(m.swap.in_copy) == sorted(owned)
        assert all(job.ticket.halt.is_set() and job.ticket.started and not job.slots_back for job in m.stopping)

    @invariant()
    def every_block_is_free_or_referenced(self) -> None:
        held = sum(1 for ref in self.manager.pool.ref if ref)
        assert held + self.manager.pool.num_free == NUM_BLOCKS

    def teardown(self) -> None:
        free_everything(self.manager, self.jobs)


KvManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_kv_manager_state_machine = KvManagerMachine.TestCase


# ---- examples ------------------------------------------------------------


def open_and_commit(manager: KvManager, worker: int, token_ids: list[int], **kw: Any) -> int:
    result = manager.step(worker, [Open(token_ids, **kw)]).results[0]
    manager.step(worker, [Extend(result.seq_id, commit_to=len(token_ids))])
    return result.seq_id


def test_committed_prefix_is_found_again_by_a_later_open():
    manager = new_manager()
    worker = attach(manager, "m")
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    first = open_and_commit(manager, worker, history)
    full_blocks = manager.seqs[first].block_ids[:2]
    manager.step(worker, [Free(first)])                            # cached, not evicted

    hit = manager.step(worker, [Open([*history, 10])]).results[0]
    assert hit.num_cached == 8
    assert hit.num_committed == 8
    assert manager.seqs[hit.seq_id].block_ids[:2] == full_blocks

    other = attach(manager, "n")                                   # same tokens, another model: no hit
    assert manager.step(other, [Open([*history, 10])]).results[0].num_cached == 0
    assert manager.violations() == []
    free_everything(manager)


def test_a_prefix_hit_shares_the_blocks_of_a_running_sequence():
    manager = new_manager()
    worker = attach(manager, "m")
    first = open_and_commit(manager, worker, [1, 2, 3, 4, 5])
    second = manager.step(worker, [Open([1, 2, 3, 4, 9, 9])]).results[0]
    assert second.num_cached == 4
    assert manager.seqs[second.seq_id].block_ids[0] == manager.seqs[first].block_ids[0]
    assert manager.pool.ref[manager.seqs[first].block_ids[0]] == 2
    assert manager.violations() == []
    free_everything(manager)


def test_open_leaves_the_last_token_to_compute():
    manager = new_manager()
    worker = attach(manager, "m")
    open_and_commit(manager, worker, [1, 2, 3, 4, 5, 6, 7, 8])
    again = manager.step(worker, [Open([1, 2, 3, 4, 5, 6, 7, 8])]).results[0]
    assert again.num_cached == 4                                   # (8 - 1) // 4 blocks
    free_everything(manager)


def test_an_evicted_prefix_is_not_found_once_its_pages_are_reused():
    manager = new_manager()
    worker = attach(manager, "m")
    seq = open_and_commit(manager, worker, [1, 2, 3, 4, 5])
    manager.step(worker, [Park(seq)])
    manager.evictions.force(seq_id=seq, mode="drop")
    filler = manager.step(worker, [Open([], reserve=NUM_BLOCKS * BLOCK_SIZE)]).results[0]   # takes every page
    manager.step(worker, [Free(filler.seq_id)])
    assert manager.step(worker, [Resume(seq)]).results[0].num_cached == 0
    free_everything(manager)


def test_a_dropped_sequence_resumes_from_its_still_cached_prefix():
    manager = new_manager()
    worker = attach(manager, "m")
    seq = open_and_commit(manager, worker, [1, 2, 3, 4, 5, 6, 7, 8, 9], session_id="s1")
    manager.step(worker, [Park(seq)])
    manager.evictions.force(session_id="s1", mode="drop")          # pages freed, prefix still cached
    assert manager.seqs[seq].state is SeqState.DROPPED
    resumed = manager.step(attach(manager, "m"), [Resume(session_id="s1")]).results[0]
    assert resumed.num_cached == 8
    assert list(resumed.token_ids) == [1, 2, 3, 4, 5, 6, 7, 8, 9]       # the worker recomputes token 9
    assert manager.violations() == []
    free_everything(manager)


def test_fork_shares_full_blocks_and_copies_the_partial_tail():
    manager = new_manager()
    worker = attach(manager, "m")
    parent = open_and_commit(manager, worker, [1, 2, 3, 4, 5, 6])
    outcome = manager.step(worker, [Fork(parent)])
    child = manager.seqs[outcome.results[0].seq_id]
    parent_blocks = manager.seqs[parent].block_ids
    assert child.block_ids[0] == parent_blocks[0]
    assert child.block_ids[1] != parent_blocks[1]
    assert outcome.effects == [Copy(parent_blocks[1], child.block_ids[1])]
    assert child.num_committed == 6
    assert manager.violations() == []
    free_everything(manager)


def test_a_step_rejected_by_a_late_op_changes_nothing():
    manager = new_manager()
    worker = attach(manager, "m")
    parked = open_and_commit(manager, worker, [1, 2, 3, 4, 5], session_id="s1")
    manager.step(worker, [Park(parked)])
    before = dump(manager)
    with pytest.raises(OpError) as caught:
        manager.step(worker, [
            Resume(session_id="s1", reserve=3),
            Extend(parked, append=[6, 7, 8], commit_to=8),
            Open([1, 2, 3, 4, 5, 6, 7, 8, 9], session_id="s2"),
            Fork(parked),
            Extend(parked, commit_to=2),                                # below the committed tokens
        ])
    assert caught.value.index == 4 and caught.value.code == "INVALID_ARGUMENT"
    assert dump(manager) == before
    free_everything(manager)


def test_a_step_that_exhausts_the_pool_changes_nothing():
    manager = new_manager()
    worker = attach(manager, "m")
    before = dump(manager)
    with pytest.raises(OpError) as caught:
        manager.step(worker, [Open([1, 2, 3, 4, 5]), Open([], reserve=(NUM_BLOCKS - 1) * BLOCK_SIZE)])
    assert caught.value.code == "RESOURCE_EXHAUSTED"
    assert dump(manager) == before
    free_everything(manager)


# The two below were bugs: a rejected Step whose pages left the free queue and
# re-entered it was rolled back with those pages relinked where they re-entered.


def test_rejected_step_that_frees_what_it_took_keeps_every_page_in_the_free_queue():
    manager = new_manager()
    worker = attach(manager, "m")
    held = open_and_commit(manager, worker, [1, 2, 3, 4])                  # block 0, cached
    before = dump(manager)
    with pytest.raises(OpError):
        manager.step(worker, [Open([5, 6, 7, 8]), Extend(held + 1, commit_to=4),   # block 1, cached
                              Free(held), Free(held + 1), Free(NO_SUCH_SEQ)])
    assert manager.violations() == []       # block 1 had ref 0 but was not in the free queue
    assert dump(manager) == before


def test_rejected_step_that_frees_what_it_took_keeps_the_free_queue_order():
    manager = new_manager()
    worker = attach(manager, "m")
    before = dump(manager)
    with pytest.raises(OpError):
        manager.step(worker, [Open([1, 2, 3, 4]), Extend(1, commit_to=4), Free(1), Free(NO_SUCH_SEQ)])
    assert dump(manager)["free"] == before["free"]          # block 0 moved from the front to the back


def test_heat_read_before_its_last_touch_does_not_overflow():
    manager = new_manager()
    worker = attach(manager, "m")
    seq = manager.seqs[open_and_commit(manager, worker, [1, 2, 3, 4, 5])]
    seq.heat_at += 10**6                  # a clock far ahead of `now`
    assert manager.heat(seq, 0.0) == seq.heat
    assert manager.evictions.reclaimable() == 0
    free_everything(manager)


def test_forks_parked_on_shared_blocks_are_reclaimable_together():
    manager = new_manager()
    worker = attach(manager, "m")
    parent = open_and_commit(manager, worker, list(range(16)))                # 4 full blocks
    child = manager.step(worker, [Fork(parent)]).results[0].seq_id
    manager.step(worker, [Park(parent), Park(child)])
    assert manager.evictions.reclaimable() == 4                                 # shared, but only by the two
    done = manager.evictions.make_room(NUM_BLOCKS, reason=EvictionReason.PRESSURE, mode="drop")
    assert sorted(done.dropped) == sorted([parent, child]) and done.blocks_freed == 4
    assert manager.pool.num_free == NUM_BLOCKS and manager.violations() == []
    free_everything(manager)


def test_a_sequence_preempted_and_freed_in_one_step_is_not_swapped_out():
    manager = new_manager()
    worker = attach(manager, "m")
    seq = open_and_commit(manager, worker, list(range(8)))
    outcome = manager.step(worker, [Park(seq, preempt=True), Free(seq)])
    assert outcome.evictions == [] and manager.swap_jobs == {}
    assert manager.counters["preemptions"] == 1
    free_everything(manager)


@pytest.mark.parametrize("began", [False, True])
def test_a_free_during_a_swap_out_gets_the_slots_back_at_once_or_when_the_copy_stops(began):
    m = new_manager()
    worker = attach(m, "m")
    chat = open_and_commit(m, worker, list(range(3 * BLOCK_SIZE)), session_id="chat")
    m.step(worker, [Park(chat)])
    job, = m.evictions.evict(m.seqs[chat], "swap", EvictionReason.FORCED).jobs
    if began:
        assert job.ticket.begin()                   # the copy thread is on it
    m.release_slots(m.step(worker, [Free(session_id="chat")]).read_slots)
    assert job.ticket.halt.is_set() and m.swap_jobs == {}
    if began:                                       # the slots are the copy's until it stops
        assert m.stopping == {job} and m.swap.num_free == SWAP_SLOTS - 3
        m.evictions.abort_swap_out(job)             # it stopped at its next chunk (memd.step_runner)
    else:
        assert not job.ticket.begin()               # it never will: its slots are free already
        assert m.stopping == set() and m.swap.num_free == SWAP_SLOTS
        assert not m.evictions.finish_swap_out(job)  # a late word from the copier gives nothing twice
    assert m.swap.num_free == SWAP_SLOTS and m.swap.in_copy == set() and m.violations() == []


@pytest.mark.parametrize("freed", [False, True])
def test_a_swapped_session_comes_back_as_one_swap_in_and_none_once_freed_in_the_same_step(freed):
    m = KvManager(GEOMETRY, hash_key=b"k" * 32, swap_slots=SWAP_SLOTS, prefix_cache=False)   # every page copied
    worker = attach(m, "m")
    chat = open_and_commit(m, worker, list(range(3 * BLOCK_SIZE + 1)), session_id="chat")
    m.step(worker, [Park(chat)])
    job, = m.evictions.evict(m.seqs[chat], "swap", EvictionReason.FORCED).jobs
    job.checksums = [7, 8, 9, 10]
    assert m.evictions.finish_swap_out(job)
    slots = m.seqs[chat].slots
    outcome = m.step(worker, [Resume(session_id="chat")] + ([Free(session_id="chat")] if freed else []))
    if freed:                                      # its pages free again: nothing reads the slots into them
        assert outcome.effects == [] and sorted(outcome.read_slots) == sorted(slots)
    else:
        swap_in, = outcome.effects
        assert swap_in == SwapIn(slots, m.seqs[chat].block_ids, [7, 8, 9, 10])
        m.effects_landed(outcome)
        # What the full blocks hold from now on (the partly filled last one's is written to again).
        assert [m.pool.checksum[b] for b in m.seqs[chat].block_ids] == [7, 8, 9, 0]
    m.release_slots(outcome.read_slots)
    assert m.violations() == []


def test_a_turn_retried_after_its_worker_died_keeps_the_prefill_it_shares_and_nothing_else():
    m = new_manager()
    first, second = attach(m, "m"), attach(m, "m")
    history = open_and_commit(m, first, [1, 2, 3, 4, 5], session_id="chat")
    m.step(first, [Park(history, commit_to=5)])                        # turn 1 ended
    prompt = [6, 7, 8, 9, 10, 11]
    resumed, = m.step(first, [Open(prompt, reserve=4, session_id="chat", continue_session=True)]).results
    m.step(first, [Extend(history, append=[42], commit_to=11)])         # prefill done, one token sampled
    m.reclaim(first)                                                    # kill -9 mid-decode
    seq = m.seqs[history]
    assert seq.interrupted and seq.num_committed == 11 and seq.token_ids[-1] == 42

    retried, = m.step(second, [Open(prompt, reserve=1, session_id="chat", continue_session=True)]).results
    assert list(retried.token_ids) == [1, 2, 3, 4, 5, *prompt]               # the sampled token is gone
    assert retried.num_committed == 10 and retried.num_cached == 10   # the prefill is not done again, but
    #                                                                   the last token: its logits are needed
    assert not seq.interrupted and m.counters["turns_retried"] == 1
    m.step(second, [Park(history, commit_to=11)])
    m.reclaim(second)                                                   # nothing running: nothing interrupted
    assert not seq.interrupted

    changed = [6, 7, 99]
    m.step(second := attach(m, "m"), [Open(changed, session_id="chat", continue_session=True)])
    m.reclaim(second)
    third = attach(m, "m")
    again, = m.step(third, [Open(changed, session_id="chat", continue_session=True)]).results
    assert list(again.token_ids) == [1, 2, 3, 4, 5, *prompt, *changed] and again.num_committed == 11
    assert resumed.seq_id == retried.seq_id == again.seq_id == history
    assert m.violations() == []


def test_a_finished_turn_sent_again_with_its_turn_id_replaces_itself():
    m = new_manager()
    worker = attach(m, "m")
    chat = open_and_commit(m, worker, [1, 2, 3, 4, 5], session_id="chat", turn_id="t1")
    m.step(worker, [Park(chat, commit_to=5)])
    prompt = [6, 7, 8, 9, 10, 11]
    m.step(worker, [Open(prompt, reserve=4, session_id="chat", continue_session=True, turn_id="t2")])
    m.step(worker, [Park(chat, append=[42, 43], commit_to=12)])       # answered; the answer never arrived
    again, = m.step(worker, [Open(prompt, reserve=4, session_id="chat", continue_session=True,
                                  turn_id="t2")]).results
    assert list(again.token_ids) == [1, 2, 3, 4, 5, *prompt]                 # the turn once, its answer gone
    # Up to the prompt's last token: the full block the answer began in is copied, not recomputed.
    assert again.num_committed == again.num_cached == 10
    assert m.counters["turns_retried"] == 1 and m.counters["blocks_copied_on_write"] == 1
    m.step(worker, [Park(chat, append=[42, 43], commit_to=12)])
    m.step(worker, [Open([50], session_id="chat", continue_session=True, turn_id="t3")])
    m.step(worker, [Park(chat, commit_to=13)])
    # The same message under another turn id (or none) is a new turn: the user said it twice.
    twice, = m.step(worker, [Open([50], session_id="chat", continue_session=True, turn_id="t4")]).results
    assert list(twice.token_ids) == [1, 2, 3, 4, 5, *prompt, 42, 43, 50, 50] and m.counters["turns_retried"] == 1
    assert m.violations() == []


def test_a_different_prompt_replaces_the_failed_turn_from_where_they_part():
    m = new_manager()
    worker = attach(m, "m")
    seq_id = open_and_commit(m, worker, [1, 2, 3, 4, 5, 6, 7, 8, 9], session_id="chat")
    m.reclaim(worker)                                                  # the first turn never ended
    worker = attach(m, "m")
    retried, = m.step(worker, [Open([1, 2, 3, 4, 5, 0], session_id="chat", continue_session=True)]).results
    assert list(retried.token_ids) == [1, 2, 3, 4, 5, 0]
    # Token 5 sat in a full block, which is never written again: the session gets a copy of it to write.
    assert retried.num_committed == 5 and len(m.seqs[seq_id].block_ids) == 2
    assert m.seqs[seq_id].block_ids[1] != 1 and m.counters["blocks_copied_on_write"] == 1
    assert m.violations() == []


def test_a_resent_conversation_keeps_the_kv_of_what_it_shares_and_nothing_past_an_edit():
    m = new_manager()
    worker = attach(m, "m")
    chat = open_and_commit(m, worker, [1, 2, 3, 4, 5], session_id="chat")
    m.step(worker, [Park(chat, append=[42, 43], commit_to=6)])        # the answer's last token never computed

    def resend(conversation: list[int]) -> OpResult:
        result, = m.step(worker, [Open(conversation, reserve=1, session_id="chat", continue_session=True,
                                       whole_history=True)]).results
        m.step(worker, [Park(chat, commit_to=result.num_committed)])
        return result

    grown = resend([1, 2, 3, 4, 5, 42, 43, 7, 8])                      # the next turn: the whole of it again
    assert grown.seq_id == chat and list(grown.token_ids) == [1, 2, 3, 4, 5, 42, 43, 7, 8]
    assert grown.num_cached == grown.num_committed == 6                # the partial block's K/V too
    same = resend([1, 2, 3, 4, 5, 42, 43, 7, 8])                       # sent again as it is (a regenerate)
    assert same.num_committed == 6                                     # the last token's logits are recomputed
    edited = resend([1, 2, 3, 9, 9])                                   # an earlier message changed
    assert list(edited.token_ids) == [1, 2, 3, 9, 9]
    assert edited.num_committed == 3          # token 3 sat in a full block, never written again: copied
    assert m.seqs[chat].turn_start == 3 and m.violations() == []


def test_a_session_resent_with_another_conversation_takes_what_the_prefix_cache_holds_of_it():
    # A client reusing a session id for a new conversation (or editing its first message): the session's own
    # K/V goes past the change, but another session's system prompt is read from the prefix cache, not computed.
    m = new_manager()
    worker = attach(m, "m")
    system = list(range(100, 100 + 3 * BLOCK_SIZE))
    other = open_and_commit(m, worker, [*system, 7])
    chat = open_and_commit(m, worker, [1, 2, 3, 4, 5], session_id="chat")
    m.step(worker, [Park(chat, commit_to=5)])
    resent, = m.step(worker, [Open([*system, 8, 9], reserve=1, session_id="chat", continue_session=True,
                                   whole_history=True)]).results
    assert resent.seq_id == chat and list(resent.token_ids) == [*system, 8, 9]
    assert resent.num_cached == resent.num_committed == 3 * BLOCK_SIZE
    assert resent.block_ids[:3] == m.seqs[other].block_ids[:3]
    assert m.violations() == []


def test_a_conversation_resent_under_other_weights_keeps_none_of_its_own_kv_but_takes_prefix_hits():
    # Found by the state machine: its own history is of no use under the new weights, the new model's
    # prefix cache is (the K/V of the same tokens at the same positions, computed by these weights).
    m = new_manager()
    other_model = attach(m, "n")
    m.step(other_model, [Open([1], session_id="chat")])
    m.reclaim(other_model)                                             # parked, under model "n"
    worker = attach(m, "m")
    cached = open_and_commit(m, worker, [1, 1, 1, 1])
    resent, = m.step(worker, [Open([1, 1, 1, 1, 0], session_id="chat", continue_session=True,
                                   whole_history=True)]).results
    assert m.seqs[resent.seq_id].model == "m" and list(resent.token_ids) == [1, 1, 1, 1, 0]
    assert resent.num_committed == 4 and resent.block_ids[0] == m.seqs[cached].block_ids[0]
    assert m.violations() == []


def test_whole_history_needs_a_session_and_changes_nothing_when_refused():
    m = new_manager()
    worker = attach(m, "m")
    before = dump(m)
    for op in (Open([1, 2, 3], whole_history=True), Open([1, 2, 3], session_id="s", whole_history=True),
               Open([], session_id="s", continue_session=True, whole_history=True)):
        with pytest.raises(OpError) as err:
            m.step(worker, [op])
        assert err.value.code == "INVALID_ARGUMENT" and "whole_history" in str(err.value)
        assert dump(m) == before


def test_a_sequence_freed_with_its_progress_leaves_its_full_blocks_in_the_prefix_cache():
    m = new_manager()
    worker = attach(m, "m")
    seq, = m.step(worker, [Open([1, 2, 3, 4, 5, 6], reserve=4)]).results      # nothing committed yet
    m.step(worker, [Free(seq.seq_id, append=[7, 8, 9], commit_to=9)])        # prefill and decode done
    again, = m.step(worker, [Open([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])]).results
    assert again.num_cached == 8                                              # both full blocks
    with pytest.raises(OpError) as refused:                                   # only its running worker commits
        m.step(worker, [Free(again.seq_id, commit_to=99)])
    assert refused.value.code == "INVALID_ARGUMENT" and m.violations() == []


def test_without_the_prefix_cache_nothing_is_shared_but_a_session_still_resumes():
    m = KvManager(GEOMETRY, hash_key=b"k" * 32, swap_slots=SWAP_SLOTS, prefix_cache=False)
    worker = attach(m, "m")
    chat = open_and_commit(m, worker, [1, 2, 3, 4, 5, 6, 7, 8, 9], session_id="chat")
    other, = m.step(worker, [Open([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])]).results
    assert other.num_cached == 0 and m.pool.by_hash == {}                   # the same prefix, computed again
    m.step(worker, [Park(chat, commit_to=9), Free(other.seq_id, commit_to=0)])
    resumed, = m.step(worker, [Open([10], session_id="chat", continue_session=True)]).results
    assert resumed.num_cached == 9 and m.violations() == []


def test_a_session_whose_turn_is_preempted_is_busy_for_a_new_turn():
    m = new_manager()
    worker = attach(m, "m")
    chat = open_and_commit(m, worker, [1, 2, 3, 4, 5], session_id="chat")
    m.step(worker, [Park(chat, commit_to=5, preempt=True)])                   # waits for pages to come back
    before = dump(m)
    for op in (Open([9], session_id="chat", continue_session=True),
               Open([1, 2, 3, 4, 5, 9], session_id="chat", continue_session=True, whole_history=True)):
        with pytest.raises(OpError) as busy:
            m.step(worker, [op])
        assert busy.value.code == "FAILED_PRECONDITION" and "in flight" in str(busy.value)
        assert dump(m) == before
    resumed, = m.step(worker, [Resume(chat)]).results                          # its own request resumes it
    assert list(resumed.token_ids) == [1, 2, 3, 4, 5] and m.violations() == []


@pytest.mark.parametrize("swapped", [False, True], ids=["parked", "swapped"])
def test_a_session_resumed_under_other_weights_keeps_its_history_and_none_of_its_kv(swapped):
    m = new_manager()
    old, new = attach(m, "weights-a"), attach(m, "weights-b")
    chat = open_and_commit(m, old, [1, 2, 3, 4, 5, 6], session_id="chat")
    m.step(old, [Park(chat, commit_to=6)])
    if swapped:
        jobs = m.evictions.evict(m.seqs[chat], "swap", EvictionReason.FORCED).jobs
        assert m.evictions.finish_swap_out(jobs[0]) and m.seqs[chat].state is SeqState.SWAPPED
    outcome = m.step(new, [Open([7], session_id="chat", continue_session=True)])
    resumed, = outcome.results
    assert list(resumed.token_ids) == [1, 2, 3, 4, 5, 6, 7] and resumed.num_cached == 0       # recomputed, not refused
    assert not any(isinstance(e, SwapIn) for e in outcome.effects)                       # old bytes never read
    assert m.seqs[chat].model == "weights-b" and m.counters["resumed_under_other_weights"] == 1
    m.release_slots(outcome.read_slots)
    assert m.violations() == []
    free_everything(m)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=80), st.lists(st.integers(-1, 3), max_size=80))
def test_the_tokens_two_histories_share_are_counted_whatever_their_lengths(history, tokens):
    """memd.step_ops._common_prefix compares whole, then halves; it says what a plain loop says, also past a
    token no history holds (-1)."""
    from array import array

    from memd.step_ops import _common_prefix

    mine = array("I", history)
    for theirs in (tokens, history + tokens, history[:len(history) // 2] + tokens):
        same = 0
        while same < min(len(mine), len(theirs)) and mine[same] == theirs[same]:
            same += 1
        assert _common_prefix(mine, theirs) == same


def test_a_resumed_session_counts_its_own_kv_apart_from_prefix_hits():
    m = new_manager()
    worker = attach(m, "m")
    chat = open_and_commit(m, worker, [1, 2, 3, 4, 5, 6], session_id="chat")
    m.step(worker, [Park(chat, commit_to=6)])
    resumed, = m.step(worker, [Open([7, 8], session_id="chat", continue_session=True)]).results
    assert resumed.num_cached == 6
    assert m.counters["session_hit_tokens"] == 6 and m.counters["prefix_hit_tokens"] == 0
    assert m.violations() == []


def test_forgetting_a_models_cached_prefixes_leaves_other_models_and_every_page_alone():
    m = new_manager()
    mine, other = attach(m, "m"), attach(m, "other")
    prompt = list(range(3 * BLOCK_SIZE + 1))
    for worker in (mine, other):
        cached, = m.step(worker, [Open(prompt)]).results
        m.step(worker, [Free(cached.seq_id, commit_to=len(prompt))])
    kept, = m.step(mine, [Open(prompt, session_id="kept")]).results
    m.step(mine, [Park(kept.seq_id, commit_to=len(prompt))])
    tables = {s.seq_id: list(s.block_ids) for s in m.seqs.values()}
    assert m.forget_cached("m") == 3
    again, = m.step(mine, [Open(prompt)]).results
    theirs, = m.step(other, [Open(prompt)]).results
    assert (again.num_cached, theirs.num_cached) == (0, 3 * BLOCK_SIZE)
    assert {s.seq_id: list(s.block_ids) for s in m.seqs.values() if s.seq_id in tables} == tables
    assert m.violations() == []
