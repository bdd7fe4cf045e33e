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
from dataclasses import dataclass
from operator import itemgetter

import structlog

from memd import integrity
from memd.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvError,
    NotFound,
    OpError,
    PermissionDenied,
    SessionTaken,
)
from memd.eviction import Evictor
from memd.invariants import violations
from memd.kv_state import Worker
from memd.page_effects import Fetch, PageEffect, SwapIn
from memd.pool import BlockPool, SwapSlots, UndoLog, picked
from memd.quotas import Holding, Key, QuotaExceeded, Quotas, keys_of
from memd.seq_index import SeqIndex
from memd.sequences import (
    TOKEN_BYTES,
    PrefixHasher,
    RemoteLookups,
    SeqState,
    Sequence,
    SwapOut,
    blocks_for,
    check_name,
    token_bytes,
)
from memd.step_ops import StepTxn
from memd.step_outcome import StepOutcome, SwappedIn
from shared.geometry import PoolGeometry
from shared.ops import Op

log = structlog.get_logger("memd")


@dataclass(frozen=True, slots=True)
class Changes:
    """What changed since the journal last took the changes (`KvManager.take_changes`)."""

    seq_ids: set[int]           # sequences changed or gone
    tokens_cut: set[int]         # of those, sequences whose token ids were cut back (a retried turn)
    sums_from: dict[int, int]    # of those, the first table entry whose page checksum was set, per sequence
    fence_pids: set[int]        # processes whose fenced pages changed


class KvManager:
    """Workers, sequences and pages; changed by Steps (`step`) and by the few calls outside them below.

    A Step's operations run in a `StepTxn` (memd.step_ops), built per Step,
    which changes this state only through its methods (those of `KvState`,
    memd.kv_state, the API the transaction, eviction, integrity and the checks
    are written against). Others read `seqs`, `sessions`, `workers`, `fences`, `pool` and `swap`
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
                 idle_ttl_s: float = 0.0, watermark_blocks: int = 0, prefix_cache: bool = True,
                 quotas: Quotas | None = None) -> None:
        self.geometry = geometry
        # Off (memd --no-prefix-cache): no block is ever offered to or found in the prefix cache;
        # a session's own parked sequence is still resumed. For measuring what the cache is worth.
        self.prefix_cache = prefix_cache
        self.pool = BlockPool(geometry.num_blocks)
        self.swap = SwapSlots(swap_slots) if swap_slots else None
        self.swap_jobs: dict[int, SwapOut] = {}        # by sequence id: swap-outs being copied
        # Swap-outs called off while copying: their slots come back when the copy stops (within a chunk).
        self.stopping: set[SwapOut] = set()
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
        # Sequences changed, one set per reader that copies them a slice at a time between Steps
        # (memd.state_copy): it copies them again at the end.
        self.watches: list[set[int]] = []
        self._tokens_cut: set[int] = set()
        self._sums_from: dict[int, int] = {}
        self._fences_changed: set[int] = set()
        # Pages a worker that may still be running could write late (its turns' unwritten tails), kept
        # from reuse by the pid of that worker until it exits or attaches again (memd.fences watches).
        self.fences: dict[int, list[int]] = {}
        self.quotas = quotas or Quotas()
        # Counts, holders' pages and the eviction and idle orders, kept as sequences change (memd.seq_index).
        self.index = SeqIndex(self)
        self.evictions = Evictor(self, idle_ttl_s=idle_ttl_s, watermark_blocks=watermark_blocks)

    # ---- workers -------------------------------------------------------

    def attach(self, name: str, pid: int, model: str, block_size: int, bytes_per_token: int) -> Worker:
        for what, value in (("worker name", name), ("model", model)):
            check_name(what, value)
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
                self.park(seq, held)
            seq.preempted_by = None
            seq.interrupted = True               # its turn failed: the retry of it replaces it (_retry_turn)
            self._note(seq.seq_id)
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

    def step(self, worker_id: int, ops: Iterable[Op], lease: bytes | None = None,
             remote: RemoteLookups | None = None) -> StepOutcome:
        """`remote`: sessions and prefixes other hosts published, looked up for this Step (memd.cluster_lookup)."""
        worker = self.worker(worker_id, lease)
        worker.last_seen = time.monotonic()
        txn = StepTxn(self, worker, UndoLog(), remote or RemoteLookups())
        freed_before = self.pool.freed
        out = txn.outcome
        self.pool.undo = txn.undo
        ran: list[Op] = []
        self.index.mark()
        rolled_back = True
        try:
            for index, op in enumerate(ops):
                txn.op_index = index
                ran.append(op)
                try:
                    out.results.append(txn.run(op))
                except KvError as exc:
                    raise OpError(index, _describe(op), exc) from None
            if self.quotas.capped:
                self.index.refresh(txn.touched)
                try:
                    self.quotas.check_growth(self.index.ledger.usage, _grown(txn.touched, txn.pages_before))
                except QuotaExceeded as exc:
                    raise OpError(exc.index, _describe(ran[exc.index]), exc) from None
            rolled_back = False
        except BaseException:
            txn.undo.rollback()
            raise
        finally:
            self.pool.undo = None
            self.index.settled(rolled_back)
        now = time.monotonic()
        for seq in txn.touched.values():
            self._touch(seq, now)
        self._note_all(txn.touched)
        self._filling.update(out.filling)
        self.counters.update(txn.counters)
        self.counters["steps"] += 1
        self.counters["ops"] += len(out.results)
        # A sequence this Step preempted and then freed (or resumed) is no longer there to evict.
        out.evictions = [e for e in out.evictions if self.evictable(e.seq)]
        if out.read_slots:
            assert self.swap is not None
            self.swap.in_copy.update(out.read_slots)     # the sequence let go; the copy still reads them
        for job in out.called_off:
            self.call_off(job)
        # A page this Step took and gave back needs no effect: it is free again, and
        # zeroed when next handed out. Late effects on a free page could hit its next tenant.
        if self.pool.freed != freed_before:
            out.effects = [kept for e in out.effects if (kept := self._on_held_pages(e)) is not None]
        return out

    def _on_held_pages(self, effect: PageEffect) -> PageEffect | None:
        """`effect` on the pages still held after its Step (None: on none of them)."""
        ref = self.pool.ref
        if not isinstance(effect, SwapIn):
            return effect if ref[effect.page] > 0 else None
        if all(picked(ref, effect.pages)):
            return effect
        kept = [i for i, page in enumerate(effect.pages) if ref[page] > 0]
        return SwapIn(list(picked(effect.slots, kept)), list(picked(effect.pages, kept)),
                      list(picked(effect.checksums, kept))) if kept else None

    def effects_landed(self, outcome: StepOutcome, corrupt: list[int] | None = None) -> None:
        """A Step's page effects are done: its swapped-in blocks may serve prefix hits, its pages be journaled.

        `corrupt`: pages a swap-in brought back with other bytes than its swap-out
        wrote. Their sequence keeps its tokens, and its K/V up to the page before:
        the worker recomputes the rest (the results it is about to get say so).
        A swapped-in block joins the prefix cache only if sound, and only while
        its sequence still holds it: a drop in between may have handed the page on.
        """
        bad = set(corrupt or ())
        sums: dict[int, int] = {}
        fetched = set()
        for e in outcome.effects:
            if isinstance(e, SwapIn):
                sums.update(zip(e.pages, e.checksums, strict=True))
            elif isinstance(e, Fetch):
                sums[e.page] = e.checksum
                fetched.add(e.page)
        self.counters["pages_verified"] += len(sums) - list(sums.values()).count(0)
        self.counters["cluster_hits"] += len(fetched - bad)
        self.counters["cluster_bytes_in"] += len(fetched - bad) * self.geometry.block_bytes
        rotten = sorted(((index, block, run.seq) for run in outcome.swapped_in if bad
                         for index, block in zip(run.indices, run.blocks, strict=True) if block in bad),
                        key=itemgetter(0))
        for index, block, seq in rotten:
            from_store = block in fetched     # gone from the store, or not what its worker committed
            if from_store:
                self.counters["cluster_misses"] += 1
            else:
                integrity.count(self.counters, integrity.Where.SWAP_IN)
            if index * seq.block_size < seq.num_committed:
                self._distrust(outcome, seq, index, from_store=from_store)
        for run in outcome.swapped_in:
            self._offer_swapped_in(run, sums)
        self._filling -= outcome.filling
        self._note_all(outcome.filling)

    def _offer_swapped_in(self, run: SwappedIn, sums: dict[int, int]) -> None:
        """Pages that landed sound, still their sequence's: full blocks join the prefix cache, with their
        checksums (what they hold from now on)."""
        seq = run.seq
        if self.seqs.get(seq.seq_id) is not seq:
            return
        table, limit = seq.block_ids, min(len(seq.block_ids), len(seq.hashes))
        kept = [(index, block) for index, block in zip(run.indices, run.blocks, strict=True)
                if index < limit and table[index] == block]
        if not kept:
            return
        indices, blocks = [index for index, _ in kept], [block for _, block in kept]
        if self.prefix_cache:
            history, stride = token_bytes(seq.token_ids[:limit * seq.block_size]), seq.block_size * TOKEN_BYTES
            self.offer(seq, indices, blocks, [history[index * stride:(index + 1) * stride] for index in indices])
        self.pool.set_checksums(blocks, [sums.get(block, 0) for block in blocks])
        self.note_sum_set(seq, min(indices))

    def _distrust(self, outcome: StepOutcome, seq: Sequence, index: int, *, from_store: bool) -> None:
        """Block `index` of a running sequence failed its check: its K/V from there on is recomputed.

        The table is cut there too: pages past it may be prefix-cache hits the
        swap-in shared (other sequences read them, they carry checksums), and
        the worker is about to write those positions. It asks for fresh pages
        for them, as for any growth (the results it is about to get say so).

        `from_store`: the page was fetched from the cluster store, where a page
        goes missing whenever the store restarts or evicts: a warning, not the
        error of host memory that changed under a swapped-out page.
        """
        where = dict(seq=seq.seq_id, session=seq.session_id, block=seq.block_ids[index], index=index)
        if from_store:
            log.warning("a page fetched from the cluster store is gone or not what was published: its K/V is "
                        "recomputed", **where)
        else:
            log.error("a swapped-in page is not what was swapped out: its K/V is recomputed", **where)
        seq.num_committed = index * seq.block_size
        del seq.hashes[index:]
        self.release_blocks(seq.block_ids[index:])
        del seq.block_ids[index:]
        self._note(seq.seq_id)
        for result in outcome.results:
            if result.seq_id == seq.seq_id:
                result.num_committed = min(result.num_committed, seq.num_committed)
                result.num_cached = min(result.num_cached, seq.num_committed)
                del result.block_ids[max(0, index - result.first_block):]
                result.num_blocks = len(seq.block_ids)

    def filling(self, seq_id: int) -> bool:
        """Whether a Step's effects are still filling this sequence's pages."""
        return seq_id in self._filling

    @property
    def max_seq_id(self) -> int:
        """The highest sequence id handed out (0: none). Ids only grow: the journal keeps this across restarts,
        so a worker or operator holding an old sequence's id can never reach a new one by it."""
        return self._next_seq - 1

    def take_changes(self) -> Changes:
        """What changed since the last call, for the journal: the one consumer, which must write all of it."""
        changes = Changes(self._changed, self._tokens_cut, self._sums_from, self._fences_changed)
        self._changed, self._tokens_cut, self._sums_from, self._fences_changed = set(), set(), {}, set()
        return changes

    def adopt(self, seqs: list[Sequence], next_seq: int, fences: dict[int, list[int]] | None = None,
              slot_checksums: dict[int, int] | None = None, block_checksums: dict[int, int] | None = None) -> None:
        """Take over sequences recovered from an earlier memd's journal (memd.recovery.restore checked them).

        Every page's content is unknown now, so all are zeroed before reuse;
        the prefix index is rebuilt from the adopted sequences' token ids.
        """
        self.pool.dirty[:] = b"\x01" * self.pool.num_blocks
        now = time.monotonic()
        if self.swap is not None:               # at once: a claim passes over the whole free stack
            self.swap.claim([slot for seq in seqs for slot in seq.slots])
        for seq in seqs:
            seq.heat_at, seq.last_access = min(seq.heat_at, now), min(seq.last_access, now)   # another boot's clock
            self.seqs[seq.seq_id] = seq
            if seq.session_id:
                self.sessions[seq.session_id] = seq.seq_id
            for block in seq.block_ids:
                self.pool.incref(block)
                self.pool.checksum[block] = (block_checksums or {}).get(block, 0)
            if self.swap is not None and seq.slots:
                for slot in seq.slots:
                    self.swap.checksum[slot] = (slot_checksums or {}).get(slot, 0)
            chain = self.hasher.chain(seq.prefix_space, seq.token_ids, seq.block_size, 0, b"", seq.num_full_blocks)
            seq.hashes = [digest for digest, _ in chain]
            if seq.state is SeqState.PARKED:
                held = min(len(seq.block_ids), len(chain))
                self.offer(seq, range(held), seq.block_ids[:held], [chunk for _, chunk in chain[:held]])
        for pid, blocks in (fences or {}).items():
            for block in blocks:
                self.pool.incref(block)
            self.fences[pid] = list(blocks)
        self._next_seq = max(self._next_seq, next_seq)
        self.take_changes()            # all of it is in the journal it came from
        self.index.refresh(self.seqs)

    def release_slots(self, slots: list[int]) -> None:
        """The effects of a Step are done: the swap slots it read are free."""
        if slots:
            assert self.swap is not None
            self.swap.give(slots)

    # ---- inspection ----------------------------------------------------

    def violations(self) -> list[str]:
        """Every broken invariant of pages, swap slots, tables and ownership, as sentences."""
        return violations(self)

    def heat(self, seq: Sequence, now: float) -> float:
        """Touches decayed by `heat_decay` per `heat_interval_s`: no timer per block."""
        return seq.heat * self.heat_decay ** (max(0.0, now - seq.heat_at) / self.heat_interval_s)

    def swapped_blocks(self) -> int:
        """Swap slots holding SWAPPED sequences' pages."""
        self.index.refresh()
        return self.index.swapped_slots

    def state_counts(self) -> dict[str, int]:
        self.index.refresh()
        return self.index.state_counts()

    def holdings(self, *, no_tenant: bool = False) -> list[Holding]:
        """Every tenant's and model's quota, pages, sequences and promises (memctl quota and tenants, the
        metrics); with `no_tenant`, the row of the sequences of no tenant too (memctl tenants)."""
        self.index.refresh()
        return self.quotas.holdings(self.index, no_tenant=no_tenant)

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

    def check_session_free(self, session_id: str | None) -> None:
        check_name("session id", session_id or "")
        if session_id and session_id in self.sessions:
            seq = self.seqs[self.sessions[session_id]]
            kind = SessionTaken if seq.state is SeqState.RUNNING else AlreadyExists   # running: a turn in flight
            raise kind(f"session {session_id!r} already has sequence {seq.seq_id} ({seq.state}); resume or free it")

    def check_fits(self, num_tokens: int, block_size: int) -> None:
        needed = blocks_for(num_tokens, block_size)
        if needed > self.pool.num_blocks:
            raise InvalidArgument(
                f"{num_tokens} tokens need {needed} blocks; the whole pool has {self.pool.num_blocks}")

    def add(self, seq: Sequence) -> None:
        """A new sequence (a Step's Open or Fork records its undo: `forget`)."""
        self.seqs[seq.seq_id] = seq
        if seq.session_id:
            self.sessions[seq.session_id] = seq.seq_id

    def new_seq_id(self) -> int:
        seq_id = self._next_seq
        self._next_seq += 1
        return seq_id

    def forget(self, seq: Sequence, undo: UndoLog | None = None) -> None:
        """The sequence is gone from memd (it holds nothing now: `release` or a Free let go of its pages)."""
        self._note(seq.seq_id)
        del self.seqs[seq.seq_id]
        if seq.session_id:
            del self.sessions[seq.session_id]
        if undo is not None:
            undo.record(self._remember, seq)

    def _remember(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        if seq.session_id:
            self.sessions[seq.session_id] = seq.seq_id

    def park(self, seq: Sequence, fence: list[int] | None = None) -> None:
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
        self._note(seq.seq_id)

    def offer(self, seq: Sequence, indices: Iterable[int], blocks: list[int], tokens: Iterable[bytes]) -> None:
        """Full, committed blocks of `seq` (entries `indices` of its table, their hashes in `seq.hashes`) join
        the prefix cache (unless the cache is off)."""
        if self.prefix_cache:
            hashes = seq.hashes
            indices = list(indices)
            self.pool.register_n(blocks, [hashes[i] for i in indices], tokens,
                                 [hashes[i - 1] if i else b"" for i in indices], seq.model, seq.salt)

    def forget_cached(self, model: str) -> int:
        """`model`'s blocks leave the prefix cache (no new prompt finds them); returns how many. The pages
        stay: a free one is handed out in turn, a sequence's (a parked session's, a running turn's) stays its
        own K/V, which it resumes from its table."""
        pool = self.pool
        gone = [block for block in pool.by_hash.values() if (pool.origin_of[block] or (b"", "", ""))[1] == model]
        for block in gone:
            pool.unregister(block)
        self.counters["prefix_blocks_reset"] += len(gone)
        return len(gone)

    def release_blocks(self, blocks: list[int]) -> int:
        return self.pool.release_n(blocks)

    def release(self, seq: Sequence) -> int:
        """Outside a Step: give back a sequence's pages and swap slots, and cancel a swap-out in flight.

        Its token ids stay; the caller says what the sequence becomes (DROPPED,
        or forgotten). Returns the blocks that became free.
        """
        if (job := self.swap_jobs.get(seq.seq_id)) is not None:
            self.call_off(job)
        freed = self.release_blocks(seq.block_ids)
        if seq.slots:
            assert self.swap is not None
            self.swap.give(seq.slots)
        seq.block_ids, seq.slots = [], []
        self._note(seq.seq_id)
        return freed

    def call_off(self, job: SwapOut) -> None:
        """A swap-out no longer counts (its sequence was resumed, freed or dropped): its copy is told to stop.

        Its slots are free at once if the copy had not started; else they come
        back when it stops (`give_back`), and until then the job is `stopping`.
        """
        if self.swap_jobs.get(job.seq.seq_id) is job:
            del self.swap_jobs[job.seq.seq_id]
        if job.ticket.call_off():
            self.give_back(job)
        elif not job.slots_back:
            self.stopping.add(job)

    def give_back(self, job: SwapOut) -> None:
        """A swap-out's copy is over without its sequence taking the slots (called off, or failed): free them."""
        self.stopping.discard(job)
        if not job.slots_back:
            job.slots_back = True
            assert self.swap is not None
            self.swap.give(job.slots)

    def evictable(self, seq: Sequence) -> bool:
        """PARKED, still this manager's, and not being swapped out already: eviction may take its pages."""
        return self.seqs.get(seq.seq_id) is seq and seq.state is SeqState.PARKED and seq.seq_id not in self.swap_jobs

    def mark_changed(self, seq: Sequence) -> None:
        """For the eviction policy, which changes sequences outside Steps: the journal must record it."""
        self._note(seq.seq_id)

    def _note(self, seq_id: int) -> None:
        self._changed.add(seq_id)
        for watch in self.watches:
            watch.add(seq_id)

    def _note_all(self, seq_ids: Iterable[int]) -> None:
        self._changed.update(seq_ids)
        for watch in self.watches:
            watch.update(seq_ids)

    def note_tokens_cut(self, seq_id: int) -> None:
        """A Step cut a sequence's token ids back (a retried turn, a resent conversation): the journal writes
        them whole, not as an append."""
        self._tokens_cut.add(seq_id)

    def note_sum_set(self, seq: Sequence, index: int) -> None:
        """The checksum of entry `index` of `seq`'s table was set: the journal writes the table from there."""
        first = self._sums_from.get(seq.seq_id)
        if first is None or index < first:
            self._sums_from[seq.seq_id] = index

    def _touch(self, seq: Sequence, now: float) -> None:
        seq.heat = self.heat(seq, now) + 1.0
        seq.heat_at = seq.last_access = now


def _grown(touched: dict[int, Sequence], pages_before: dict[int, tuple[int, int]]) -> dict[Key, int]:
    """Holders whose sequences took pages in a Step, each with the first op that touched one of those."""
    grown: dict[Key, int] = {}
    for seq_id, seq in touched.items():
        before, index = pages_before.get(seq_id, (len(seq.block_ids), 0))
        if len(seq.block_ids) > before:
            for key in keys_of(seq):
                grown[key] = min(grown.get(key, index), index)
    return grown


def _describe(op: Op) -> str:
    name = type(op).__name__.lower()
    seq_id = getattr(op, "seq_id", None)
    return f"{name} seq {seq_id}" if seq_id else name
