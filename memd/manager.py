"""The KV manager: workers, sequences and pages, changed only by whole Steps.

All state lives on memd's one event loop, so nothing here locks. A Step runs
its operations in order under a journal; the first error rolls everything
back, so a rejected Step leaves no trace. Page contents are never touched
here: a committed Step returns the zeroing, copying and swap-ins it needs as
effects, which the caller performs before the worker hears back.

Ownership: a RUNNING sequence belongs to one worker, which alone may change
it. PARKED and DROPPED sequences belong to memd; any worker of the same model
may resume or free them. Only full committed blocks are ever shared (prefix
hits, forks), so every position a RUNNING sequence may write is its own.

Memory pressure (swap-outs, drops, idle TTL, forced evictions) happens
outside Steps, in `memd.eviction`; a Step only swaps a sequence back in on
resume, and hands over what a preempting Park asks to be evicted.
"""

from __future__ import annotations

import hmac
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from memd.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvError,
    NotFound,
    OpError,
    PermissionDenied,
    PoolExhausted,
)
from memd.eviction import Eviction, EvictionReason, Evictor
from memd.invariants import violations
from memd.page_effects import Copy, SwapIn, Zero
from memd.pool import BlockPool, SwapSlots, UndoLog
from memd.sequences import PrefixHasher, SeqState, Sequence, SwapOut, blocks_for
from memd.step_outcome import StepOutcome, SwappedInBlock
from shared.geometry import PoolGeometry
from shared.ops import Extend, Fork, Free, Op, Open, OpResult, Park, Resume

MAX_NAME = 256                  # characters of a session id, model or worker name


@dataclass(slots=True)
class Worker:
    worker_id: int
    name: str
    pid: int
    model: str
    block_size: int
    last_seen: float
    lease: bytes = b""            # the secret its Steps and Session stream must present
    streaming: bool = False


@dataclass(slots=True)
class _Txn:
    """One Step in progress: its undo log, the sequences it saved, and the outcome it builds."""

    worker: Worker
    undo: UndoLog
    saved: set[int] = field(default_factory=set)
    touched: dict[int, Sequence] = field(default_factory=dict)
    counters: Counter[str] = field(default_factory=Counter)
    outcome: StepOutcome = field(default_factory=StepOutcome)


@dataclass(frozen=True, slots=True)
class Changes:
    """What changed since the journal last took the changes (`KvManager.take_changes`)."""

    seq_ids: set[int]           # sequences changed or gone
    tokens_cut: set[int]         # of those, sequences whose token ids were cut back (a retried turn)
    fence_pids: set[int]        # processes whose fenced pages changed


class KvManager:
    """Workers, sequences and pages; changed by Steps (`step`) and by the few calls outside them below.

    Others read `seqs`, `sessions`, `workers`, `fences`, `pool` and `swap`
    and change them only through methods, with one exception: memd.eviction,
    the policy acting for the manager, moves PARKED and SWAPPED sequences
    through `release`, `forget` and the swap-out table (`swap_jobs`), and says
    so with `mark_changed`. The step runner adds to `counters` and takes a
    revocation out of `revoked` once it evicted the sequence; the lease
    stream marks its Worker streaming and seen. What changed is kept
    privately for the journal, which alone takes it (`take_changes`).
    """

    def __init__(self, geometry: PoolGeometry, *, hash_key: bytes | None = None,
                 heat_decay: float = 0.9, heat_interval_s: float = 10.0, swap_slots: int = 0,
                 idle_ttl_s: float = 0.0, watermark_blocks: int = 0, prefix_cache: bool = True) -> None:
        self.geometry = geometry
        # Off (memd --no-prefix-cache): no block is ever offered to or found in the prefix cache;
        # a session's own parked sequence is still resumed. For measuring what the cache is worth.
        self.prefix_cache = prefix_cache
        self.pool = BlockPool(geometry.num_blocks)
        self.swap = SwapSlots(swap_slots) if swap_slots else None
        self.swap_jobs: dict[int, SwapOut] = {}        # by sequence id: swap-outs being copied
        self.revoked: dict[int, str] = {}              # running sequences an operator evicted: mode
        self.seqs: dict[int, Sequence] = {}
        self.sessions: dict[str, int] = {}
        self.workers: dict[int, Worker] = {}
        self.counters: Counter[str] = Counter()
        self.hasher = PrefixHasher(hash_key or os.urandom(32))
        self.heat_decay, self.heat_interval_s = heat_decay, heat_interval_s
        self._next_seq = 1
        self._next_worker = 1
        # Sequences whose pages a Step's effects are still filling (journaled: they come back DROPPED
        # if memd dies first).
        self._filling: set[int] = set()
        # For the journal (memd.journal), which alone takes them (`take_changes`): sequences changed
        # since, those of them whose token ids were cut back, and pids whose fence changed.
        self._changed: set[int] = set()
        self._tokens_cut: set[int] = set()
        self._fences_changed: set[int] = set()
        # Pages a worker that may still be running could write late (its turns' unwritten tails), kept
        # from reuse by the pid of that worker until it exits or attaches again (memd.fences watches).
        self.fences: dict[int, list[int]] = {}
        self.evictions = Evictor(self, idle_ttl_s=idle_ttl_s, watermark_blocks=watermark_blocks)

    # ---- workers -------------------------------------------------------

    def attach(self, name: str, pid: int, model: str, block_size: int, bytes_per_token: int) -> Worker:
        for what, value in (("worker name", name), ("model", model)):
            _check_name(what, value)
        block_size = block_size or self.geometry.block_size
        if block_size <= 0:
            raise InvalidArgument("block_size is required: memd was sized by --block-bytes, not by a model")
        if bytes_per_token and block_size * bytes_per_token > self.geometry.block_bytes:
            raise InvalidArgument(
                f"a block of {block_size} tokens x {bytes_per_token} bytes does not fit "
                f"a page of {self.geometry.block_bytes} bytes")
        worker = Worker(self._next_worker, name, pid, model or "default", block_size, time.monotonic(),
                        os.urandom(16))
        self._next_worker += 1
        self.workers[worker.worker_id] = worker
        self.counters["attaches"] += 1
        return worker

    def worker(self, worker_id: int, lease: bytes | None = None) -> Worker:
        """The worker holding a live lease; `lease` is checked unless the caller is in-process (None)."""
        worker = self.workers.get(worker_id)
        if worker is None:
            raise FailedPrecondition(f"worker {worker_id} holds no lease (never attached, or reclaimed); attach again")
        if lease is not None and not hmac.compare_digest(lease, worker.lease):
            raise PermissionDenied(f"wrong lease secret for worker {worker_id}")
        return worker

    def expired_workers(self, now: float, lease_timeout_s: float) -> list[int]:
        return [w.worker_id for w in self.workers.values() if now - w.last_seen > lease_timeout_s]

    def reclaim(self, worker_id: int, *, fence: bool = False) -> tuple[int, int]:
        """A worker is gone: park its sessions' sequences at their committed length, marked interrupted.

        Those it ran, and those it had preempted and meant to resume. A
        sequence without a session is freed: only that worker knew its id
        (its full blocks stay in the prefix cache). `fence`: its process may
        still be in a forward pass (a lease that expired, a stream that broke):
        every page that pass may write is fenced under its pid instead of freed
        (`lift`) — the reserved tails, and the partly written last page too, so
        a running session keeps only its whole blocks (the few tokens past them
        are recomputed when it resumes). Kept, that page would go to the next
        tenant once the session is evicted or reset, or to the session's next
        writer, and a late write would land on their K/V. Returns (parked, freed).
        """
        worker = self.workers.pop(worker_id, None)
        held: list[int] | None = [] if fence and worker is not None and worker.pid > 0 else None
        parked = freed = 0
        for seq in [s for s in self.seqs.values() if s.owner == worker_id or s.preempted_by == worker_id]:
            if seq.session_id is None:
                if held is not None and seq.state is SeqState.RUNNING:
                    held += seq.block_ids[seq.num_full_blocks:]
                    del seq.block_ids[seq.num_full_blocks:]
                self.release(seq)
                self.forget(seq)
                freed += 1
                continue
            if seq.state is SeqState.RUNNING:
                self._park(seq, held)
            seq.preempted_by = None
            seq.interrupted = True               # its turn failed: the retry of it replaces it (_retry_turn)
            self._changed.add(seq.seq_id)
            parked += 1
        if held and worker is not None:
            self.fences.setdefault(worker.pid, []).extend(held)
            self._fences_changed.add(worker.pid)
            self.counters["pages_fenced"] += len(held)
        self.counters["reclaims"] += 1
        return parked, freed

    def lift(self, pid: int) -> int:
        """The process with `pid` exited or attached again: nothing it runs writes its fenced pages now."""
        blocks = self.fences.pop(pid, [])
        if blocks:
            self._fences_changed.add(pid)
        return self.release_blocks(blocks)

    # ---- steps ---------------------------------------------------------

    def step(self, worker_id: int, ops: Iterable[Op], lease: bytes | None = None) -> StepOutcome:
        worker = self.worker(worker_id, lease)
        worker.last_seen = time.monotonic()
        txn = _Txn(worker, UndoLog())
        out = txn.outcome
        self.pool.undo = txn.undo
        try:
            for index, op in enumerate(ops):
                try:
                    out.results.append(self._run_op(txn, op))
                except KvError as exc:
                    raise OpError(index, _describe(op), exc) from None
        except BaseException:
            txn.undo.rollback()
            raise
        finally:
            self.pool.undo = None
        now = time.monotonic()
        for seq in txn.touched.values():
            self._touch(seq, now)
        self._changed.update(txn.touched)
        self._filling.update(out.filling)
        self.counters.update(txn.counters)
        self.counters["steps"] += 1
        self.counters["ops"] += len(out.results)
        # A sequence this Step preempted and then freed (or resumed) is no longer there to evict.
        out.evictions = [e for e in out.evictions if self.evictable(e.seq)]
        if out.read_slots:
            assert self.swap is not None
            self.swap.in_copy.update(out.read_slots)     # the sequence let go; the copy still reads them
        # A page this Step took and gave back needs no effect: it is free again, and
        # zeroed when next handed out. Late effects on a free page could hit its next tenant.
        out.effects = [e for e in out.effects if self.pool.ref[e.page] > 0]
        return out

    def effects_landed(self, outcome: StepOutcome) -> None:
        """A Step's page effects are done: its swapped-in blocks may serve prefix hits, its pages be journaled.

        A swapped-in block joins the prefix cache only while its sequence still
        holds it at that index: a drop in between may have handed the page to someone else.
        """
        for b in outcome.swapped_in:
            seq = b.seq
            if b.index < len(seq.block_ids) and seq.block_ids[b.index] == b.block and b.index < len(seq.hashes) \
                    and self.seqs.get(seq.seq_id) is seq:
                bs = seq.block_size
                self._offer(b.block, seq.hashes[b.index], tuple(seq.token_ids[b.index * bs:(b.index + 1) * bs]))
        self._filling -= outcome.filling
        self._changed |= outcome.filling

    def filling(self, seq_id: int) -> bool:
        """Whether a Step's effects are still filling this sequence's pages."""
        return seq_id in self._filling

    def take_changes(self) -> Changes:
        """What changed since the last call, for the journal: the one consumer, which must write all of it."""
        changes = Changes(self._changed, self._tokens_cut, self._fences_changed)
        self._changed, self._tokens_cut, self._fences_changed = set(), set(), set()
        return changes

    def adopt(self, seqs: list[Sequence], next_seq: int, fences: dict[int, list[int]] | None = None) -> None:
        """Take over sequences recovered from an earlier memd's journal (memd.recovery.restore checked them).

        Every page's content is unknown now, so all are zeroed before reuse;
        the prefix index is rebuilt from the adopted sequences' token ids.
        """
        self.pool.dirty[:] = b"\x01" * self.pool.num_blocks
        now = time.monotonic()
        for seq in seqs:
            seq.heat_at, seq.last_access = min(seq.heat_at, now), min(seq.last_access, now)   # another boot's clock
            self.seqs[seq.seq_id] = seq
            if seq.session_id:
                self.sessions[seq.session_id] = seq.seq_id
            for block in seq.block_ids:
                self.pool.incref(block)
            if self.swap is not None and seq.slots:
                self.swap.claim(seq.slots)
            chain = self.hasher.chain(seq.model, seq.token_ids, seq.block_size, 0, b"", seq.num_full_blocks)
            seq.hashes = [digest for digest, _ in chain]
            if seq.state is SeqState.PARKED:
                for block, (digest, chunk) in zip(seq.block_ids, chain, strict=False):
                    self._offer(block, digest, chunk)
        for pid, blocks in (fences or {}).items():
            for block in blocks:
                self.pool.incref(block)
            self.fences[pid] = list(blocks)
        self._next_seq = max(self._next_seq, next_seq)
        self.take_changes()            # all of it is in the journal it came from

    def release_slots(self, slots: list[int]) -> None:
        """The effects of a Step are done: the swap slots it read are free."""
        if slots:
            assert self.swap is not None
            self.swap.give(slots)

    def _run_op(self, txn: _Txn, op: Op) -> OpResult:
        match op:
            case Open():
                return self._open(txn, op)
            case Extend():
                return self._extend(txn, op)
            case Park():
                return self._park_op(txn, op)
            case Resume():
                return self._resume(txn, op)
            case Free():
                return self._free(txn, op)
            case Fork():
                return self._fork(txn, op)
        raise InvalidArgument(f"unknown operation {op!r}")

    def _open(self, txn: _Txn, op: Open) -> OpResult:
        worker = txn.worker
        _check_name("turn id", op.turn_id or "")
        if op.whole_history and not (op.continue_session and op.session_id and op.token_ids):
            raise InvalidArgument("whole_history names a session's whole conversation: give session_id, "
                                  "continue_session and its token ids")
        if op.continue_session and op.session_id in self.sessions:
            held = self.seqs[self.sessions[op.session_id]]
            if held.preempted_by is not None:         # a turn in flight, waiting for pages: not a new turn's
                raise FailedPrecondition(f"session {op.session_id!r} has a turn in flight (sequence "
                                         f"{held.seq_id} is running, preempted by worker {held.preempted_by})")
            return self._resume(txn, Resume(session_id=op.session_id, reserve=op.reserve), op.token_ids,
                                op.turn_id or "", whole_history=op.whole_history)
        self._check_session_free(op.session_id)
        self._check_fits(len(op.token_ids) + op.reserve, worker.block_size)
        seq = Sequence(self._next_seq, worker.model, worker.block_size, worker.worker_id, SeqState.RUNNING,
                       [], 0, list(op.token_ids), session_id=op.session_id or None, turn_id=op.turn_id or "")
        self._next_seq += 1
        self._create(txn, seq)
        cached = self._match_prefix(txn, seq)
        self._grow(txn, seq, len(seq.token_ids) + op.reserve)
        return _result(seq, 0, cached, history=op.continue_session)

    def _extend(self, txn: _Txn, op: Extend) -> OpResult:
        seq = self._own(txn, op.seq_id)
        self._commit(txn, seq, op.append, op.commit_to)
        first = len(seq.block_ids)
        self._grow(txn, seq, len(seq.token_ids) + op.reserve)
        return _result(seq, first)

    def _park_op(self, txn: _Txn, op: Park) -> OpResult:
        seq = self._own(txn, op.seq_id)
        self._commit(txn, seq, op.append, op.commit_to)
        cut = seq.block_ids[blocks_for(seq.num_committed, seq.block_size):]
        if cut:
            # The whole table, not the cut: a later op of this Step (a Resume) may grow it again.
            txn.undo.record(_set_blocks, seq, list(seq.block_ids))
        self._park(seq)
        mode = self.revoked.get(seq.seq_id)
        seq.preempted_by = txn.worker.worker_id if op.preempt else None
        if op.preempt:
            txn.counters["preemptions"] += 1
            txn.outcome.evictions.append(Eviction(seq, mode or "swap", EvictionReason.FORCED if mode else None))
        elif mode is not None:
            txn.outcome.evictions.append(Eviction(seq, mode, EvictionReason.FORCED))
        return _result(seq, len(seq.block_ids))

    def _resume(self, txn: _Txn, op: Resume, append: list[int] | tuple[()] = (), turn_id: str = "", *,
                whole_history: bool = False) -> OpResult:
        worker = txn.worker
        seq = self.find(op.seq_id, op.session_id)
        if seq.state is SeqState.RUNNING:
            if seq.owner == worker.worker_id:
                raise FailedPrecondition(f"sequence {seq.seq_id} is already running on this worker")
            raise PermissionDenied(f"sequence {seq.seq_id} is running on worker {seq.owner}")
        self._check_fits((0 if whole_history else len(seq.token_ids)) + len(append) + op.reserve, worker.block_size)
        self._save(txn, seq)
        self._cancel_swap_out(txn, seq)
        if (seq.model, seq.block_size) != (worker.model, worker.block_size):
            self._recompute_under(txn, seq, worker)
        if whole_history:
            append = self._replace_history(txn, seq, list(append))
            seq.turn_id = turn_id
        elif seq.preempted_by is None and append:        # a new turn, not a preempted request coming back
            # The same turn again: its worker died mid-turn, or after the turn ended but before the client
            # heard the answer (then only the client can tell a retry from a new message: by its turn id).
            if seq.interrupted or (turn_id and turn_id == seq.turn_id):
                append = self._retry_turn(txn, seq, append)
            else:
                seq.turn_start = len(seq.token_ids)
            seq.turn_id = turn_id
        seq.interrupted = False
        seq.preempted_by = None
        seq.token_ids.extend(append)
        if seq.state is SeqState.DROPPED:
            cached = self._match_prefix(txn, seq)
        elif seq.state is SeqState.SWAPPED:
            cached = self._swap_in(txn, seq)
        else:
            cached = seq.num_committed
        seq.state, seq.owner = SeqState.RUNNING, worker.worker_id
        self._grow(txn, seq, len(seq.token_ids) + op.reserve)
        txn.counters["resumes"] += 1
        return _result(seq, 0, cached, history=True)

    def _recompute_under(self, txn: _Txn, seq: Sequence, worker: Worker) -> None:
        """K/V written under other weights (or another page layout) is never read again: the history stays.

        A worker's model name is the fingerprint of everything that determines
        K/V (weights, config, dtype, tokenizer, layout). Its pages and slots go,
        as a drop's would, and the sequence continues under the new worker's
        model: prefix blocks that model cached are shared, the rest recomputed.
        """
        txn.undo.record(_set_lists, seq, list(seq.token_ids), list(seq.block_ids), list(seq.hashes))
        txn.undo.record(_set_model, seq, seq.model, seq.block_size)
        self.release_blocks(seq.block_ids)
        if seq.slots:
            txn.outcome.read_slots += seq.slots
        seq.block_ids[:], seq.hashes[:], seq.slots, seq.num_committed = [], [], [], 0
        seq.state = SeqState.DROPPED
        seq.model, seq.block_size = worker.model, worker.block_size
        txn.counters["resumed_under_other_weights"] += 1

    def _retry_turn(self, txn: _Txn, seq: Sequence, prompt: list[int]) -> list[int]:
        """A turn whose worker died replaced by the next one: keep what the two have in common.

        A client whose turn failed (its worker was killed, memd restarted)
        sends it again; so does one whose answer was lost after the turn
        ended, naming it by the same turn id. What the turn committed of the
        same prompt is kept, so prefill goes on where it stopped; the rest of
        it (tokens sampled, a different prompt) goes, so the answer is what an
        uninterrupted turn gives. Returns the part of `prompt` still to append.
        """
        same = _common_prefix(seq.token_ids[seq.turn_start:], prompt)
        self._rewind(txn, seq, seq.turn_start + same, more_follow=same < len(prompt))
        txn.counters["turns_retried"] += 1
        return prompt[same:]

    def _replace_history(self, txn: _Txn, seq: Sequence, history: list[int]) -> list[int]:
        """The whole conversation, resent by a stateless client: keep what it shares with the session's history.

        Only that common prefix keeps its K/V; a conversation edited earlier on
        (a changed message) never reads K/V of the old one. Returns the part of
        `history` still to append; that part is the new turn.
        """
        same = _common_prefix(seq.token_ids, history)
        if same < len(seq.token_ids) or same == len(history):
            self._rewind(txn, seq, same, more_follow=same < len(history))
        seq.turn_start, seq.interrupted = same, False
        txn.counters["history_tokens_kept"] += same
        return history[same:]

    def _rewind(self, txn: _Txn, seq: Sequence, cut: int, *, more_follow: bool) -> None:
        """Cut the history to its first `cut` tokens, and the committed K/V past what stays valid.

        Unless `more_follow` (tokens are appended after the cut), the last token
        kept is left to compute: its logits are the first the worker samples from.
        """
        txn.undo.record(_set_lists, seq, list(seq.token_ids), list(seq.block_ids), list(seq.hashes))
        del seq.token_ids[cut:]
        self._tokens_cut.add(seq.seq_id)
        limit = cut if more_follow else max(cut - 1, 0)
        if limit % seq.block_size and limit // seq.block_size < seq.num_full_blocks:
            # That block was full: maybe shared, and in the prefix cache. It is never written again:
            # keep only whole blocks and recompute the few tokens past them.
            limit -= limit % seq.block_size
        if seq.num_committed > limit:
            seq.num_committed = limit
            keep = blocks_for(limit, seq.block_size)
            if seq.state is SeqState.SWAPPED:
                txn.outcome.read_slots += seq.slots[keep:]          # given back once the Step is done
                seq.slots = seq.slots[:keep]
            else:
                self.release_blocks(seq.block_ids[keep:])
                del seq.block_ids[keep:]
            del seq.hashes[seq.num_full_blocks:]

    def _free(self, txn: _Txn, op: Free) -> OpResult:
        seq = self.find(op.seq_id, op.session_id)
        if seq.state is SeqState.RUNNING and seq.owner != txn.worker.worker_id:
            raise PermissionDenied(f"sequence {seq.seq_id} is running on worker {seq.owner}")
        if seq.model != txn.worker.model:
            raise FailedPrecondition(f"sequence {seq.seq_id} belongs to model {seq.model!r}; "
                                     f"this worker serves {txn.worker.model!r}")
        if op.append or op.commit_to:                  # its last progress: full blocks join the prefix cache
            self._commit(txn, self._own(txn, seq.seq_id), list(op.append), op.commit_to)
        # Not `release`: within a Step the swap-out's cancel is undoable, and the slots are
        # given back only once the Step stands (and its copies are done).
        self._cancel_swap_out(txn, seq)
        self.release_blocks(seq.block_ids)
        txn.outcome.read_slots += seq.slots
        self.forget(seq, txn.undo)
        txn.touched.pop(seq.seq_id, None)
        return OpResult(seq.seq_id, "freed", 0, [], 0, 0)

    def _fork(self, txn: _Txn, op: Fork) -> OpResult:
        parent = self._own(txn, op.seq_id)
        self._check_session_free(op.session_id)
        full = parent.num_full_blocks
        partial = parent.num_committed % parent.block_size != 0
        if partial and not self.pool.num_free:
            raise PoolExhausted(1, 0)
        child = Sequence(self._next_seq, parent.model, parent.block_size, parent.owner, SeqState.RUNNING,
                         list(parent.block_ids[:full]), parent.num_committed, list(parent.token_ids),
                         list(parent.hashes), op.session_id or None, turn_start=parent.turn_start)
        self._next_seq += 1
        for block in child.block_ids:
            self.pool.incref(block)
        if partial:
            # The only block either side will write: copy it now rather than share it.
            dst, _ = self.pool.allocate()
            txn.outcome.effects.append(Copy(parent.block_ids[full], dst))
            txn.outcome.filling.add(child.seq_id)
            child.block_ids.append(dst)
        self._create(txn, child)
        txn.counters["forks"] += 1
        return _result(child, 0, history=True)

    # ---- inspection ----------------------------------------------------

    def violations(self) -> list[str]:
        """Every broken invariant of pages, swap slots, tables and ownership, as sentences."""
        return violations(self)

    def heat(self, seq: Sequence, now: float) -> float:
        """Touches decayed by `heat_decay` per `heat_interval_s`: no timer per block."""
        return seq.heat * self.heat_decay ** (max(0.0, now - seq.heat_at) / self.heat_interval_s)

    def swapped_blocks(self) -> int:
        """Swap slots holding SWAPPED sequences' pages."""
        return sum(len(seq.slots) for seq in self.seqs.values())

    def state_counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in SeqState}
        for seq in self.seqs.values():
            counts[seq.state.value] += 1
        return counts

    # ---- mechanics -----------------------------------------------------

    def find(self, seq_id: int | None, session_id: str | None) -> Sequence:
        if session_id:
            found = self.sessions.get(session_id)
            if found is None:
                raise NotFound(f"no session {session_id!r}")
            seq_id = found
        if not seq_id:
            raise InvalidArgument("a sequence id or a session id is required")
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise NotFound(f"no sequence {seq_id}")
        return seq

    def _own(self, txn: _Txn, seq_id: int) -> Sequence:
        seq = self.find(seq_id, None)
        if seq.state is not SeqState.RUNNING:
            raise FailedPrecondition(f"sequence {seq_id} is {seq.state}; resume it first")
        if seq.owner != txn.worker.worker_id:
            raise PermissionDenied(f"sequence {seq_id} is running on worker {seq.owner}")
        self._save(txn, seq)
        return seq

    def _check_session_free(self, session_id: str | None) -> None:
        _check_name("session id", session_id or "")
        if session_id and session_id in self.sessions:
            seq = self.seqs[self.sessions[session_id]]
            raise AlreadyExists(
                f"session {session_id!r} already has sequence {seq.seq_id} ({seq.state}); resume or free it")

    def _check_fits(self, num_tokens: int, block_size: int) -> None:
        needed = blocks_for(num_tokens, block_size)
        if needed > self.pool.num_blocks:
            raise InvalidArgument(
                f"{num_tokens} tokens need {needed} blocks; the whole pool has {self.pool.num_blocks}")

    def _save(self, txn: _Txn, seq: Sequence) -> None:
        """Record a sequence's fields in the undo log before its first change in this Step."""
        txn.touched[seq.seq_id] = seq
        if seq.seq_id in txn.saved:
            return
        txn.saved.add(seq.seq_id)
        # Within a Step the lists only grow (Park journals the table it cuts), so lengths restore them.
        txn.undo.record(_restore, seq, seq.state, seq.owner, len(seq.block_ids), seq.num_committed,
                           len(seq.token_ids), len(seq.hashes), seq.slots, seq.preempted_by, seq.turn_start,
                           seq.interrupted, seq.turn_id)

    def _create(self, txn: _Txn, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        if seq.session_id:
            self.sessions[seq.session_id] = seq.seq_id
        txn.saved.add(seq.seq_id)
        txn.touched[seq.seq_id] = seq
        txn.undo.record(self.forget, seq)

    def forget(self, seq: Sequence, undo: UndoLog | None = None) -> None:
        """The sequence is gone from memd (it holds nothing now: `release` or a Free let go of its pages)."""
        self._changed.add(seq.seq_id)
        del self.seqs[seq.seq_id]
        if seq.session_id:
            del self.sessions[seq.session_id]
        if undo is not None:
            undo.record(self._remember, seq)

    def _remember(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        if seq.session_id:
            self.sessions[seq.session_id] = seq.seq_id

    def _match_prefix(self, txn: _Txn, seq: Sequence) -> int:
        """Share cached blocks for the history's leading full blocks; returns tokens reused.

        The last token is always left to compute: its logits are what the worker needs.
        """
        bs, tokens = seq.block_size, seq.token_ids
        limit = (len(tokens) - 1) // bs if tokens else 0
        parent = b""
        for i in range(limit):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            digest = self.hasher.block_hash(parent, seq.model, chunk)
            block = self.pool.lookup(digest, chunk)
            if block is None:
                break
            self.pool.incref(block)
            seq.block_ids.append(block)
            seq.hashes.append(digest)
            parent = digest
        seq.num_committed = len(seq.block_ids) * bs
        txn.counters["prefix_query_tokens"] += len(tokens)
        txn.counters["prefix_hit_tokens"] += seq.num_committed
        return seq.num_committed

    def _commit(self, txn: _Txn, seq: Sequence, append: list[int], commit_to: int) -> None:
        seq.token_ids.extend(append)
        if not commit_to:
            return
        if commit_to < seq.num_committed:
            raise InvalidArgument(f"commit_to {commit_to} is below the {seq.num_committed} tokens already committed")
        if commit_to > len(seq.token_ids):
            raise InvalidArgument(f"commit_to {commit_to} is past the {len(seq.token_ids)} known tokens")
        if commit_to > seq.capacity:
            raise InvalidArgument(f"commit_to {commit_to} is past the {seq.capacity} slots of the block table")
        seq.num_committed = commit_to
        parent = seq.hashes[-1] if seq.hashes else b""
        start = len(seq.hashes)
        for i, (digest, chunk) in enumerate(
                self.hasher.chain(seq.model, seq.token_ids, seq.block_size, start, parent, seq.num_full_blocks),
                start):
            self._offer(seq.block_ids[i], digest, chunk)
            seq.hashes.append(digest)

    def _swap_in(self, txn: _Txn, seq: Sequence) -> int:
        """Pages for a SWAPPED sequence: still-cached prefix blocks are shared, the rest copied back."""
        bs, tokens, hashes = seq.block_size, seq.token_ids, seq.hashes
        copies = 0
        for i, slot in enumerate(seq.slots):
            chunk = tuple(tokens[i * bs:(i + 1) * bs]) if i < len(hashes) else None
            block = self.pool.lookup(hashes[i], chunk) if chunk is not None else None
            if block is not None:
                self.pool.incref(block)
            else:
                if not self.pool.num_free:
                    raise PoolExhausted(len(seq.slots) - i, 0)
                block, _ = self.pool.allocate()
                txn.outcome.effects.append(SwapIn(slot, block))
                txn.outcome.filling.add(seq.seq_id)
                if chunk is not None:
                    txn.outcome.swapped_in.append(SwappedInBlock(seq, i, block))
                copies += 1
            seq.block_ids.append(block)
        txn.outcome.read_slots += seq.slots
        seq.slots = []
        txn.counters["swap_ins"] += 1
        txn.counters["swap_in_blocks"] += copies
        txn.counters["blocks_allocated"] += copies
        return seq.num_committed

    def _cancel_swap_out(self, txn: _Txn, seq: Sequence) -> None:
        """The sequence is wanted (resume) or gone (free): a swap-out in flight no longer counts."""
        job = self.swap_jobs.pop(seq.seq_id, None)
        if job is not None:
            txn.undo.record(self.swap_jobs.__setitem__, seq.seq_id, job)

    def _grow(self, txn: _Txn, seq: Sequence, num_tokens: int) -> None:
        self._check_fits(num_tokens, seq.block_size)
        needed = blocks_for(num_tokens, seq.block_size) - len(seq.block_ids)
        if needed <= 0:
            return
        if needed > self.pool.num_free:
            raise PoolExhausted(needed, self.pool.num_free)
        for _ in range(needed):
            block, dirty = self.pool.allocate()
            if dirty:
                txn.outcome.effects.append(Zero(block))
            seq.block_ids.append(block)
        txn.counters["blocks_allocated"] += needed

    def _park(self, seq: Sequence, fence: list[int] | None = None) -> None:
        """Cut the table to the committed tokens; the pages cut go free, or to `fence` (reclaim).

        With a fence, to the committed whole blocks: the partly written last page goes to the fence too.
        """
        if fence is not None:
            seq.num_committed -= seq.num_committed % seq.block_size
        keep = blocks_for(seq.num_committed, seq.block_size)
        if fence is None:
            self.release_blocks(seq.block_ids[keep:])
        else:
            fence += seq.block_ids[keep:]
        del seq.block_ids[keep:]
        seq.state, seq.owner = SeqState.PARKED, None
        self._changed.add(seq.seq_id)

    def _offer(self, block: int, digest: bytes, tokens: tuple[int, ...]) -> None:
        """A full, committed block joins the prefix cache (unless the cache is off)."""
        if self.prefix_cache:
            self.pool.register(block, digest, tokens)

    def release_blocks(self, blocks: list[int]) -> int:
        return sum(self.pool.decref(block) for block in blocks)

    def release(self, seq: Sequence) -> int:
        """Outside a Step: give back a sequence's pages and swap slots, and cancel a swap-out in flight.

        Its token ids stay; the caller says what the sequence becomes (DROPPED,
        or forgotten). Returns the blocks that became free.
        """
        self.swap_jobs.pop(seq.seq_id, None)         # a copy in flight gives its slots back when done
        freed = self.release_blocks(seq.block_ids)
        if seq.slots:
            assert self.swap is not None
            self.swap.give(seq.slots)
        seq.block_ids, seq.slots = [], []
        self._changed.add(seq.seq_id)
        return freed

    def evictable(self, seq: Sequence) -> bool:
        """PARKED, still this manager's, and not being swapped out already: eviction may take its pages."""
        return self.seqs.get(seq.seq_id) is seq and seq.state is SeqState.PARKED and seq.seq_id not in self.swap_jobs

    def mark_changed(self, seq: Sequence) -> None:
        """For the eviction policy, which changes sequences outside Steps: the journal must record it."""
        self._changed.add(seq.seq_id)

    def _touch(self, seq: Sequence, now: float) -> None:
        seq.heat = self.heat(seq, now) + 1.0
        seq.heat_at = seq.last_access = now


def _set_blocks(seq: Sequence, blocks: list[int]) -> None:
    seq.block_ids[:] = blocks


def _set_lists(seq: Sequence, token_ids: list[int], block_ids: list[int], hashes: list[bytes]) -> None:
    seq.token_ids[:], seq.block_ids[:], seq.hashes[:] = token_ids, block_ids, hashes


def _restore(seq: Sequence, state: SeqState, owner: int | None, num_blocks: int, num_committed: int,
             num_tokens: int, num_hashes: int, slots: list[int], preempted_by: int | None, turn_start: int,
             interrupted: bool, turn_id: str) -> None:
    seq.state, seq.owner, seq.num_committed, seq.slots = state, owner, num_committed, slots
    seq.preempted_by, seq.turn_start, seq.interrupted, seq.turn_id = preempted_by, turn_start, interrupted, turn_id
    del seq.block_ids[num_blocks:]
    del seq.token_ids[num_tokens:]
    del seq.hashes[num_hashes:]


def _set_model(seq: Sequence, model: str, block_size: int) -> None:
    seq.model, seq.block_size = model, block_size


def _common_prefix(a: list[int], b: list[int]) -> int:
    same, end = 0, min(len(a), len(b))
    while same < end and a[same] == b[same]:
        same += 1
    return same


def _check_name(what: str, value: str) -> None:
    if len(value) > MAX_NAME:
        raise InvalidArgument(f"{what} of {len(value)} characters; at most {MAX_NAME}")


def _result(seq: Sequence, first_block: int, cached: int = 0, *, history: bool = False) -> OpResult:
    return OpResult(seq.seq_id, seq.state.value, first_block, seq.block_ids[first_block:], len(seq.block_ids),
                    seq.num_committed, cached, list(seq.token_ids) if history else None)


def _describe(op: Op) -> str:
    name = type(op).__name__.lower()
    seq_id = getattr(op, "seq_id", None)
    return f"{name} seq {seq_id}" if seq_id else name
