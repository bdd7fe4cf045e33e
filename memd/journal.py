"""The journal: memd's write-ahead log on disk, which outlives a memd crash.

The journal is physical: after every change memd appends the sequences it
changed (their block table, swap slots, committed length and the token ids not
yet written) or their removal, before any reply that lets a worker write to a
page. A record carries the block table from its first entry the journal does
not hold yet: the leading full pages are written once, and again from the
first whose checksum was set since (`_Held`). A whole table in every record
would make a decode Step's journaling grow with its sequences' contexts.
A record torn by a crash is ignored. On start-up the journal is read back
(`read_journal`; `memd.recovery` decides what to trust), and memd goes on
appending to it once it has said what recovery decided (`resume`; a fresh
journal, a checkpoint, where it describes another pool). Every few thousand records the journal is
rewritten from the live state, so the file stays about the size of the live
state: a few hundred sequences per flush, beside the flushes' own records, so
that no Step waits for all of them (their cost grows with their number); the old
journal stays whole until the new one replaces it. A rewrite that cannot be
written is abandoned, not the journal: memd goes on appending to the old one
and tries again after as many records once more.

(Not to be confused with a Step's undo log, `memd.pool.UndoLog`, which lives
in memory for the length of one Step.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import structlog

from memd.pool import picked
from memd.sequences import SeqState, Sequence

if TYPE_CHECKING:
    from memd.manager import Changes, KvManager

log = structlog.get_logger("memd.journal")

FORMAT = "kvpool-journal"
VERSION = 2
READS = (1, 2)        # version 1: every record carries its whole block table; 2 carries where its part starts
CHECKPOINT_RECORDS = 20_000        # records appended before the journal is rewritten from the live state
REWRITE_CHUNK = 256                # sequences a flush copies into the journal being rewritten, at most,
REWRITE_CHUNK_TOKENS = 32_768      # and their token ids: a record holds a sequence's whole history


@dataclass(slots=True)
class Recovered:
    """The journal of the memd before this one, read back."""

    header: dict[str, Any]
    records: dict[int, list[Any]]              # seq id -> its latest record
    fences: dict[int, list[int]] = field(default_factory=dict)    # pid -> pages fenced for it
    max_seq_id: int = 0                         # the highest sequence id it handed out: none is handed out again
    torn: bool = False                          # the last record was cut short by the crash
    end: int = 0                                # where its last whole record ends


def read_journal(path: Path) -> Recovered | None:
    """The journal at `path`, or None when there is none; ValueError (one line) when it is not a journal."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1 << 20))
    unpacker.feed(data)
    try:
        header = next(unpacker)
    except (StopIteration, ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"{path} does not start with a journal header ({exc or 'empty'})") from None
    if not isinstance(header, list) or len(header) != 2 or header[0] != "H" or not isinstance(header[1], dict) \
            or header[1].get("format") != FORMAT:
        raise ValueError(f"{path} is not a kvpool journal")
    if header[1].get("version") not in READS:
        raise ValueError(f"{path} has journal version {header[1].get('version')}; "
                         f"this memd reads versions {', '.join(map(str, READS))}")
    mark = header[1].get("max_seq_id")
    found = Recovered(header[1], {}, max_seq_id=mark if isinstance(mark, int) and mark > 0 else 0)
    tokens: dict[int, list[int]] = {}
    end = unpacker.tell()               # of the last whole record
    try:
        for record in unpacker:
            _replay(record, found, tokens)
            end = unpacker.tell()
    except Exception:        # a garbled record, of any shape: what came before it stands
        pass
    found.torn, found.end = end < len(data), end      # a record cut short or garbled: what came before it stands
    for seq_id, record in found.records.items():
        record[TOKENS] = tokens.get(seq_id, [])
    return found


# A sequence record: ["S", seq_id, state, model, block_size, session_id, num_committed, block_ids, slots,
#                     heat, heat_at, last_access, tokens_from, new_token_ids, pending, turn_start, mid_turn]
#   (then owner_pid: the pid of the worker running it, 0 if none; then turn_id, the checksums of its swap
#    slots in slot order (SWAPPED; else empty), its pages' checksums in table order (0: unknown), and
#    blocks_from: the index in the table of the first block_ids entry and page checksum the record carries,
#    the ones before it being those of the sequence's record before; then salt, its cache salt ("" for none),
#    tenant ("" for none), and retain_until, the wall-clock time its retention ends (0: none); each absent
#    from older journals)
# A removal: ["D", seq_id]; also of an id never recorded (a sequence opened and freed between two flushes),
#   to carry the highest id handed out, which the header holds as of the journal's start (max_seq_id)
# Fenced pages (KvManager.fences): ["F", pid, block_ids], [] once lifted
SEQ_ID, STATE, MODEL, BLOCK_SIZE, SESSION, COMMITTED, BLOCKS, SLOTS, HEAT, HEAT_AT, LAST_ACCESS, TOKENS_FROM, \
    TOKENS, PENDING, TURN_START, MID_TURN, OWNER_PID, TURN_ID, SLOT_SUMS, BLOCK_SUMS, BLOCKS_FROM, SALT, TENANT, \
    RETAIN_UNTIL = range(1, 25)


def _replay(record: Any, found: Recovered, tokens: dict[int, list[int]]) -> None:
    if record[0] == "F":
        pid, blocks = int(record[1]), [int(b) for b in record[2]]
        if blocks:
            found.fences[pid] = blocks
        else:
            found.fences.pop(pid, None)
        return
    kind, seq_id = record[0], int(record[1])
    found.max_seq_id = max(found.max_seq_id, seq_id)
    if kind == "D":
        found.records.pop(seq_id, None)
        tokens.pop(seq_id, None)
        return
    if kind != "S" or len(record) not in (OWNER_PID + 1, TURN_ID + 1, SLOT_SUMS + 1, BLOCK_SUMS + 1,
                                          BLOCKS_FROM + 1, SALT + 1, TENANT + 1, RETAIN_UNTIL + 1):
        raise ValueError(f"unknown record {kind!r}")
    if len(record) > BLOCKS_FROM:
        _whole_table(record, found.records.get(seq_id))
    have = tokens.setdefault(seq_id, [])
    start = int(record[TOKENS_FROM])
    if start > len(have):
        raise ValueError(f"sequence {seq_id}: tokens from {start}, {len(have)} known")
    del have[start:]
    have.extend(record[TOKENS])
    record[TOKENS] = None
    found.records[seq_id] = record


def _whole_table(record: list[Any], before: list[Any] | None) -> None:
    """The record's block table and page checksums made whole from the sequence's record before: in place,
    its lists taking the earlier record's (which this record replaces), so that replaying one costs what it
    carries, not its sequence's context."""
    start = int(record[BLOCKS_FROM])
    record[BLOCKS_FROM] = 0
    if not start:
        return
    if before is None or len(before) <= BLOCK_SUMS or min(len(before[BLOCKS]), len(before[BLOCK_SUMS])) < start \
            or len(record[BLOCKS]) != len(record[BLOCK_SUMS]):
        raise ValueError(f"sequence {record[SEQ_ID]}: block table from {start}, no record before holds that")
    blocks, sums = before[BLOCKS], before[BLOCK_SUMS]
    del blocks[start:], sums[start:]
    blocks.extend(record[BLOCKS])
    sums.extend(record[BLOCK_SUMS])
    record[BLOCKS], record[BLOCK_SUMS] = blocks, sums


@dataclass(slots=True)
class _Held:
    """What one journal file holds of each sequence: its first `tokens[seq_id]` token ids, and the leading
    entries of its block table `settled[seq_id]` (only where there are some): its full pages, with their
    checksums as they were then (0 where none was known yet). The file needs those entries again only when the
    table no longer starts with them (cut back, or its pages replaced), or from the first whose checksum was
    set since (`Changes.sums_from`). A page shared with another sequence may get its checksum from that
    sequence's op: that sequence's record carries it, and recovery takes a page's checksum from any record."""

    tokens: dict[int, int] = field(default_factory=dict)
    settled: dict[int, list[int]] = field(default_factory=dict)

    def forget(self, seq_id: int) -> bool:
        """The sequence is gone; whether the file holds a record of it."""
        self.settled.pop(seq_id, None)
        return self.tokens.pop(seq_id, None) is not None


@dataclass(slots=True)
class _Rewrite:
    """A journal being rewritten from the live state beside the one in use (`journal.new`)."""

    fd: int
    pending: dict[int, None]                   # sequences not copied in yet (ordered, and to look up)
    held: _Held = field(default_factory=_Held)
    records: int = 0


class JournalPlace(Protocol):
    """Where the journal lives (memd.state_dir.StateDir): its directory and its file."""

    @property
    def path(self) -> Path: ...

    @property
    def journal(self) -> Path: ...


class JournalHeader(Protocol):
    """What the journal's first record says of the pool it describes (memd.state_dir.Layout)."""

    def header(self) -> dict[str, Any]: ...


class WriteAheadLog:
    """The journal being written: one append per flush, all changed sequences in it."""

    def __init__(self, state: JournalPlace, layout: JournalHeader, *, fsync: bool) -> None:
        self.state, self.layout, self.fsync = state, layout, fsync
        self._fd: int | None = None
        self._held = _Held()
        self.records = 0                     # appended since the last checkpoint
        self._rewrite: _Rewrite | None = None
        self._rewrite_deferred = 0           # records before the next rewrite begins, past the usual threshold
        self._rewrite_failing = False        # the last rewrite failed (warned once, until one completes)
        self._max_seq_id = 0                 # the highest sequence id the journal names (header or records)

    def checkpoint(self, manager: KvManager) -> None:
        """Rewrite the journal from the live state at once: a new file, renamed over the old one."""
        self._abandon_rewrite()
        tmp = self._new_path()
        parts = [self._header(manager)]
        self._held, self._max_seq_id = _Held(), manager.max_seq_id
        manager.take_changes()               # all of it is in the checkpoint
        for seq in manager.seqs.values():
            parts.append(self._seq_record(seq, manager))
        parts += [_pack(["F", pid, blocks]) for pid, blocks in manager.fences.items()]
        fd = self._written(tmp, os.O_CREAT | os.O_TRUNC, parts)
        os.replace(tmp, self.state.journal)
        if self.fsync:
            self._fsync_dir()
        self._use(fd)
        self.records = self._rewrite_deferred = 0

    def resume(self, manager: KvManager, found: Recovered, changed: Collection[int]) -> None:
        """Go on appending to the journal the memd before wrote, which `manager` adopted: serving starts without
        rewriting it whole first (2-3 s at 100k parked sessions), and it is rewritten in chunks from the first
        flushes on, as every journal is once it holds enough records.

        Appended first, what recovery decided: the sequences it kept otherwise than their records (`changed`:
        parked, dropped), a removal of each it did not keep, the fences as they are now. A torn last record is
        cut off, so that what follows it can be read. The file holds no sequence's record as this memd wrote
        it: a sequence's next record carries it whole.
        """
        self._abandon_rewrite()
        path = self.state.journal
        if found.torn:
            os.truncate(path, found.end)
        self._held, self._max_seq_id = _Held(), max(found.max_seq_id, manager.max_seq_id)
        manager.take_changes()
        parts = [_pack(["D", seq_id]) for seq_id in found.records if seq_id not in manager.seqs]
        parts += [self._seq_record(manager.seqs[seq_id], manager) for seq_id in changed if seq_id in manager.seqs]
        parts += [_pack(["F", pid, []]) for pid in found.fences if pid not in manager.fences]
        parts += [_pack(["F", pid, blocks]) for pid, blocks in manager.fences.items()]
        self._use(self._written(path, os.O_APPEND, parts))
        self.records, self._rewrite_deferred = _rewrite_after(manager) + 1, 0      # rewritten from the next flush

    def _written(self, path: Path, flags: int, parts: list[bytes]) -> int:
        """`path` opened for writing (with `flags`) and `parts` written to it, synced if the journal is: its fd,
        positioned at its end. Nothing is left open if it fails."""
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | flags, 0o600)
        try:
            _write_all(fd, b"".join(parts))
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _use(self, fd: int) -> None:
        """Append to `fd` from now on."""
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd

    def flush(self, manager: KvManager) -> None:
        """Append the sequences changed since the last flush; call before replying to whoever changed them."""
        changes = manager.take_changes()
        if self._fd is None:
            return                           # persistence given up (a write failed): nothing to record
        parts = self._change_records(manager, changes, self._held)
        mark = self._seq_id_mark(manager)
        parts += mark
        try:
            if parts:
                _write_all(self._fd, b"".join(parts))
                if self.fsync:
                    os.fsync(self._fd)
                self.records += len(parts)
        except OSError as exc:
            self.give_up(exc)
            return
        # The journal in use is whole: a rewrite that fails costs the rewrite, not the journal.
        try:
            if self._rewrite is not None:
                self._advance_rewrite(manager, changes, mark)
            elif self.records > _rewrite_after(manager) + self._rewrite_deferred:
                self._start_rewrite(manager)
        except OSError as exc:
            self._rewrite_failed(exc)

    def _change_records(self, manager: KvManager, changes: Changes, held: _Held,
                        later: Collection[int] = ()) -> list[bytes]:
        """Records of what changed, for the file that holds `held` of each sequence; none for those it copies
        `later` as they are then."""
        parts = [_pack(["F", pid, manager.fences.get(pid, [])]) for pid in changes.fence_pids]
        for seq_id in changes.seq_ids:
            if seq_id in later:
                continue
            seq = manager.seqs.get(seq_id)
            if seq is None:
                if held.forget(seq_id):
                    parts.append(_pack(["D", seq_id]))
            else:
                parts.append(self._seq_record(seq, manager, tokens_cut=seq_id in changes.tokens_cut,
                                              sums_from=changes.sums_from.get(seq_id),
                                              held=held))
        return parts

    def _header(self, manager: KvManager) -> bytes:
        return _pack(["H", {**self.layout.header(), "max_seq_id": manager.max_seq_id}])

    def _seq_id_mark(self, manager: KvManager) -> list[bytes]:
        """A removal of the highest sequence id handed out, when no record names it: one opened and freed
        since the last flush (or numbered by a Step that was refused) would otherwise be handed out again
        after a restart. A live one's own record names it: it is new since the last flush, so its record is in
        this one. The journal being rewritten gets the same removal: its header named the ids up to its start."""
        issued = manager.max_seq_id
        if issued <= self._max_seq_id:
            return []
        self._max_seq_id = issued
        return [] if issued in manager.seqs else [_pack(["D", issued])]

    def _new_path(self) -> Path:
        return self.state.journal.with_name("journal.new")

    def _start_rewrite(self, manager: KvManager) -> None:
        fd = os.open(self._new_path(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._rewrite = _Rewrite(fd, dict.fromkeys(manager.seqs))
        parts = [self._header(manager)] + [_pack(["F", pid, blocks]) for pid, blocks in manager.fences.items()]
        _write_all(fd, b"".join(parts))

    def _advance_rewrite(self, manager: KvManager, changes: Changes, mark: list[bytes]) -> None:
        """This flush's changes, then the next chunk of sequences, into the new journal; in time order, so the
        last record of a sequence there is its latest. Once every sequence is in, the new journal takes over.

        A chunk is at most REWRITE_CHUNK sequences and REWRITE_CHUNK_TOKENS of their token ids (one sequence
        longer than that goes alone): a record carries its sequence's whole history, so a flush's cost grows
        with the token ids it copies, and a count of sequences alone does not bound it. A sequence not copied
        yet gets no record of its changes meanwhile: its copy, when its turn comes, is its state then; written whole
        at its first change, the chats decoding at every Step went into one flush after all.
        """
        rewrite = self._rewrite
        assert rewrite is not None
        parts = self._change_records(manager, changes, rewrite.held, later=rewrite.pending.keys()) + mark
        count, tokens = 0, 0
        while rewrite.pending and count < REWRITE_CHUNK and tokens < REWRITE_CHUNK_TOKENS:
            seq_id, _ = rewrite.pending.popitem()
            if (seq := manager.seqs.get(seq_id)) is not None:
                parts.append(self._seq_record(seq, manager, held=rewrite.held))
                count, tokens = count + 1, tokens + len(seq.token_ids)
        if parts:
            _write_all(rewrite.fd, b"".join(parts))
            rewrite.records += len(parts)
        if not rewrite.pending:
            self._finish_rewrite()

    def _finish_rewrite(self) -> None:
        rewrite = self._rewrite
        assert rewrite is not None and self._fd is not None
        if self.fsync:
            os.fsync(rewrite.fd)
        os.replace(self._new_path(), self.state.journal)
        # From here the new journal is the one in use, and a failure is the journal's own.
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd, self._held, self.records = rewrite.fd, rewrite.held, rewrite.records
        self._rewrite, self._rewrite_deferred = None, 0
        if self._rewrite_failing:
            self._rewrite_failing = False
            log.info("the journal was rewritten again", journal=str(self.state.journal))
        if self.fsync:
            try:
                self._fsync_dir()
            except OSError as exc:
                self.give_up(exc)

    def _rewrite_failed(self, exc: OSError) -> None:
        """journal.new could not be written: drop it, keep the journal in use (whole: a restart reads it),
        and try again once as many records more have been appended."""
        self._abandon_rewrite()
        self._rewrite_deferred = self.records
        if not self._rewrite_failing:
            self._rewrite_failing = True
            log.warning("cannot rewrite the journal: memd goes on appending to it and tries again later",
                        journal=str(self.state.journal), error=exc.strerror or str(exc))

    def _abandon_rewrite(self) -> None:
        """Close and remove journal.new: also one a rewrite could not open, or a memd before this one left."""
        if self._rewrite is not None:
            with contextlib.suppress(OSError):
                os.close(self._rewrite.fd)
            self._rewrite = None
        with contextlib.suppress(OSError):
            self._new_path().unlink()

    def _fsync_dir(self) -> None:
        dir_fd = os.open(self.state.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def give_up(self, exc: OSError) -> None:
        """A write failed (a full tmpfs, say): remove the journal, which no longer tells the truth, and go on.

        memd keeps serving from memory; a memd started after it finds pool files
        without a journal and starts empty, rather than trusting a stale record.
        """
        self._abandon_rewrite()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            self.state.journal.unlink()
        log.error("cannot write the journal: memd goes on, but its sessions will not survive it",
                  journal=str(self.state.journal), error=exc.strerror or str(exc))

    def _seq_record(self, seq: Sequence, manager: KvManager, *, tokens_cut: bool = False,
                    sums_from: int | None = None, held: _Held | None = None) -> bytes:
        """The record of `seq` for the file that holds `held` of it (default: the journal in use): the token ids
        and block table entries the file lacks, the table from entry `sums_from` on (its checksums set since),
        and the rest of the sequence whole."""
        held = self._held if held is None else held
        seq_id, blocks = seq.seq_id, seq.block_ids
        start = held.tokens.get(seq_id, 0)
        if start > len(seq.token_ids) or tokens_cut:
            start = 0                        # cut back (a retried turn): rewrite them all
        held.tokens[seq_id] = len(seq.token_ids)
        # Full pages only: the partly filled last one's checksum (taken when it parks) goes once it resumes.
        full = min(seq.num_full_blocks, len(blocks))
        first, settled = 0, held.settled.get(seq_id)
        if settled is not None and not tokens_cut and blocks[:len(settled)] == settled:   # compared in C
            first = min(len(settled), full) if sums_from is None else min(len(settled), full, sums_from)
            del settled[first:]
            settled += blocks[first:full]
        elif full:
            held.settled[seq_id] = blocks[:full]
        else:
            held.settled.pop(seq_id, None)
        carried = blocks[first:]
        return _pack(["S", seq.seq_id, seq.state.value, seq.model, seq.block_size, seq.session_id,
                      seq.num_committed, carried, seq.slots, seq.heat, seq.heat_at, seq.last_access,
                      start, seq.token_ids[start:].tolist(), manager.filling(seq.seq_id), seq.turn_start,
                      seq.interrupted or seq.state is SeqState.RUNNING or seq.preempted_by is not None,
                      _owner_pid(seq, manager), seq.turn_id,
                      picked(manager.swap.checksum, seq.slots) if manager.swap is not None else (),
                      picked(manager.pool.checksum, carried), first, seq.salt, seq.tenant, seq.retain_until])

    def close(self) -> None:
        self._abandon_rewrite()              # the journal in use is whole: a restart reads it
        if self._fd is not None:
            if self.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


def _rewrite_after(manager: KvManager) -> int:
    """Records appended before the journal is rewritten from the live state: it stays about that state's size."""
    return max(CHECKPOINT_RECORDS, 4 * len(manager.seqs))


def _owner_pid(seq: Sequence, manager: KvManager) -> int:
    worker = manager.workers.get(seq.owner) if seq.owner is not None else None
    return worker.pid if worker is not None else 0


_packer = msgpack.Packer(use_bin_type=True)     # the loop's alone; made once, not per record


def _pack(obj: Any) -> bytes:
    return _packer.pack(obj)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
