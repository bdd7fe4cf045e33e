"""memd's journal (memd.journal, memd.recovery): whatever memd did, the journal read back rebuilds the same sequences.

The manager state machine of test_manager_properties runs with a journal; after
every rule the journal is read back into a fresh manager, as a memd restarted
after kill -9 would, and must give every sequence back as recovery promises
(RUNNING ones parked at their committed length), with no invariant broken.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant
from structlog.testing import capture_logs

import memd.journal
from memd.journal import WriteAheadLog
from memd.manager import KvManager
from memd.recovery import restore
from memd.sequences import SeqState, blocks_for
from memd.state_dir import Layout, StateDir, StateError
from shared.ops import Extend, Free, Open, Park, Resume
from tests.test_manager_properties import BLOCK_SIZE, NUM_BLOCKS, SWAP_SLOTS, KvManagerMachine, attach, new_manager

LAYOUT = Layout("shm", NUM_BLOCKS, 4096, SWAP_SLOTS)


def expected_after_restart(manager: KvManager) -> dict[int, tuple]:
    """What recovery promises for each live sequence."""
    out = {}
    for seq in manager.seqs.values():
        state, blocks, slots, committed = seq.state, list(seq.block_ids), list(seq.slots), seq.num_committed
        interrupted = seq.interrupted or seq.state is SeqState.RUNNING or seq.preempted_by is not None
        if interrupted and seq.session_id is None:
            continue
        if state is SeqState.RUNNING:           # its worker may still write past its whole blocks
            committed -= committed % seq.block_size
            state, blocks = SeqState.PARKED, blocks[:blocks_for(committed, seq.block_size)]
        if manager.filling(seq.seq_id):
            state, blocks, slots, committed = SeqState.DROPPED, [], [], 0
        out[seq.seq_id] = (seq.model, seq.block_size, seq.session_id, state, blocks, slots, committed,
                           list(seq.token_ids), seq.turn_start, interrupted, seq.turn_id)
    return out


def expected_fences(manager: KvManager) -> set[int]:
    """Pages a worker alive before the restart may still write: fenced ones, and its running turns' pages
    past their whole blocks."""
    out = {b for blocks in manager.fences.values() for b in blocks}
    for seq in manager.seqs.values():
        if seq.state is SeqState.RUNNING:
            out.update(seq.block_ids[seq.num_full_blocks:])
    return out


def recovered(state: StateDir) -> KvManager:
    found = state.read()
    assert found is not None and not found.torn
    restored = restore(found, pool_kept=True, swap_kept=True, num_blocks=NUM_BLOCKS, num_slots=SWAP_SLOTS)
    assert restored.discarded == 0 and restored.dropped.keys() <= {"pages being filled when memd stopped"}
    fresh = new_manager()
    fresh.adopt(restored.sequences, found.max_seq_id + 1, restored.fences, restored.slot_checksums,
                restored.block_checksums)
    return fresh


def resumed_and_recovered_again(state: StateDir) -> None:
    """A memd that recovered from `state`'s journal goes on appending to it (WriteAheadLog.resume), opens a
    session on every free page (pages the sequences it did not keep, or kept shorter, held in the journal),
    and is killed: the memd after it recovers what it had, sequence for sequence, fences too."""
    found = state.read()
    assert found is not None
    restored = restore(found, pool_kept=True, swap_kept=True, num_blocks=NUM_BLOCKS, num_slots=SWAP_SLOTS)
    first = new_manager()
    first.adopt(restored.sequences, found.max_seq_id + 1, restored.fences, restored.slot_checksums,
                restored.block_checksums)
    copy = Path(tempfile.mkdtemp(prefix="kvpool-resumed-"))
    try:
        shutil.copy(state.journal, copy / state.journal.name)
        wal = WriteAheadLog(StateDir(copy), LAYOUT, fsync=False)
        wal.resume(first, found, restored.changed)
        if free := first.pool.num_free:
            worker = attach(first, "after")
            prompt = [50_000 + i for i in range(free * BLOCK_SIZE - 1)]
            opened, = first.step(worker, [Open(prompt, reserve=1, session_id="after-restart")]).results
            first.step(worker, [Park(opened.seq_id, commit_to=len(prompt))])
            wal.flush(first)
        wal.close()
        again = recovered(StateDir(copy))
        assert as_recovered(again) == as_recovered(first)
        assert again.fences == first.fences and again.max_seq_id == first.max_seq_id
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def as_recovered(fresh: KvManager) -> dict[int, tuple]:
    """The sequences a restarted manager has, in `expected_after_restart`'s terms."""
    return {s.seq_id: (s.model, s.block_size, s.session_id, s.state, s.block_ids, s.slots, s.num_committed,
                       list(s.token_ids), s.turn_start, s.interrupted, s.turn_id) for s in fresh.seqs.values()}


class JournaledMachine(KvManagerMachine):
    """The manager state machine, journaled; each rule ends with a flush, as memd's service does."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvpool-journal-"))
        self.state = StateDir(self.dir)
        self.wal = WriteAheadLog(self.state, LAYOUT, fsync=False)
        self.wal.checkpoint(self.manager)
        self._threshold, memd.journal.CHECKPOINT_RECORDS = memd.journal.CHECKPOINT_RECORDS, 8   # rewrite often
        self._chunk, memd.journal.REWRITE_CHUNK = memd.journal.REWRITE_CHUNK, 1     # over several flushes

    def _flush_and_recover(self) -> None:
        self.wal.flush(self.manager)
        fresh = recovered(self.state)
        assert as_recovered(fresh) == expected_after_restart(self.manager)
        live = self.manager.pool
        for seq in fresh.seqs.values():
            for block in seq.block_ids:
                # A page's checksum comes back, or none (never another); a page no other sequence shares comes
                # back with its own (a shared one's may have been set by a sequence gone since).
                assert fresh.pool.checksum[block] in (0, live.checksum[block])
                assert live.ref[block] > 1 or fresh.pool.checksum[block] == live.checksum[block]
        assert {b for blocks in fresh.fences.values() for b in blocks} == expected_fences(self.manager)
        assert fresh.violations() == []
        # The restarted manager works: a new sequence gets an id never handed out before, a freed one's included.
        for pid in list(fresh.fences):
            fresh.lift(pid)
        worker = attach(fresh, "m")
        opened, = fresh.step(worker, [Open([1, 2, 3])]).results
        assert opened.seq_id == self.manager._next_seq

    @invariant()
    def the_journal_rebuilds_the_state(self) -> None:
        self._flush_and_recover()

    def teardown(self) -> None:
        try:
            self._flush_and_recover()
            resumed_and_recovered_again(self.state)
        finally:
            memd.journal.CHECKPOINT_RECORDS, memd.journal.REWRITE_CHUNK = self._threshold, self._chunk
            self.wal.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            super().teardown()


JournaledMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_the_journal_rebuilds_what_the_manager_did = JournaledMachine.TestCase


# ---- examples ------------------------------------------------------------


def journaled(path: Path, *, fsync: bool = False) -> tuple[StateDir, KvManager, WriteAheadLog, int]:
    """A manager with a journal in `path`, and one attached worker."""
    state, manager = StateDir(path), new_manager()
    wal = WriteAheadLog(state, LAYOUT, fsync=fsync)
    wal.checkpoint(manager)
    return state, manager, wal, attach(manager, "m")


def test_a_record_torn_by_a_crash_is_ignored_and_what_came_before_stands(tmp_path):
    state, manager, wal, worker = journaled(tmp_path, fsync=True)
    opened, = manager.step(worker, [Open([1, 2, 3, 4, 5], session_id="kept")]).results
    manager.step(worker, [Park(opened.seq_id, commit_to=5)])
    wal.flush(manager)
    manager.step(worker, [Resume(session_id="kept", reserve=1)])
    wal.flush(manager)
    wal.close()
    data = state.journal.read_bytes()
    last = len(msgpack.packb(["S", opened.seq_id]))          # about a record's head: cut inside the last one
    state.journal.write_bytes(data[:-last])
    found = state.read()
    assert found is not None and found.torn
    fresh_state = restore(found, pool_kept=True, swap_kept=True, num_blocks=NUM_BLOCKS, num_slots=SWAP_SLOTS)
    seq, = fresh_state.sequences
    assert (seq.state, seq.num_committed, list(seq.token_ids)) == (SeqState.PARKED, 5, [1, 2, 3, 4, 5])


def test_a_memd_goes_on_appending_after_a_torn_record_and_the_next_one_reads_all_of_it(tmp_path):
    """Recovery keeps the journal it read (WriteAheadLog.resume): a record torn by the crash is cut off first, or
    what this memd appends after it could never be read back."""
    state, manager, wal, worker = journaled(tmp_path)
    opened, = manager.step(worker, [Open([1, 2, 3, 4, 5], session_id="kept")]).results
    manager.step(worker, [Park(opened.seq_id, commit_to=5)])
    wal.flush(manager)
    wal.close()
    state.journal.write_bytes(state.journal.read_bytes() + b"\x99\x01")      # a record's first bytes, then the crash
    found = state.read()
    assert found is not None and found.torn
    restored = restore(found, pool_kept=True, swap_kept=True, num_blocks=NUM_BLOCKS, num_slots=SWAP_SLOTS)
    second = new_manager()
    second.adopt(restored.sequences, found.max_seq_id + 1, restored.fences)
    wal = WriteAheadLog(state, LAYOUT, fsync=True)
    wal.resume(second, found, restored.changed)
    worker = attach(second, "m")
    later, = second.step(worker, [Open([9] * 20, session_id="later")]).results
    second.step(worker, [Park(later.seq_id, commit_to=20)])
    wal.flush(second)
    wal.close()
    third = recovered(state)                                   # not torn, and both sessions whole
    assert {s.session_id: (s.state, list(s.token_ids)) for s in third.seqs.values()} == {
        "kept": (SeqState.PARKED, [1, 2, 3, 4, 5]), "later": (SeqState.PARKED, [9] * 20)}


def test_records_that_do_not_fit_the_pool_come_back_dropped_with_their_tokens(tmp_path):
    state, manager, wal, worker = journaled(tmp_path)
    for session in ("a", "b"):
        opened, = manager.step(worker, [Open(list(range(9)), session_id=session)]).results
        manager.step(worker, [Park(opened.seq_id, commit_to=9)])
    wal.flush(manager)
    found = state.read()
    assert found is not None
    small = restore(found, pool_kept=True, swap_kept=True, num_blocks=2, num_slots=SWAP_SLOTS)
    assert small.dropped == {"block table does not fit the pool": 2}
    assert all(s.state is SeqState.DROPPED and list(s.token_ids) == list(range(9)) for s in small.sequences)
    gone = restore(found, pool_kept=False, swap_kept=True, num_blocks=NUM_BLOCKS, num_slots=SWAP_SLOTS)
    assert gone.dropped == {"pool not reopened": 2}


@pytest.mark.parametrize("content", [b"", b"\xc1garbage", msgpack.packb(["H", {"format": "kvpool-journal",
                                                                               "version": 99}])])
def test_a_file_that_is_not_a_current_journal_is_refused(tmp_path, content):
    state = StateDir(tmp_path)
    state.journal.write_bytes(content)
    with pytest.raises(StateError):
        state.read()


def test_one_memd_at_a_time_holds_a_state_directory(tmp_path):
    first, second = StateDir(tmp_path), StateDir(tmp_path)
    first.lock()
    with pytest.raises(StateError, match="in use by another memd"):
        second.lock()


def test_pool_files_of_another_layout_go_before_memd_counts_its_memory(tmp_path):
    state, mib = StateDir(tmp_path), 1 << 20
    (tmp_path / "pool").write_bytes(bytes(6 * mib))      # an older memd's pool in one file
    state.keep_pool([2 * mib] * 3)
    assert state.pool_files() == [tmp_path / "pool"] and not (tmp_path / "pool").exists()

    for name in ("pool", "pool.1", "pool.2", "pool.3"):   # the files it needs, and one more
        (tmp_path / name).write_bytes(bytes(2 * mib))
    state.keep_pool([2 * mib] * 3)
    assert [p.name for p in state.pool_files()] == ["pool", "pool.1", "pool.2"]
    assert all(p.stat().st_size == 2 * mib for p in state.pool_files())


def test_a_journal_that_cannot_be_written_is_given_up_and_removed_and_memd_goes_on(tmp_path):
    state, manager, wal, worker = journaled(tmp_path)
    opened, = manager.step(worker, [Open([1, 2, 3, 4, 5], session_id="kept")]).results
    os.close(wal._fd)                                   # as a write on a full tmpfs would fail: EBADF here
    wal.flush(manager)
    assert not state.journal.exists() and not manager.take_changes().seq_ids
    manager.step(worker, [Park(opened.seq_id, commit_to=5)])
    wal.flush(manager)                                  # nothing to write to, nothing raised
    assert not state.journal.exists() and not manager.take_changes().seq_ids


def test_the_highest_sequence_id_handed_out_outlives_the_sequence_and_a_checkpoint(tmp_path):
    state, manager, wal, worker = journaled(tmp_path)
    kept, = manager.step(worker, [Open([1, 2, 3], session_id="kept")]).results
    wal.flush(manager)
    gone, = manager.step(worker, [Open([4, 5, 6])]).results
    manager.step(worker, [Free(gone.seq_id)])         # opened and freed between two flushes: no record of it
    wal.flush(manager)
    found = state.read()
    assert found is not None and found.max_seq_id == gone.seq_id
    wal.checkpoint(manager)                           # as a restarted memd begins: the live state alone
    found = state.read()
    assert found is not None and list(found.records) == [kept.seq_id] and found.max_seq_id == gone.seq_id
    fresh = recovered(state)
    again, = fresh.step(attach(fresh, "m"), [Open([7, 8])]).results
    assert again.seq_id == gone.seq_id + 1
    wal.close()


def test_garbled_records_and_clashing_tables_are_never_trusted(tmp_path):
    state, manager, wal, worker = journaled(tmp_path)
    for session in ("a", "b"):
        opened, = manager.step(worker, [Open(list(range(6)), session_id=session)]).results
        manager.step(worker, [Park(opened.seq_id, commit_to=6)])        # one full block, one partial
    wal.flush(manager)
    wal.close()
    found = state.read()
    assert found is not None
    a, b = sorted(found.records)
    found.records[b][memd.journal.BLOCKS] = list(found.records[a][memd.journal.BLOCKS])   # b claims a's pages
    found.records[99] = ["S", 99, "parked", 7, 4, None, 0, [], [], 0.0, 0.0, 0.0, 0, [], False, 0, False]
    restored = restore(found, pool_kept=True, swap_kept=True, num_blocks=NUM_BLOCKS, num_slots=SWAP_SLOTS)
    assert restored.dropped == {"block table clashes with another sequence's": 1} and restored.discarded == 1
    fresh = new_manager()
    fresh.adopt(restored.sequences, found.max_seq_id + 1)
    assert fresh.violations() == []

    with state.journal.open("ab") as f:               # a record of the wrong shape, then one past any int
        f.write(msgpack.packb({"not": "a record"}) + msgpack.packb(["S", float("inf")]))
    again = state.read()
    assert again is not None and again.torn and set(again.records) == {a, b}


def test_a_state_directory_too_small_for_the_pool_is_refused_in_one_line(tmp_path, monkeypatch):
    from memd.startup import StartupError, check_room

    small = os.statvfs_result((4096, 4096, 25000, 25000, 25000, 100, 100, 100, 0, 255))   # 100 MB free
    monkeypatch.setattr(os, "statvfs", lambda path: small)
    with pytest.raises(StartupError, match=r"has 97\.7 MiB free; the pool and swap tier need 128\.0 MiB"):
        check_room(StateDir(tmp_path), 128 << 20)
    check_room(StateDir(tmp_path), 1 << 10)                   # what fits goes through


def test_a_swapped_sequences_slot_checksums_survive_a_restart(tmp_path):
    state, manager, wal, worker = journaled(tmp_path)
    opened, = manager.step(worker, [Open(list(range(10)), session_id="s")]).results
    manager.step(worker, [Park(opened.seq_id, commit_to=10)])
    seq = manager.seqs[opened.seq_id]
    job, = manager.evictions.evict(seq, "swap", None).jobs
    job.checksums = [1000 + i for i in range(len(job.slots))]     # what the swap-out copy found in its slots
    assert manager.evictions.finish_swap_out(job)
    wal.flush(manager)
    fresh = recovered(state)
    assert [fresh.swap.checksum[slot] for slot in fresh.seqs[seq.seq_id].slots] == job.checksums


def test_the_page_checksums_of_a_sequence_running_when_memd_died_come_back(tmp_path):
    state, manager, wal, worker = journaled(tmp_path)
    opened, = manager.step(worker, [Open(list(range(10)), reserve=4, session_id="s")]).results
    manager.step(worker, [Extend(opened.seq_id, commit_to=9, sums_from=0, page_sums=[71, 72])])
    wal.flush(manager)                                             # memd dies with the turn running
    fresh = recovered(state)
    seq = fresh.seqs[opened.seq_id]
    assert seq.state is SeqState.PARKED and len(seq.block_ids) == 2
    assert [fresh.pool.checksum[b] for b in seq.block_ids] == [71, 72]


def test_the_journal_is_rewritten_a_chunk_per_flush_and_stays_whole_meanwhile(tmp_path, monkeypatch):
    monkeypatch.setattr(memd.journal, "CHECKPOINT_RECORDS", 10)
    monkeypatch.setattr(memd.journal, "REWRITE_CHUNK", 3)
    state, manager, wal, worker = journaled(tmp_path)
    opened = manager.step(worker, [Open([100 * i, 100 * i + 1], session_id=f"s{i}") for i in range(12)]).results
    new = tmp_path / "journal.new"
    for _ in range(5):                                      # 12 records a flush: 48 (4 per sequence) are allowed
        assert not new.exists()
        manager.step(worker, [Extend(r.seq_id, commit_to=1) for r in opened])
        wal.flush(manager)
    assert new.exists()                                     # the 5th went past: a rewrite began
    flushes = 0
    while new.exists():
        manager.step(worker, [Extend(opened[flushes].seq_id, append=[7], commit_to=2)])
        wal.flush(manager)
        flushes += 1
        assert {s.seq_id: s.token_ids for s in recovered(state).seqs.values()} == \
            {s.seq_id: s.token_ids for s in manager.seqs.values()}       # the journal in use is whole
        assert flushes < 12
    assert flushes == 4                                     # 12 sequences, 3 per flush
    assert {s.seq_id: s.token_ids for s in recovered(state).seqs.values()} == \
        {s.seq_id: s.token_ids for s in manager.seqs.values()}
    # The live state, and the one change made to a sequence already copied (the 3 before it changed sequences
    # not copied yet, which were copied as they were then).
    assert read_records(state) == len(manager.seqs) + 1
    wal.close()


def test_a_rewrite_copies_long_histories_a_few_at_a_time(tmp_path, monkeypatch):
    """A chunk is bounded by token ids too: a long chat's record holds its whole history."""
    monkeypatch.setattr(memd.journal, "CHECKPOINT_RECORDS", 10)
    monkeypatch.setattr(memd.journal, "REWRITE_CHUNK_TOKENS", 20)
    state, manager, wal, worker = journaled(tmp_path)
    opened = manager.step(worker, [Open(list(range(100 * i, 100 * i + 12)), session_id=f"s{i}")
                                   for i in range(4)]).results
    new, copied = tmp_path / "journal.new", []
    while not copied or new.exists():                       # decoding: every sequence changes at every flush
        manager.step(worker, [Extend(r.seq_id, append=[7]) for r in opened])
        before = new.stat().st_size if new.exists() else None
        wal.flush(manager)
        if before is not None:
            copied.append(len(wal._held.tokens) if not new.exists() else len(wal._rewrite.held.tokens))
        assert as_recovered(recovered(state)) == expected_after_restart(manager)
    assert copied == [2, 4]                                 # 2 sequences (24+ tokens) a flush, not all 4
    assert as_recovered(recovered(state)) == expected_after_restart(manager)
    wal.close()


@pytest.mark.parametrize("fails_at", ["its header", "its first chunk"])
def test_a_rewrite_that_cannot_be_written_is_abandoned_and_the_journal_in_use_goes_on(tmp_path, monkeypatch,
                                                                                      fails_at):
    monkeypatch.setattr(memd.journal, "CHECKPOINT_RECORDS", 10)
    monkeypatch.setattr(memd.journal, "REWRITE_CHUNK", 3)
    state, manager, wal, worker = journaled(tmp_path)
    opened = manager.step(worker, [Open([100 * i, 100 * i + 1], session_id=f"s{i}") for i in range(12)]).results
    new, written, full = tmp_path / "journal.new", [], [True]

    def write_all(fd: int, data: bytes, write=memd.journal._write_all) -> None:
        if wal._rewrite is not None and fd == wal._rewrite.fd:     # journal.new, on a file system now full
            written.append(len(data))
            if full[0] and len(written) > (fails_at == "its first chunk"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(fd, data)

    def one_flush(i: int) -> None:
        manager.step(worker, [Extend(r.seq_id, append=[i] if j == i % 12 else [], commit_to=1)
                              for j, r in enumerate(opened)])
        wal.flush(manager)
        assert {s.seq_id: s.token_ids for s in recovered(state).seqs.values()} == \
            {s.seq_id: s.token_ids for s in manager.seqs.values()}        # every sequence, every token

    monkeypatch.setattr(memd.journal, "_write_all", write_all)
    with capture_logs() as logs:
        for i in range(9):                      # 12 records a flush: the 5th (60 > 48) begins a rewrite
            one_flush(i)
            assert state.journal.exists() and new.exists() == (wal._rewrite is not None)
    tries = len(written)
    assert tries == 1 + (fails_at == "its first chunk")                # one try, then none for 48 records more
    warned, = logs                              # once; the journal in use was never given up
    assert (warned["log_level"], warned["event"], warned["error"]) == \
        ("warning", "cannot rewrite the journal: memd goes on appending to it and tries again later",
         os.strerror(errno.ENOSPC))

    grown = read_records(state)
    full[0] = False                             # room again: the next try succeeds
    with capture_logs() as logs:
        for i in range(9, 20):
            one_flush(i)
            if logs:
                break
    assert [e["event"] for e in logs] == ["the journal was rewritten again"] and not new.exists()
    # The live state, and each of the 4 flushes' changes to the sequences it had copied already (3, 6, 9).
    assert read_records(state) == len(manager.seqs) + 3 + 6 + 9 < grown
    wal.close()


def journal_records(state: StateDir) -> list[list]:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(state.journal.read_bytes())
    return list(unpacker)


def read_records(state: StateDir) -> int:
    return len(journal_records(state)) - 1                 # the header aside


@pytest.mark.parametrize("sent", ["as pages fill", "never", "late"])
def test_a_decoding_sequences_records_carry_the_end_of_its_table_and_read_back_whole(tmp_path, sent):
    """A decode Step's record carries the end of the table (its pages not yet full), not the whole table, so
    journaling a Step does not grow with the context, whether the worker sends its pages' checksums as they
    fill, never, or later for pages the journal holds already; read back, the table is whole, and so are its
    pages' checksums."""
    state, manager, wal, worker = journaled(tmp_path)
    opened, = manager.step(worker, [Open([1, 2, 3, 4, 5], reserve=1, session_id="s")]).results
    seq = manager.seqs[opened.seq_id]
    manager.step(worker, [Extend(seq.seq_id, commit_to=5, reserve=1,
                                 **({"sums_from": 0, "page_sums": [900]} if sent == "as pages fill" else {}))])
    wal.flush(manager)
    carried = []

    def check() -> None:
        fresh = recovered(state)
        assert as_recovered(fresh) == expected_after_restart(manager)
        back = fresh.seqs[seq.seq_id].block_ids
        assert [fresh.pool.checksum[b] for b in back] == [manager.pool.checksum[b] for b in back]

    while seq.num_committed < 60:
        n = seq.num_committed + 1                       # a page's checksum is sent once the page is full
        sums = {"sums_from": n // BLOCK_SIZE - 1, "page_sums": [900 + n]} \
            if n % BLOCK_SIZE == 0 and sent == "as pages fill" else {}
        manager.step(worker, [Extend(seq.seq_id, append=[n], commit_to=n, reserve=1, **sums)])
        wal.flush(manager)
        carried.append(len(journal_records(state)[-1][memd.journal.BLOCKS]))
        check()
    assert len(seq.block_ids) == 16 and max(carried) == 2
    if sent == "late":          # every full page's checksum at once, from the first
        manager.step(worker, [Extend(seq.seq_id, commit_to=60, reserve=1, sums_from=0,
                                     page_sums=list(range(900, 900 + seq.num_full_blocks)))])
        wal.flush(manager)
        assert journal_records(state)[-1][memd.journal.BLOCKS_FROM] == 0
        check()
    assert all(manager.pool.checksum[b] for b in seq.block_ids[:seq.num_full_blocks]) == (sent != "never")


def test_a_parked_pages_checksum_goes_from_the_journal_once_its_sequence_resumes(tmp_path):
    """The partly filled last page is summed when its sequence parks, and written again once it resumes: the
    journal must not keep that checksum for it (a restart would find the page rotten)."""
    state, manager, wal, worker = journaled(tmp_path)
    opened, = manager.step(worker, [Open(list(range(6)), reserve=1, session_id="s")]).results
    manager.step(worker, [Park(opened.seq_id, commit_to=6, sums_from=0, page_sums=[71, 72])])
    wal.flush(manager)
    assert [recovered(state).pool.checksum[b] for b in manager.seqs[opened.seq_id].block_ids] == [71, 72]
    manager.step(worker, [Resume(session_id="s", reserve=1)])
    manager.step(worker, [Park(opened.seq_id, append=[6], commit_to=7)])          # no checksum sent this time
    wal.flush(manager)
    fresh = recovered(state)
    assert [fresh.pool.checksum[b] for b in fresh.seqs[opened.seq_id].block_ids] == [71, 0]


def test_a_table_cut_back_is_written_whole_again(tmp_path):
    state, manager, wal, worker = journaled(tmp_path)
    opened, = manager.step(worker, [Open(list(range(12)), reserve=1, session_id="s")]).results
    manager.step(worker, [Park(opened.seq_id, commit_to=12, sums_from=0, page_sums=[71, 72, 73])])
    wal.flush(manager)
    # The same session sent again with its history changed after the first page: a retried turn.
    manager.step(worker, [Open([0, 1, 2, 3, 50, 51, 52], session_id="s", continue_session=True,
                               whole_history=True)])
    wal.flush(manager)
    record = journal_records(state)[-1]
    assert record[memd.journal.BLOCKS_FROM] == 0
    assert as_recovered(recovered(state)) == expected_after_restart(manager)


def test_a_journal_of_the_version_before_is_read(tmp_path):
    """Upgrading memd keeps the parked sessions: version 1 records carry the whole table, and no blocks_from."""
    state, manager, wal, worker = journaled(tmp_path)
    opened, = manager.step(worker, [Open(list(range(9)), session_id="s")]).results
    manager.step(worker, [Park(opened.seq_id, commit_to=9, sums_from=0, page_sums=[71, 72, 73])])
    wal.flush(manager)
    wal.close()
    records = journal_records(state)
    records[0][1]["version"] = 1
    old = [records[0]] + [r[:memd.journal.BLOCKS_FROM] if r[0] == "S" else r for r in records[1:]]
    state.journal.write_bytes(b"".join(msgpack.packb(r) for r in old))
    fresh = recovered(state)
    assert as_recovered(fresh) == expected_after_restart(manager)
    assert [fresh.pool.checksum[b] for b in fresh.seqs[opened.seq_id].block_ids] == [71, 72, 73]


@pytest.mark.parametrize("garbled", ["no record before", "its checksums cut short", "its own checksums cut"])
def test_the_end_of_a_table_that_the_record_before_does_not_hold_is_never_trusted(tmp_path, garbled):
    state, manager, wal, worker = journaled(tmp_path)
    opened, = manager.step(worker, [Open(list(range(5)), reserve=1, session_id="s")]).results
    manager.step(worker, [Extend(opened.seq_id, commit_to=5, reserve=1, sums_from=0, page_sums=[71])])
    wal.flush(manager)
    manager.step(worker, [Park(opened.seq_id, append=[5], commit_to=6)])
    wal.flush(manager)
    header, whole, end = journal_records(state)
    assert end[memd.journal.BLOCKS_FROM] == 1
    if garbled == "its checksums cut short":
        whole[memd.journal.BLOCK_SUMS] = []
    elif garbled == "its own checksums cut":
        end[memd.journal.BLOCK_SUMS] = []
    records = [header, end] if garbled == "no record before" else [header, whole, end]
    state.journal.write_bytes(b"".join(msgpack.packb(r) for r in records))
    found = state.read()
    assert found is not None and found.torn
    assert not found.records or found.records[opened.seq_id][memd.journal.COMMITTED] == 5     # the record before


def test_a_table_swapped_out_and_in_is_written_whole_again(tmp_path):
    state, manager, wal, worker = journaled(tmp_path)
    opened, = manager.step(worker, [Open(list(range(9)), session_id="s")]).results
    manager.step(worker, [Park(opened.seq_id, commit_to=9, sums_from=0, page_sums=[71, 72, 73])])
    wal.flush(manager)
    seq = manager.seqs[opened.seq_id]
    job, = manager.evictions.evict(seq, "swap", None).jobs
    job.checksums = [71, 72, 73]
    assert manager.evictions.finish_swap_out(job)
    wal.flush(manager)
    assert as_recovered(recovered(state)) == expected_after_restart(manager)
    # Every free page taken and given back: the prefix cache no longer holds the sequence's pages.
    filler, = manager.step(worker, [Open(list(range(100, 100 + BLOCK_SIZE * manager.pool.num_free)))]).results
    manager.step(worker, [Free(filler.seq_id)])
    outcome = manager.step(worker, [Resume(session_id="s")])             # back into other pages
    swap_in, = outcome.effects
    assert len(swap_in.pages) == 3
    wal.flush(manager)
    assert as_recovered(recovered(state)) == expected_after_restart(manager)
    manager.effects_landed(outcome)               # the pages copied back: their checksums are theirs again
    wal.flush(manager)
    fresh = recovered(state)
    assert as_recovered(fresh) == expected_after_restart(manager)
    assert [fresh.pool.checksum[b] for b in fresh.seqs[opened.seq_id].block_ids] == [71, 72]   # its full pages


def test_a_salted_prefix_serves_only_its_salt_before_and_after_a_restart(tmp_path):
    """vLLM's cache_salt: a prompt never finds blocks cached under another salt, or under none; a salted
    sequence keeps its salt through the journal, and with it whose prompts its blocks serve."""
    state, manager, wal, worker = journaled(tmp_path)
    prompt = list(range(100, 100 + 3 * BLOCK_SIZE + 1))
    opened, = manager.step(worker, [Open(prompt, session_id="kept", cache_salt="team-a", tenant="acme")]).results
    manager.step(worker, [Park(opened.seq_id, commit_to=len(prompt))])

    def hits(m: KvManager, worker_id: int, salt: str | None) -> int:
        tried, = m.step(worker_id, [Open(prompt, cache_salt=salt)]).results
        m.step(worker_id, [Free(tried.seq_id)])
        return tried.num_cached

    assert [hits(manager, worker, salt) for salt in ("team-b", None, "team-a")] == [0, 0, 3 * BLOCK_SIZE]
    wal.flush(manager)
    fresh = recovered(state)
    again = attach(fresh, "m")
    kept = fresh.seqs[fresh.sessions["kept"]]
    assert (kept.salt, kept.tenant) == ("team-a", "acme")
    assert [hits(fresh, again, salt) for salt in ("team-b", None, "team-a")] == [0, 0, 3 * BLOCK_SIZE]
