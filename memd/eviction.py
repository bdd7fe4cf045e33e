"""Who loses pages when memory runs short, and how.

Victims are PARKED sequences, coldest first: heat counts touches (+1 per
Step that names the sequence, per resume, per prefix hit) decayed by
`heat_decay` per `heat_interval_s`, so a session resumed often outranks one
touched once, however recently. A block's heat is that of its hottest holder;
evicting a sequence frees only the blocks no one else holds.

A victim is swapped out when the swap tier has room (making room by dropping
swapped sequences colder than it), else dropped: its pages go, its token ids
stay, and a resume recomputes. RUNNING sequences belong to their workers:
memd never takes their pages; an operator's eviction revokes them through
the worker's Session stream instead.

Quotas narrow the choice (memd.quotas): holders past their max go first, and
no sequence goes whose eviction takes its tenant or model below its
guaranteed pages. So do retention promises (memd.retention): a retained
session is chosen last, and only swapped, never dropped.

Everything here runs on memd's event loop between Steps. A swap-out is two
calls: `begin_swap_out` reserves slots while the pages stay held, the copy
runs off the loop, and `finish_swap_out` releases the pages — unless a
resume, free or drop took the sequence meanwhile, which cancels the job.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memd import integrity
from memd.errors import InvalidArgument, NotFound
from memd.holder_ledger import Going
from memd.integrity import Where
from memd.pool import picked
from memd.quotas import Key, keys_of
from memd.retention import retained
from memd.seq_index import Cell
from memd.sequences import EvictionReason, SeqState, Sequence, SwapOut

if TYPE_CHECKING:
    from memd.kv_state import KvState

MODES = ("swap", "drop")


@dataclass(slots=True)
class Evicted:
    """What one eviction request did; swap-outs in `jobs` are still being copied."""

    jobs: list[SwapOut] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    revoked: list[tuple[int, int]] = field(default_factory=list)     # (seq id, worker id)
    blocks_freed: int = 0

    def add(self, other: Evicted) -> None:
        self.jobs += other.jobs
        self.dropped += other.dropped
        self.revoked += other.revoked
        self.blocks_freed += other.blocks_freed


class Evictor:
    def __init__(self, manager: KvState, *, idle_ttl_s: float = 0.0, watermark_blocks: int = 0) -> None:
        self.m = manager
        self.idle_ttl_s = idle_ttl_s                  # 0: never
        self.watermark_blocks = watermark_blocks

    # ---- choosing ------------------------------------------------------

    def _walk(self, exclude: frozenset[int] = frozenset()) -> Iterator[tuple[Sequence, int, bool]]:
        """Evictable parked sequences in eviction order: (sequence, blocks its eviction frees, worth evicting).

        Sequences of holders past their max come first, then the others by
        heat, sessions under a retention promise after them (and, with no
        swap tier to take them, never). One whose eviction would take a
        holder below its guaranteed pages is passed over (`memd.quotas`); once
        a holder is at its guarantee, its sequences are passed over whole. A
        block shared only among the sequences walked (forks of one prompt) is
        freed with the last of them, so it counts for that one; the others are
        worth evicting on the way. Read lazily: taking the k coldest costs
        k log n, whatever memd holds.
        """
        m, index, quotas = self.m, self.m.index, self.m.quotas
        going = self._going()
        over = {key for key, _ in quotas.over({key: going.usage(key) for key in quotas.table})}
        cells = [cell for cell in index.cells() if m.swap is not None or not cell[1]]
        holders = index.ledger.cells

        def is_over(cell: Cell) -> bool:
            return any(key in over for key in holders[cell[0]])

        groups = [[c for c in cells if is_over(c) and not c[1]], [c for c in cells if is_over(c) and c[1]],
                  [c for c in cells if not is_over(c) and not c[1]], [c for c in cells if not is_over(c) and c[1]]]
        ref, taken, walked = m.pool.ref, Counter[int](), set[int]()
        for group in groups:
            while group:
                restart = False
                walk = index.coldest_parked(group)
                try:
                    for seq in walk:
                        if seq.seq_id in exclude or seq.seq_id in walked or not m.evictable(seq):
                            continue        # (a walk restarted without a guaranteed cell meets the others again)
                        walked.add(seq.seq_id)
                        if quotas.protected(seq, going):
                            if self._at_guarantee(seq, going):
                                group = [c for c in group if c[0] != index.views[seq.seq_id].cell]
                                restart = True
                                break
                            continue
                        going.take(seq)
                        gain, shared = 0, False
                        for block in seq.block_ids:
                            taken[block] += 1
                            if taken[block] == ref[block]:
                                gain += 1
                            else:
                                shared = True
                        yield seq, gain, gain > 0 or shared
                finally:
                    walk.close()
                if not restart:
                    break

    def _going(self) -> Going:
        """Holders' pages for a walk, the index brought up to date first; swap-outs in flight are going already:
        their holders keep none of their pages."""
        m = self.m
        m.index.refresh()
        going = Going(m.index.ledger, m.quotas.table)
        for job in m.swap_jobs.values():
            going.take(job.seq)
        return going

    def _at_guarantee(self, seq: Sequence, going: Going) -> bool:
        """One of `seq`'s holders is at or below its guaranteed pages: none of its sequences may go."""
        table = self.m.quotas.table
        return any((q := table.get(key)) is not None and q.guaranteed and going.usage(key) <= q.guaranteed
                   for key in keys_of(seq))

    def exclusive_blocks(self, seq: Sequence) -> int:
        """Blocks that evicting `seq` alone frees: those no other sequence holds."""
        ref = self.m.pool.ref
        return sum(1 for block in seq.block_ids if ref[block] == 1)

    def own_plan(self, key: Key, exclude: frozenset[int] = frozenset()) -> Iterator[tuple[Sequence, int]]:
        """A holder's own evictable parked sequences, coldest first, each with the pages the holder stops
        holding when it goes (those none of its other sequences hold). Read lazily, as `_walk`."""
        m, index, quotas = self.m, self.m.index, self.m.quotas
        going = self._going()
        holders = index.ledger.cells
        cells = [c for c in index.cells() if key in holders[c[0]] and (m.swap is not None or not c[1])]
        walk = index.coldest_parked(cells)       # a promise stays, with no swap tier to keep it in
        try:
            for seq in walk:
                if seq.seq_id in exclude or not m.evictable(seq):
                    continue
                if quotas.protected(seq, going):        # a model's max never takes a tenant below its guarantee
                    continue
                gain = going.gain(key, seq)
                going.take(seq)
                yield seq, gain
        finally:
            walk.close()

    def within_quota(self, key: Key, short: int, *, reason: EvictionReason,
                     exclude: frozenset[int] = frozenset(), whole: bool = True) -> Evicted | None:
        """Evict a holder's own coldest parked sequences until it holds `short` pages fewer (counting its
        swap-outs in flight); None if all of them would not be enough and `whole` (nothing is evicted then)."""
        pending = len({block for job in self.m.swap_jobs.values() if key in keys_of(job.seq)
                       for block in job.seq.block_ids})
        target, done = short - pending, Evicted()
        if target <= 0:
            return done
        if whole:
            have, plan = 0, self.own_plan(key, exclude)
            try:
                for _, gain in plan:
                    have += gain
                    if have >= target:
                        break
            finally:
                plan.close()
            if have < target:
                return None
        plan = self.own_plan(key, exclude)
        try:
            for seq, gain in plan:
                if target <= 0:
                    break
                went = self.evict(seq, "swap", reason, room=False)
                done.add(went)
                target -= gain if went.jobs or went.dropped else 0
        finally:
            plan.close()
        return done

    def reclaimable(self, exclude: frozenset[int] = frozenset(), enough: int | None = None) -> int:
        """Blocks eviction could free: in-flight swap-outs plus evictable parked sequences (counted only until
        `enough`, if given: whether there is that much costs what that much costs)."""
        total = self.freeing_soon()
        walk = self._walk(exclude)
        try:
            for _, gain, _ in walk:
                if enough is not None and total >= enough:
                    break
                total += gain
        finally:
            walk.close()
        return total

    def freeing_soon(self) -> int:
        """Blocks the swap-outs in flight will free when their copies are done."""
        return sum(self.exclusive_blocks(job.seq) for job in self.m.swap_jobs.values())

    # ---- evicting ------------------------------------------------------

    def evict(self, seq: Sequence, mode: str, reason: EvictionReason | None, *, room: bool = True) -> Evicted:
        """Swap a PARKED sequence out (or drop it when swap cannot take it). `room`: the swap tier may make room
        by dropping colder swapped sequences (not for a holder's max: those may be another's)."""
        if self.m.seqs.get(seq.seq_id) is not seq or seq.state is not SeqState.PARKED:
            return Evicted()                  # freed or resumed since it was chosen (or already being swapped)
        keep = retained(seq)                  # swapped perhaps, never dropped (memd.retention)
        if mode == "swap" and self.m.swap is not None:
            done = Evicted()
            job = self.begin_swap_out(seq, reason, done, room=room)
            if job is not None:
                done.jobs.append(job)
                return done
            if not keep:
                done.add(self.drop(seq, reason))
            return done
        return Evicted() if keep else self.drop(seq, reason)

    def begin_swap_out(self, seq: Sequence, reason: EvictionReason | None, done: Evicted, *,
                       room: bool = True) -> SwapOut | None:
        """Reserve swap slots for `seq`, dropping colder swapped sequences for room (if `room`); None if none can
        be had."""
        m, swap, need = self.m, self.m.swap, len(seq.block_ids)
        if swap is None or need > swap.num_slots or (swap.num_free < need and not room):
            return None
        if swap.num_free < need:
            colder = self._colder_swapped(seq, need - swap.num_free)
            if colder is None:
                return None
            for victim in colder:
                done.add(self.drop(victim, reason))
        job = SwapOut(seq, list(seq.block_ids), swap.take(need), reason)
        m.swap_jobs[seq.seq_id] = job
        return job

    def _colder_swapped(self, seq: Sequence, slots: int) -> list[Sequence] | None:
        """The coldest swapped sequences no hotter than `seq` (none under a promise) whose slots add up to
        `slots`; None if all of them do not."""
        m = self.m
        m.index.refresh()
        rank, found, have = m.index.rank(seq), [], 0
        walk = m.index.coldest_swapped()
        try:
            for victim in walk:
                if have >= slots or m.index.rank(victim) > rank:
                    break
                if victim.state is SeqState.SWAPPED and not retained(victim):
                    found.append(victim)
                    have += len(victim.slots)
        finally:
            walk.close()
        return found if have >= slots else None

    def finish_swap_out(self, job: SwapOut) -> bool:
        """The copy is done: the sequence is SWAPPED and its pages free; False if it was cancelled."""
        m, seq = self.m, job.seq
        assert m.swap is not None
        if m.swap_jobs.get(seq.seq_id) is not job:
            m.give_back(job)          # called off: free now, unless it never started and they already are
            return False
        del m.swap_jobs[seq.seq_id]
        m.swap.assign(job.slots)
        for slot, checksum in zip(job.slots, job.checksums, strict=False):
            m.swap.checksum[slot] = checksum
        # A page that is not what its worker committed rotted while parked: the slot holds the rot too.
        # (Compared whole first, one list comparison: a long session's pages one by one are a Python step each.)
        committed = list(picked(m.pool.checksum, job.blocks))
        rotten = [] if committed == job.checksums or not any(committed) else [
            i for i, (got, want) in enumerate(zip(job.checksums, committed, strict=False))
            if got and want and got != want]
        seq.slots = job.slots
        job.blocks_freed = m.release_blocks(seq.block_ids)
        seq.block_ids = []
        seq.state = SeqState.SWAPPED
        m.mark_changed(seq)
        if rotten:
            integrity.slot_failed(m, seq, rotten[0], Where.SWAP_OUT)
            for i in rotten:                                 # other parked holders, the cache
                integrity.forget_page(m, job.blocks[i], Where.SWAP_OUT)
        m.counters["swap_outs"] += 1
        m.counters["swap_out_blocks"] += len(job.slots)
        if job.reason:
            m.counters[job.reason.counter] += 1
            m.quotas.evictions.update(keys_of(seq))
        return True

    def abort_swap_out(self, job: SwapOut) -> None:
        """The copy failed: the sequence stays parked with its pages."""
        m = self.m
        if m.swap_jobs.get(job.seq.seq_id) is job:
            del m.swap_jobs[job.seq.seq_id]
        m.give_back(job)

    def drop(self, seq: Sequence, reason: EvictionReason | None) -> Evicted:
        """Release a PARKED or SWAPPED sequence's pages and slots; its token ids stay for a recompute."""
        m = self.m
        freed = m.release(seq)
        seq.hashes, seq.num_committed = [], 0
        seq.state = SeqState.DROPPED
        m.counters["drops"] += 1
        if reason:
            m.counters[reason.counter] += 1
            m.quotas.evictions.update(keys_of(seq))
        return Evicted(dropped=[seq.seq_id], blocks_freed=freed)

    def make_room(self, blocks: int, *, reason: EvictionReason, mode: str = "swap",
                  exclude: frozenset[int] = frozenset()) -> Evicted:
        """Evict the coldest PARKED sequences until `blocks` more blocks are (or are about to be) free."""
        target = blocks - self.freeing_soon()
        done = Evicted()
        if target <= 0:
            return done
        walk = self._walk(exclude)
        try:
            for seq, gain, worth in walk:
                if target <= 0:
                    break
                if worth and self.m.evictable(seq):
                    went = self.evict(seq, mode, reason)
                    done.add(went)
                    target -= gain if went.jobs or went.dropped else 0   # a retained one swap could not take stays
        finally:
            walk.close()
        return done

    # ---- policy --------------------------------------------------------

    def sweep(self, now: float) -> Evicted:
        """The periodic pass: idle TTL, revocations whose sequence is parked now, the free-block watermark."""
        m, done = self.m, Evicted()
        m.index.refresh()
        if self.idle_ttl_s:
            for seq in m.index.idle_since(now - self.idle_ttl_s):
                if retained(seq):                 # looked at again once its promise ends
                    m.index.requeue_idle(seq, now + max(0.0, seq.retain_until - time.time()))
                    continue
                if seq.state in (SeqState.PARKED, SeqState.SWAPPED):
                    done.add(self.drop(seq, EvictionReason.IDLE))
                elif seq.state is SeqState.DROPPED and seq.session_id is None:
                    m.forget(seq)                 # nothing names it but a seq id nobody used for a TTL
                    m.counters["forgotten"] += 1
        for seq_id, mode in list(m.revoked.items()):
            seq = m.seqs.get(seq_id)
            if seq is None or seq.state is not SeqState.RUNNING:
                del m.revoked[seq_id]
            if seq is not None and m.evictable(seq):
                done.add(self.evict(seq, mode, EvictionReason.FORCED))     # its worker died before giving it up
        if m.quotas.capped:            # an operator lowered a max: the holder's own coldest go first
            for key, over in m.quotas.over(m.index.ledger.usage):
                done.add(self.within_quota(key, over, reason=EvictionReason.QUOTA, whole=False) or Evicted())
        short = self.watermark_blocks - m.pool.num_free
        if short > 0:
            done.add(self.make_room(short, reason=EvictionReason.PRESSURE))
        return done

    def force(self, *, seq_id: int | None = None, session_id: str | None = None, idle_s: float | None = None,
              blocks: int | None = None, worker_id: int | None = None, mode: str = "swap") -> Evicted:
        """An operator's eviction (`memctl evict`)."""
        if mode not in MODES:
            raise InvalidArgument(f"eviction mode {mode!r}: use swap or drop")
        m, done = self.m, Evicted()
        if blocks is not None:
            if not 0 < blocks <= m.pool.num_blocks:
                raise InvalidArgument(f"evict --blocks takes 1 to {m.pool.num_blocks}, the blocks in the pool, "
                                      f"not {blocks}")
            # Until `blocks` are free, not `blocks` more: an operator asking for room for one long prompt
            # must not swap out every parked session of a nearly empty pool.
            return self.make_room(blocks - m.pool.num_free, reason=EvictionReason.FORCED, mode=mode)
        if worker_id is not None:
            if worker_id not in m.workers:
                raise NotFound(f"no worker {worker_id}")
            targets = [s for s in m.seqs.values() if s.owner == worker_id]
        elif idle_s is not None:
            if idle_s < 0:
                raise InvalidArgument("evict --idle needs seconds >= 0")
            now = time.monotonic()
            targets = [s for s in m.seqs.values() if s.state in (SeqState.PARKED, SeqState.SWAPPED)
                       and now - s.last_access >= idle_s]
        else:
            targets = [m.find(seq_id, session_id)]
        named = seq_id is not None or session_id is not None
        for seq in targets:
            done.add(self._force_one(seq, mode, named))
        return done

    def _force_one(self, seq: Sequence, mode: str, named: bool) -> Evicted:
        """`named`: the operator named this sequence, and may drop it though it is retained."""
        if seq.state is SeqState.RUNNING:
            assert seq.owner is not None
            self.m.revoked[seq.seq_id] = mode
            return Evicted(revoked=[(seq.seq_id, seq.owner)])
        if mode == "drop" and seq.state in (SeqState.PARKED, SeqState.SWAPPED) and (named or not retained(seq)):
            return self.drop(seq, EvictionReason.FORCED)
        if self.m.evictable(seq):
            return self.evict(seq, mode, EvictionReason.FORCED)
        return Evicted()          # already swapped (or being swapped), or dropped
