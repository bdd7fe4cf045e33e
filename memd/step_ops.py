"""One Step in progress: what each operation of it does to sequences and pages, and its undo log.

A `StepTxn` is built per Step (memd.manager.KvManager.step) over the state
it changes (`KvManager`, through its methods) and the worker that sent the
Step. Each operation records what it changes in the Step's undo log
(directly, or through the pool, which records its own changes), and adds the
page effects, slots to free and evictions the Step leaves to do to its
outcome; a refused operation rolls the whole Step back. memd.step_runner
carries the outcome out.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter
from typing import TYPE_CHECKING

import structlog

from memd import integrity, retention
from memd.errors import FailedPrecondition, InvalidArgument, PoolExhausted, RunningElsewhere, SessionBusy
from memd.integrity import Where
from memd.page_effects import Copy, Fetch, SwapIn, Zero
from memd.pool import UndoLog, picked
from memd.quotas import Key, QuotaExceeded, keys_of
from memd.sequences import (
    EvictionReason,
    RemoteLookups,
    RemotePrefix,
    RemoteSession,
    SeqState,
    Sequence,
    blocks_for,
    check_name,
    check_salt,
    shareable_blocks,
    token_bytes,
)
from memd.step_outcome import Eviction, StepOutcome, SwappedIn
from shared.ops import Extend, Fork, Free, Op, Open, OpResult, Park, Resume

if TYPE_CHECKING:
    from memd.kv_state import KvState, Worker

log = structlog.get_logger("memd")


class StepTxn:
    """One Step: the worker that sent it, its undo log, the sequences it saved and touched, and its outcome."""

    def __init__(self, state: KvState, worker: Worker, undo: UndoLog, remote: RemoteLookups) -> None:
        self.state, self.worker, self.undo = state, worker, undo
        self.remote = remote                         # what the cluster store said before the Step
        self.saved: set[int] = set()
        self.touched: dict[int, Sequence] = {}
        self.counters: Counter[str] = Counter()
        self.outcome = StepOutcome()
        self.op_index = 0                            # the op running now (set by the manager)
        # Per sequence saved or created: its pages when the Step first touched it, and the op that did.
        self.pages_before: dict[int, tuple[int, int]] = {}
        self.held: dict[Key, int] = {}                 # pages of capped holders, as this Step goes (`_charge`)

    def run(self, op: Op) -> OpResult:
        match op:
            case Open():
                return self._open(op)
            case Extend():
                return self._extend(op)
            case Park():
                return self._park_op(op)
            case Resume():
                return self._resume(op)
            case Free():
                return self._free(op)
            case Fork():
                return self._fork(op)
        raise InvalidArgument(f"unknown operation {op!r}")

    def _own(self, seq_id: int) -> Sequence:
        """The worker's RUNNING sequence, saved for the undo log."""
        seq = self.state.find(seq_id, None)
        if seq.state is not SeqState.RUNNING:
            raise FailedPrecondition(f"sequence {seq_id} is {seq.state}; resume it first")
        if seq.owner != self.worker.worker_id:
            raise RunningElsewhere(f"sequence {seq_id} is running on worker {seq.owner}")
        self._save(seq)
        return seq

    def _save(self, seq: Sequence) -> None:
        """Record a sequence's fields in the undo log before its first change in this Step."""
        self.touched[seq.seq_id] = seq
        if seq.seq_id in self.saved:
            return
        self.saved.add(seq.seq_id)
        self.pages_before[seq.seq_id] = (len(seq.block_ids), self.op_index)
        # Within a Step the lists only grow (Park journals the table it cuts), so lengths restore them.
        self.undo.record(_restore, seq, seq.state, seq.owner, len(seq.block_ids), seq.num_committed,
                         len(seq.token_ids), len(seq.hashes), seq.slots, seq.preempted_by, seq.turn_start,
                         seq.interrupted, seq.turn_id)

    def _create(self, seq: Sequence) -> None:
        self.state.add(seq)
        self.saved.add(seq.seq_id)
        self.pages_before[seq.seq_id] = (0, self.op_index)
        self.touched[seq.seq_id] = seq
        self.undo.record(self.state.forget, seq)

    def _open(self, op: Open) -> OpResult:
        result = self._open_or_continue(op)
        if op.retain_s:
            seq = self.state.seqs[result.seq_id]
            until = self._promise(seq, op.retain_s)
            self.undo.record(_set_retention, seq, seq.retain_until)
            seq.retain_until = until
        return result

    def _promise(self, seq: Sequence, retain_s: float) -> float:
        """Until when `seq` may be kept `retain_s` more (retention.promise), its holder's other promises counted
        as they stand in this Step; refused as retention.promise refuses."""
        index = self.state.index
        index.refresh(self.touched)
        return retention.promise(seq, retain_s, index.retained_pages(retention.holder(seq), without=seq),
                                 self.state.quotas)

    def _open_or_continue(self, op: Open) -> OpResult:
        worker = self.worker
        check_name("turn id", op.turn_id or "")
        check_salt(op.cache_salt or "")
        check_name("tenant", op.tenant or "")
        if op.whole_history and not (op.continue_session and op.session_id and op.token_ids):
            raise InvalidArgument("whole_history names a session's whole conversation: give session_id, "
                                  "continue_session and its token ids")
        if op.continue_session and op.session_id and op.session_id not in self.state.sessions \
                and (remote := self.remote.sessions.get(op.session_id)) is not None \
                and (remote.model, remote.block_size) == (worker.model, worker.block_size):
            self._fetch_session(op.session_id, remote)     # with the salt it was published under
        if op.continue_session and op.session_id in self.state.sessions:
            held = self.state.seqs[self.state.sessions[op.session_id]]
            if held.preempted_by is not None:         # a turn in flight, waiting for pages: not a new turn's
                raise SessionBusy(f"session {op.session_id!r} has a turn in flight (sequence "
                                         f"{held.seq_id} is running, preempted by worker {held.preempted_by})")
            return self._resume(Resume(session_id=op.session_id, reserve=op.reserve), op.token_ids,
                                op.turn_id or "", whole_history=op.whole_history)
        self.state.check_session_free(op.session_id)
        self.state.check_fits(len(op.token_ids) + op.reserve, worker.block_size)
        seq = Sequence(self.state.new_seq_id(), worker.model, worker.block_size, worker.worker_id, SeqState.RUNNING,
                       [], 0, array("I", op.token_ids), session_id=op.session_id or None, turn_id=op.turn_id or "",
                       salt=op.cache_salt or "", tenant=op.tenant or "")
        self._create(seq)
        cached = self._match_prefix(seq)
        if (prefix := self.remote.prefixes.get(id(op))) is not None:
            cached = self._fetch_prefix(seq, prefix)
        self._grow(seq, len(seq.token_ids) + op.reserve)
        result = _result(seq, 0, cached, history=op.continue_session)
        if cached:
            checksum = self.state.pool.checksum
            result.cached_sums = [checksum[block] for block in seq.block_ids[:cached // seq.block_size]]
        return result

    def _fetch_session(self, session: str, remote: RemoteSession) -> None:
        """A session another host published: PARKED here, its blocks fetched into fresh pages once the Step stands.

        The pages are checked against their workers' checksums when they land
        (`effects_landed`); one that did not arrive intact cuts the session
        there, and the worker computes the rest.
        """
        check_name("session id", session)
        self.state.check_fits(len(remote.token_ids), remote.block_size)
        if len(remote.keys) > self.state.pool.num_free:        # before the sequence takes an id
            raise PoolExhausted(len(remote.keys), self.state.pool.num_free)
        seq = Sequence(self.state.new_seq_id(), remote.model, remote.block_size, None, SeqState.PARKED, [], 0,
                       array("I", remote.token_ids), session_id=session, salt=remote.salt, tenant=remote.tenant)
        self._create(seq)
        self._fetch_blocks(seq, remote.keys, remote.checksums)
        self.counters["cluster_sessions_fetched"] += 1
        if remote.retain_until > time.time():
            self._keep_promise(seq, remote.retain_until)

    def _keep_promise(self, seq: Sequence, until: float) -> None:
        """A fetched session's retention promise goes on here while its holder's guarantee here pays for it; one
        it does not pay for is not kept (the session is, and the turn goes on: no error for what another host
        promised)."""
        try:
            self._promise(seq, until - time.time())
            seq.retain_until = until                  # as promised there: to the same instant
        except (retention.NoGuarantee, retention.RetentionRefused):
            self.counters["cluster_retention_not_kept"] += 1

    def _fetch_prefix(self, seq: Sequence, remote: RemotePrefix) -> int:
        """Past the local prefix hits, the blocks other hosts published: fetched into fresh pages once the
        Step stands, checked against their checksums (as `_fetch_session`'s). Returns tokens reused."""
        have = len(seq.block_ids)
        if have < remote.start:
            return seq.num_committed        # the local cache lost blocks since the lookup: compute the rest
        skip = have - remote.start
        if fetched := self._fetch_blocks(seq, remote.keys[skip:], remote.checksums[skip:]):
            self.counters["cluster_prefix_blocks"] += fetched
        return seq.num_committed

    def _fetch_blocks(self, seq: Sequence, keys: list[str], checksums: list[int]) -> int:
        """Fresh pages for the next full blocks of `seq`, filled from the cluster store once the Step stands;
        they count as committed (a page that does not land intact cuts the sequence there). Returns how many."""
        first, bs = len(seq.block_ids), seq.block_size
        self._charge(seq, len(keys))
        blocks, _ = self.state.pool.allocate_n(len(keys))
        seq.block_ids += blocks
        self.outcome.effects += map(Fetch, keys, blocks, checksums)
        self.outcome.swapped_in.append(SwappedIn(seq, list(range(first, first + len(blocks))), blocks))
        parent = seq.hashes[-1] if seq.hashes else b""
        chain = self.state.hasher.chain(seq.prefix_space, seq.token_ids, bs, first, parent, len(seq.block_ids))
        seq.hashes += [digest for digest, _ in chain]
        seq.num_committed = len(seq.block_ids) * bs
        if keys:
            self.outcome.filling.add(seq.seq_id)
            self.counters["blocks_allocated"] += len(keys)
        return len(keys)

    def _extend(self, op: Extend) -> OpResult:
        seq = self._own(op.seq_id)
        self._commit(seq, op.append, op.commit_to)
        self._keep_sums(seq, op.sums_from, op.page_sums)
        first = len(seq.block_ids)
        self._grow(seq, len(seq.token_ids) + op.reserve)
        return _result(seq, first)

    def _park_op(self, op: Park) -> OpResult:
        seq = self._own(op.seq_id)
        self._commit(seq, op.append, op.commit_to)
        self._keep_sums(seq, op.sums_from, op.page_sums, partial=True)
        cut = seq.block_ids[blocks_for(seq.num_committed, seq.block_size):]
        if cut:
            # The whole table, not the cut: a later op of this Step (a Resume) may grow it again.
            self.undo.record(_set_blocks, seq, list(seq.block_ids))
        self.state.park(seq)
        mode = self.state.revoked.get(seq.seq_id)
        seq.preempted_by = self.worker.worker_id if op.preempt else None
        if op.preempt:
            self.counters["preemptions"] += 1
            self.outcome.evictions.append(Eviction(seq, mode or "swap", EvictionReason.FORCED if mode else None))
        elif mode is not None:
            self.outcome.evictions.append(Eviction(seq, mode, EvictionReason.FORCED))
        return _result(seq, len(seq.block_ids))

    def _resume(self, op: Resume, append: list[int] | tuple[()] = (), turn_id: str = "", *,
                whole_history: bool = False) -> OpResult:
        worker = self.worker
        seq = self.state.find(op.seq_id, op.session_id)
        if seq.state is SeqState.RUNNING:
            if seq.owner == worker.worker_id:
                raise SessionBusy(f"sequence {seq.seq_id} is already running on this worker")
            raise RunningElsewhere(f"sequence {seq.seq_id} is running on worker {seq.owner}")
        known = 0 if whole_history else len(seq.token_ids)
        self.state.check_fits(known + len(append) + op.reserve, worker.block_size)
        self._save(seq)
        self._cancel_swap_out(seq)
        if (seq.model, seq.block_size) != (worker.model, worker.block_size):
            self._recompute_under(seq, worker)
        if whole_history:
            append = self._replace_history(seq, list(append))
            seq.turn_id = turn_id
        elif seq.preempted_by is None and append:        # a new turn, not a preempted request coming back
            # The same turn again: its worker died mid-turn, or after the turn ended but before the client
            # heard the answer (then only the client can tell a retry from a new message: by its turn id).
            if seq.interrupted or (turn_id and turn_id == seq.turn_id):
                append = self._retry_turn(seq, append)
            else:
                seq.turn_start = len(seq.token_ids)
            seq.turn_id = turn_id
        seq.interrupted = False
        seq.preempted_by = None
        seq.token_ids.extend(append)
        # The session's own K/V that comes back with it (parked, or swapped out): beside the prefix cache's
        # hits (`prefix_hit_tokens`), the other half of what a turn finds computed.
        self.counters["session_hit_tokens"] += seq.num_committed if seq.state is not SeqState.DROPPED else 0
        if seq.state is SeqState.DROPPED:
            cached = self._match_prefix(seq)
        elif seq.state is SeqState.SWAPPED:
            cached = self._swap_in(seq)
        elif whole_history:
            cached = self._match_further(seq)
        else:
            cached = seq.num_committed
        for block in seq.block_ids[seq.num_full_blocks:]:
            self.state.pool.set_checksum(block, 0)      # a partly filled last page: written again from now on
        seq.state, seq.owner = SeqState.RUNNING, worker.worker_id
        self._grow(seq, len(seq.token_ids) + op.reserve)
        self.counters["resumes"] += 1
        return _result(seq, 0, cached, history=True)

    def _recompute_under(self, seq: Sequence, worker: Worker) -> None:
        """K/V written under other weights (or another page layout) is never read again: the history stays.

        A worker's model name is the fingerprint of everything that determines
        K/V (weights, config, dtype, tokenizer, layout). Its pages and slots go,
        as a drop's would, and the sequence continues under the new worker's
        model: prefix blocks that model cached are shared, the rest recomputed.
        """
        self.undo.record(_set_lists, seq, list(seq.token_ids), list(seq.block_ids), list(seq.hashes))
        self.undo.record(_set_model, seq, seq.model, seq.block_size)
        self.state.release_blocks(seq.block_ids)
        if seq.slots:
            self.outcome.read_slots += seq.slots
        seq.block_ids[:], seq.hashes[:], seq.slots, seq.num_committed = [], [], [], 0
        seq.state = SeqState.DROPPED
        seq.model, seq.block_size = worker.model, worker.block_size
        self.counters["resumed_under_other_weights"] += 1

    def _retry_turn(self, seq: Sequence, prompt: list[int]) -> list[int]:
        """A turn whose worker died replaced by the next one: keep what the two have in common.

        A client whose turn failed (its worker was killed, memd restarted)
        sends it again; so does one whose answer was lost after the turn
        ended, naming it by the same turn id. What the turn committed of the
        same prompt is kept, so prefill goes on where it stopped; the rest of
        it (tokens sampled, a different prompt) goes, so the answer is what an
        uninterrupted turn gives. Returns the part of `prompt` still to append.
        """
        same = _common_prefix(seq.token_ids[seq.turn_start:], prompt)
        self._rewind(seq, seq.turn_start + same, more_follow=same < len(prompt))
        self.counters["turns_retried"] += 1
        return prompt[same:]

    def _replace_history(self, seq: Sequence, history: list[int]) -> list[int]:
        """The whole conversation, resent by a stateless client: keep what it shares with the session's history.

        Only that common prefix keeps its K/V; a conversation edited earlier on
        (a changed message) never reads K/V of the old one. Returns the part of
        `history` still to append; that part is the new turn.
        """
        same = _common_prefix(seq.token_ids, history)
        if same < len(seq.token_ids) or same == len(history):
            self._rewind(seq, same, more_follow=same < len(history), then=history)
        seq.turn_start, seq.interrupted = same, False
        self.counters["history_tokens_kept"] += same
        return history[same:]

    def _rewind(self, seq: Sequence, cut: int, *, more_follow: bool, then: list[int] | None = None) -> None:
        """Cut the history to its first `cut` tokens, and the committed K/V past what stays valid.

        Unless `more_follow` (tokens are appended after the cut), the last token
        kept is left to compute: its logits are the first the worker samples from.
        `then`: the whole history that follows, when the prefix cache is matched past the cut.
        """
        self.undo.record(_set_lists, seq, list(seq.token_ids), list(seq.block_ids), list(seq.hashes))
        del seq.token_ids[cut:]
        self.state.note_tokens_cut(seq.seq_id)
        limit = cut if more_follow else max(cut - 1, 0)
        index = limit // seq.block_size
        if limit % seq.block_size and index < seq.num_full_blocks and \
                (self._cached_block(seq, index, then) or not self._copy_on_write(seq, index)):
            limit -= limit % seq.block_size      # recompute the tokens past whole blocks, or take the cache's
        if seq.num_committed > limit:
            seq.num_committed = limit
            keep = blocks_for(limit, seq.block_size)
            if seq.state is SeqState.SWAPPED:
                self.outcome.read_slots += seq.slots[keep:]          # given back once the Step is done
                seq.slots = seq.slots[:keep]
            else:
                self.state.release_blocks(seq.block_ids[keep:])
                del seq.block_ids[keep:]
            del seq.hashes[seq.num_full_blocks:]

    def _cached_block(self, seq: Sequence, index: int, history: list[int] | None) -> bool:
        """Whether the prefix cache holds block `index` of `history` whole (then the prefix match past the
        cut takes it, and maybe more after it, where a copy would keep only the part before the cut)."""
        bs = seq.block_size
        if history is None or (len(history) - 1) // bs <= index:
            return False
        chunk = token_bytes(history[index * bs:(index + 1) * bs])
        digest = self.state.hasher.block_hash(seq.hashes[index - 1] if index else b"", seq.prefix_space, chunk)
        return self.state.pool.lookup(digest, chunk) is not None

    def _copy_on_write(self, seq: Sequence, index: int) -> bool:
        """Give the sequence a copy of its full block `index`, which a cut falls inside; False if it cannot.

        That block is never written again: it may be shared, and it is in the
        prefix cache under its whole content. The copy keeps the K/V before the
        cut (a resent conversation diverges mid-block wherever a reply's text
        tokenizes otherwise than it was sampled: up to a block less to compute
        per turn), and the worker writes the rest; the original stays cached.
        """
        if seq.state is SeqState.SWAPPED or index >= len(seq.block_ids) or not self.state.pool.num_free:
            return False
        src = seq.block_ids[index]
        seq.block_ids[index] = self._copy_page(src, seq)
        self.state.release_blocks([src])
        self.counters["blocks_copied_on_write"] += 1
        return True

    def _copy_page(self, src: int, seq: Sequence) -> int:
        """A page of `seq`'s own with `src`'s bytes, copied before the worker hears back (a free page must be
        there). Every slot of it that is read is copied or written first, so it is not zeroed."""
        self._charge(seq, 1)
        dst, _ = self.state.pool.allocate()
        self.outcome.effects.append(Copy(src, dst))
        self.outcome.filling.add(seq.seq_id)
        return dst

    def _free(self, op: Free) -> OpResult:
        seq = self.state.find(op.seq_id, op.session_id)
        if seq.state is SeqState.RUNNING and seq.owner != self.worker.worker_id:
            raise RunningElsewhere(f"sequence {seq.seq_id} is running on worker {seq.owner}")
        if seq.model != self.worker.model:
            raise FailedPrecondition(f"sequence {seq.seq_id} belongs to model {seq.model!r}; "
                                     f"this worker serves {self.worker.model!r}")
        if op.append or op.commit_to or op.page_sums or op.distrusted:     # its worker's last word on it
            owned = self._own(seq.seq_id)
            self._commit(owned, list(op.append), op.commit_to)   # full blocks join the prefix cache
            self._keep_sums(owned, op.sums_from, op.page_sums)
            if op.distrusted:
                self._distrusted(owned, op.distrusted)
        # Not `release`: within a Step the swap-out's cancel is undoable, and the slots are
        # given back only once the Step stands (and its copies are done or called off).
        self._cancel_swap_out(seq)
        self.state.release_blocks(seq.block_ids)
        self.outcome.read_slots += seq.slots
        if seq.session_id:
            self.outcome.freed_sessions.append(seq.session_id)
        self.state.forget(seq, self.undo)
        self.touched.pop(seq.seq_id, None)
        return OpResult(seq.seq_id, "freed", 0, [], 0, 0)

    def _fork(self, op: Fork) -> OpResult:
        parent = self._own(op.seq_id)
        self.state.check_session_free(op.session_id)
        full = parent.num_full_blocks
        partial = parent.num_committed % parent.block_size != 0
        if partial and not self.state.pool.num_free:
            raise PoolExhausted(1, 0)
        child = Sequence(self.state.new_seq_id(), parent.model, parent.block_size, parent.owner, SeqState.RUNNING,
                         list(parent.block_ids[:full]), parent.num_committed, array("I", parent.token_ids),
                         list(parent.hashes), op.session_id or None, turn_start=parent.turn_start, salt=parent.salt,
                         tenant=parent.tenant)
        self.state.pool.incref_n(child.block_ids)
        if partial:
            # The only block either side will write: copy it now rather than share it.
            child.block_ids.append(self._copy_page(parent.block_ids[full], child))
        self._create(child)
        self.counters["forks"] += 1
        return _result(child, 0, history=True)

    def _match_prefix(self, seq: Sequence) -> int:
        """Share cached blocks for the history's leading full blocks; returns tokens reused.

        The last token is always left to compute: its logits are what the worker needs.
        """
        self.counters["prefix_query_tokens"] += len(seq.token_ids)
        return self._match_further(seq)

    def _match_further(self, seq: Sequence) -> int:
        """Share cached blocks for the history's full blocks past those the sequence holds; returns tokens
        committed. From nothing, that is an Open's prefix match; past the whole blocks a resent conversation
        keeps of its session's history, it is the prefix cache's copy of the rest (another session's
        system prompt, the same conversation on another session).

        A client that starts a new conversation under a session id it used
        before (or edits its first message) would otherwise compute all of it
        again, the prefix cache's copy of its system prompt unread. Only from
        a whole block: a partly filled last block is never followed by shared ones.
        """
        bs = seq.block_size
        start = len(seq.block_ids)
        if seq.num_committed != start * bs or len(seq.hashes) != start:
            return seq.num_committed
        hits = []
        for digest, block in self.state.pool.cached_run(self.state.hasher.walk(
                seq.prefix_space, seq.token_ids, bs, start, seq.hashes[-1] if seq.hashes else b"",
                shareable_blocks(len(seq.token_ids), bs))):
            hits.append(block)
            seq.hashes.append(digest)
        self.state.pool.incref_n(hits)
        seq.block_ids += hits
        seq.num_committed = len(seq.block_ids) * bs
        self.counters["prefix_hit_tokens"] += len(hits) * bs
        return seq.num_committed

    def _commit(self, seq: Sequence, append: list[int], commit_to: int) -> None:
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
        start, full = len(seq.hashes), seq.num_full_blocks
        if full == start:
            return                   # no page filled (most decode tokens)
        chain = self.state.hasher.chain(seq.prefix_space, seq.token_ids, seq.block_size, start,
                                  seq.hashes[-1] if seq.hashes else b"", full)
        seq.hashes += [digest for digest, _ in chain]
        self.state.offer(seq, range(start, full), seq.block_ids[start:full], [chunk for _, chunk in chain])

    def _keep_sums(self, seq: Sequence, first: int, sums: list[int], *, partial: bool = False) -> None:
        """The worker's checksums of pages it committed: kept with the pages, for whoever checks them later.

        Only committed pages that are written no more: full blocks, and with
        `partial` (a Park) the partly filled last one. A page that has a
        checksum already (a shared prefix block) keeps it.
        """
        if not sums:
            return
        limit = blocks_for(seq.num_committed, seq.block_size) if partial else seq.num_full_blocks
        if first < 0 or first + len(sums) > limit:
            raise InvalidArgument(f"page sums for blocks {first} to {first + len(sums) - 1}; sequence "
                                  f"{seq.seq_id} has {limit} committed {'' if partial else 'full '}blocks")
        if any(not 0 <= value < 2**64 for value in sums):
            raise InvalidArgument("a page sum out of the range of 64 bits")
        checksum = self.state.pool.checksum
        for index, (block, value) in enumerate(zip(seq.block_ids[first:first + len(sums)], sums, strict=True),
                                               first):
            if value and not checksum[block]:
                self.state.pool.set_checksum(block, value)
                self.state.note_sum_set(seq, index)

    def _distrusted(self, seq: Sequence, indices: list[int]) -> None:
        """The worker recomputed these full blocks and got other K/V: no one is handed them again."""
        if any(not 0 <= i < seq.num_full_blocks for i in indices):
            raise InvalidArgument(f"distrusted blocks {indices}: sequence {seq.seq_id} has "
                                  f"{seq.num_full_blocks} full blocks")
        for i in indices:
            self.state.pool.unregister(seq.block_ids[i])
        integrity.count(self.counters, Where.SPOT_CHECK)
        log.error("a worker recomputed cached K/V and found it different: those blocks leave the prefix cache",
                  seq=seq.seq_id, worker=self.worker.worker_id, blocks=[seq.block_ids[i] for i in indices])

    def _swap_in(self, seq: Sequence) -> int:
        """Pages for a SWAPPED sequence: still-cached prefix blocks are shared, the rest copied back.

        The cached ones are taken first, in one run, so that the pages allocated for the rest never
        evict one of them from the cache (it would be copied back from its slot instead)."""
        pool, hashed = self.state.pool, seq.hashes[:len(seq.slots)]
        blocks = pool.lookup_run(hashed, token_bytes(seq.token_ids[:len(hashed) * seq.block_size]))
        blocks += [None] * (len(seq.slots) - len(blocks))          # the partly filled last page: no hash
        pool.incref_n([block for block in blocks if block is not None])
        copied = [i for i, block in enumerate(blocks) if block is None]
        if copied:
            assert self.state.swap is not None
            self._charge(seq, len(copied))
            fresh, _ = pool.allocate_n(len(copied))      # each page is overwritten whole: none needs zeroing
            for i, block in zip(copied, fresh, strict=True):
                blocks[i] = block
            slots = list(picked(seq.slots, copied))
            self.outcome.effects.append(SwapIn(slots, fresh, list(picked(self.state.swap.checksum, slots))))
            self.outcome.swapped_in.append(SwappedIn(seq, copied, fresh))
            self.outcome.filling.add(seq.seq_id)
        seq.block_ids += blocks
        self.outcome.read_slots += seq.slots
        seq.slots = []
        self.counters["swap_ins"] += 1
        self.counters["swap_in_blocks"] += len(copied)
        self.counters["blocks_allocated"] += len(copied)
        return seq.num_committed

    def _charge(self, seq: Sequence, pages: int) -> None:
        """`pages` fresh pages are about to be `seq`'s: QuotaExceeded first if that takes one of its holders past
        its max, so that a Step past a max is refused as such, before the pool could say it is short and
        others' sequences were evicted for it. Counted as this Step goes (fresh pages are the sequence's alone),
        counted again exactly when that count says the max is passed. Pages a Step shares (prefix hits) are
        checked once it is whole (memd.quotas.Quotas.check_growth)."""
        quotas = self.state.quotas
        if not pages or not quotas.capped:
            return
        for key in keys_of(seq):
            limit = quotas.quota(key).max
            if not limit:
                continue
            held = self.held.get(key)
            if held is None or held + pages > limit:
                self.state.index.refresh(self.touched)
                held = self.state.index.ledger.usage[key]
            if held + pages > limit:
                raise QuotaExceeded(key, held + pages, limit, self.op_index)
            self.held[key] = held + pages

    def _cancel_swap_out(self, seq: Sequence) -> None:
        """The sequence is wanted (resume) or gone (free): a swap-out in flight no longer counts.

        Out of the table now, undoably; its copy is called off once the Step stands (`KvManager.step`)."""
        job = self.state.swap_jobs.pop(seq.seq_id, None)
        if job is not None:
            self.undo.record(self.state.swap_jobs.__setitem__, seq.seq_id, job)
            self.outcome.called_off.append(job)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        needed = blocks_for(num_tokens, seq.block_size) - len(seq.block_ids)
        if needed <= 0:
            return                   # fits: the pages it holds are enough
        self.state.check_fits(num_tokens, seq.block_size)
        self.state.quotas.fits(seq, blocks_for(num_tokens, seq.block_size))
        self._charge(seq, needed)
        blocks, dirty = self.state.pool.allocate_n(needed)
        self.outcome.effects += map(Zero, dirty)
        seq.block_ids += blocks
        self.counters["blocks_allocated"] += needed


def _set_retention(seq: Sequence, until: float) -> None:
    seq.retain_until = until


def _set_blocks(seq: Sequence, blocks: list[int]) -> None:
    seq.block_ids[:] = blocks


def _set_lists(seq: Sequence, token_ids: list[int], block_ids: list[int], hashes: list[bytes]) -> None:
    seq.token_ids[:], seq.block_ids[:], seq.hashes[:] = array("I", token_ids), block_ids, hashes


def _set_model(seq: Sequence, model: str, block_size: int) -> None:
    seq.model, seq.block_size = model, block_size


def _common_prefix(a: array[int], b: list[int]) -> int:
    """How many leading tokens a history (`a`, as a Sequence keeps it) and a client's tokens share.

    Compared in C: whole, then halving the part that differs. A chat client
    resends the whole conversation every turn, and a Python loop over a
    32k-token one held memd's loop 4.2 ms.
    """
    end = min(len(a), len(b))
    try:
        mine, theirs = memoryview(a)[:end], memoryview(array(a.typecode, b[:end]))
    except OverflowError:                    # a token no history holds: compare up to it one by one
        same = 0
        while same < end and a[same] == b[same]:
            same += 1
        return same
    if mine == theirs:
        return end
    same, step = 0, end                      # the first difference is in [same, same + step)
    while step > 1:
        half = step // 2
        if mine[same:same + half] == theirs[same:same + half]:
            same, step = same + half, step - half
        else:
            step = half
    return same


def _result(seq: Sequence, first_block: int, cached: int = 0, *, history: bool = False) -> OpResult:
    return OpResult(seq.seq_id, seq.state.value, first_block, seq.block_ids[first_block:], len(seq.block_ids),
                    seq.num_committed, cached, None, array("I", seq.token_ids) if history else None)


def _restore(seq: Sequence, state: SeqState, owner: int | None, num_blocks: int, num_committed: int,
             num_tokens: int, num_hashes: int, slots: list[int], preempted_by: int | None, turn_start: int,
             interrupted: bool, turn_id: str) -> None:
    seq.state, seq.owner, seq.num_committed, seq.slots = state, owner, num_committed, slots
    seq.preempted_by, seq.turn_start, seq.interrupted, seq.turn_id = preempted_by, turn_start, interrupted, turn_id
    del seq.block_ids[num_blocks:]
    del seq.token_ids[num_tokens:]
    del seq.hashes[num_hashes:]
