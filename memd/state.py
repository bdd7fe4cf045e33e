"""memd's state directory: pool file, swap file and journal, which outlive a memd crash.

A memd killed with kill -9 (or stopped and started again, as `systemctl
restart` does) finds its parked conversations where it left them: the pool
pages live in a file on tmpfs, not in memd, and a write-ahead journal of
msgpack records says which sequence holds which page. Nothing else is needed
to resume them; in particular no worker has to survive to hand the pool back,
and a memd restarted with nothing attached serves parked sessions at once.

The journal is physical: after every change memd appends the sequences it
changed (their block table, swap slots, committed length and the token ids
not yet written) or their removal, before any reply that lets a worker write
to a page. A record torn by a crash is ignored. On start-up the journal is
read back, the surviving sequences are checked against the pool, and a fresh
journal replaces the old one (a checkpoint); one also follows every few
thousand records, so the file stays about the size of the live state.

What comes back, and how:
- PARKED sequences keep their pages and resume with no recompute.
- SWAPPED ones keep their swap slots (the swap tier is a file too).
- RUNNING ones (their worker lost memd mid-request) are parked at their
  committed length, as a worker crash would park them, and marked
  interrupted: the client's retry of that turn replaces it (KvManager._retry_turn).
- A sequence whose pages memd was still filling (a swap-in or a fork's copy
  in flight), or whose pages or slots cannot be reopened (a new pool size, a
  cuda pool, a changed swap ratio), comes back DROPPED: its token ids stay, so
  a resume recomputes it and still answers the same.

fsync: the journal and the pool are on tmpfs by default, where a record
written is safe from a memd crash the moment write() returns, and fsync
guards only against losing the machine, which takes the pool's pages with
it. `--journal-fsync always` is there for a state directory on a disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import structlog

from memd.sequences import SeqState, Sequence, blocks_for

if TYPE_CHECKING:
    from memd.manager import KvManager

log = structlog.get_logger("memd.state")

FORMAT = "kvpool-journal"
VERSION = 1
CHECKPOINT_RECORDS = 20_000        # records appended before the journal is rewritten from the live state
TMPFS = {"tmpfs", "ramfs", "hugetlbfs"}


class StateError(RuntimeError):
    """The state directory cannot be used; memd refuses to start."""


@dataclass(slots=True, frozen=True)
class Layout:
    """What a pool file and swap file must match to be reopened: their sizes and what they hold."""

    backend: str
    num_blocks: int
    block_bytes: int
    swap_slots: int

    def header(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "backend": self.backend, "num_blocks": self.num_blocks,
                "block_bytes": self.block_bytes, "swap_slots": self.swap_slots, "pid": os.getpid(),
                "written_at": time.time(), "boot_id": boot_id()}


def boot_id() -> str:
    """This boot's id: pages kept on a disk across a reboot (or a power loss) are not trusted."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(slots=True)
class Recovered:
    """The journal of the memd before this one, read back."""

    header: dict[str, Any]
    records: dict[int, list[Any]]              # seq id -> its latest record
    fences: dict[int, list[int]] = field(default_factory=dict)    # pid -> pages fenced for it
    max_seq_id: int = 0
    torn: bool = False                          # the last record was cut short by the crash


@dataclass(slots=True)
class Restored:
    """What recovery made of the records; logged at start-up."""

    sequences: list[Sequence] = field(default_factory=list)
    fences: dict[int, list[int]] = field(default_factory=dict)    # pid -> pages its late writes may reach
    by_state: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)       # reason -> sequences that came back DROPPED
    discarded: int = 0                                          # records that made no sense


class StateDir:
    """The directory, held by one memd at a time (an flock on its lock file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pool = path / "pool"
        self.swap = path / "swap"
        self.journal = path / "journal"
        self.served = False             # memd became ready with it: from then on it holds sessions
        self._lock_fd: int | None = None

    def lock(self) -> None:
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StateError(f"cannot use the state directory {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StateError(f"the state directory {self.path} is in use by another memd (pid {holder}); "
                             "give each memd its own --state-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def forget(self) -> None:
        """Remove the directory this memd made and never served from (a start that failed)."""
        self.discard(None)
        with contextlib.suppress(OSError):
            (self.path / "lock").unlink()
            self.path.rmdir()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def filesystem(self) -> str:
        """The type of file system the directory is on (tmpfs keeps page writes off the disk)."""
        best, kind = "", "unknown"
        target = str(self.path.resolve())
        with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
        return kind

    def read(self) -> Recovered | None:
        """The previous journal, or None when there is none; StateError when it is not a journal."""
        try:
            data = self.journal.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"cannot read {self.journal}: {exc.strerror}") from None
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1 << 20))
        unpacker.feed(data)
        try:
            header = next(unpacker)
        except (StopIteration, ValueError, msgpack.UnpackException) as exc:
            raise StateError(f"{self.journal} does not start with a journal header ({exc or 'empty'})") from None
        if not isinstance(header, list) or len(header) != 2 or header[0] != "H" or not isinstance(header[1], dict) \
                or header[1].get("format") != FORMAT:
            raise StateError(f"{self.journal} is not a kvpool journal")
        if header[1].get("version") != VERSION:
            raise StateError(f"{self.journal} has journal version {header[1].get('version')}; "
                             f"this memd reads version {VERSION}")
        found = Recovered(header[1], {})
        tokens: dict[int, list[int]] = {}
        end = unpacker.tell()               # of the last whole record
        try:
            for record in unpacker:
                _replay(record, found, tokens)
                end = unpacker.tell()
        except Exception:        # a garbled record, of any shape: what came before it stands
            pass
        found.torn = end < len(data)        # a record cut short or garbled: what came before it stands
        for seq_id, record in found.records.items():
            record[TOKENS] = tokens.get(seq_id, [])
        return found

    def discard(self, reason: str | None) -> None:
        """Remove a pool, swap file and journal that cannot be reused (logged with a reason: sessions are lost)."""
        present = [p.name for p in (self.pool, self.swap, self.journal) if p.exists()]
        if not present:
            return
        for p in (self.pool, self.swap, self.journal):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        if reason is not None:
            log.warning("discarded the state of an earlier memd", state_dir=str(self.path), files=present,
                        reason=reason)


# A sequence record: ["S", seq_id, state, model, block_size, session_id, num_committed, block_ids, slots,
#                     heat, heat_at, last_access, tokens_from, new_token_ids, pending, turn_start, mid_turn]
#   (then owner_pid: the pid of the worker running it, 0 if none; then turn_id, absent from older journals)
# A removal: ["D", seq_id]
# Fenced pages (KvManager.fences): ["F", pid, block_ids], [] once lifted
SEQ_ID, STATE, MODEL, BLOCK_SIZE, SESSION, COMMITTED, BLOCKS, SLOTS, HEAT, HEAT_AT, LAST_ACCESS, TOKENS_FROM, \
    TOKENS, PENDING, TURN_START, MID_TURN, OWNER_PID, TURN_ID = range(1, 19)


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
    if kind != "S" or len(record) not in (OWNER_PID + 1, TURN_ID + 1):
        raise ValueError(f"unknown record {kind!r}")
    have = tokens.setdefault(seq_id, [])
    start = int(record[TOKENS_FROM])
    if start > len(have):
        raise ValueError(f"sequence {seq_id}: tokens from {start}, {len(have)} known")
    del have[start:]
    have.extend(record[TOKENS])
    record[TOKENS] = None
    found.records[seq_id] = record


class WriteAheadLog:
    """The journal being written: one append per flush, all changed sequences in it."""

    def __init__(self, state: StateDir, layout: Layout, *, fsync: bool) -> None:
        self.state, self.layout, self.fsync = state, layout, fsync
        self._fd: int | None = None
        self._tokens_written: dict[int, int] = {}
        self.records = 0                     # appended since the last checkpoint

    def checkpoint(self, manager: KvManager) -> None:
        """Rewrite the journal from the live state: a new file, renamed over the old one."""
        tmp = self.state.journal.with_name("journal.new")
        parts = [_pack(["H", self.layout.header()])]
        self._tokens_written = {}
        for seq in manager.seqs.values():
            parts.append(self._seq_record(seq, manager))
        parts += [_pack(["F", pid, blocks]) for pid, blocks in manager.fences.items()]
        manager.fences_changed.clear()
        data = b"".join(parts)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, data)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        os.replace(tmp, self.state.journal)
        if self.fsync:
            dir_fd = os.open(self.state.path, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        if self._fd is not None:
            os.close(self._fd)
        os.lseek(fd, 0, os.SEEK_END)
        self._fd = fd
        self.records = 0
        manager.changed.clear()
        manager.retokened.clear()

    def flush(self, manager: KvManager) -> None:
        """Append the sequences changed since the last flush; call before replying to whoever changed them."""
        changed = manager.changed
        if self._fd is None:
            changed.clear()                  # persistence given up (a write failed): nothing to record
            manager.fences_changed.clear()
            return
        if not changed and not manager.fences_changed:
            return
        parts = [_pack(["F", pid, manager.fences.get(pid, [])]) for pid in manager.fences_changed]
        manager.fences_changed.clear()
        for seq_id in changed:
            seq = manager.seqs.get(seq_id)
            if seq is None:
                if self._tokens_written.pop(seq_id, None) is not None:
                    parts.append(_pack(["D", seq_id]))
            else:
                parts.append(self._seq_record(seq, manager))
        changed.clear()
        manager.retokened.clear()
        if not parts:
            return
        data = b"".join(parts)
        try:
            _write_all(self._fd, data)
            if self.fsync:
                os.fsync(self._fd)
            self.records += len(parts)
            if self.records > max(CHECKPOINT_RECORDS, 4 * len(manager.seqs)):
                self.checkpoint(manager)
        except OSError as exc:
            self.give_up(exc)

    def give_up(self, exc: OSError) -> None:
        """A write failed (a full tmpfs, say): remove the journal, which no longer tells the truth, and go on.

        memd keeps serving from memory; a memd started after it finds pool files
        without a journal and starts empty, rather than trusting a stale record.
        """
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            self.state.journal.unlink()
        log.error("cannot write the journal: memd goes on, but its sessions will not survive it",
                  journal=str(self.state.journal), error=exc.strerror or str(exc))

    def _seq_record(self, seq: Sequence, manager: KvManager) -> bytes:
        start = self._tokens_written.get(seq.seq_id, 0)
        if start > len(seq.token_ids) or seq.seq_id in manager.retokened:
            start = 0                        # cut back (a retried turn): rewrite them all
        self._tokens_written[seq.seq_id] = len(seq.token_ids)
        return _pack(["S", seq.seq_id, seq.state.value, seq.model, seq.block_size, seq.session_id,
                      seq.num_committed, seq.block_ids, seq.slots, seq.heat, seq.heat_at, seq.last_access,
                      start, seq.token_ids[start:], seq.seq_id in manager.pending, seq.turn_start,
                      seq.interrupted or seq.state is SeqState.RUNNING or seq.preempted_by is not None,
                      _owner_pid(seq, manager), seq.turn_id])

    def close(self) -> None:
        if self._fd is not None:
            if self.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


def restore(found: Recovered, *, pool_kept: bool, swap_kept: bool, num_blocks: int, num_slots: int) -> Restored:
    """Sequences to adopt from the records: checked, RUNNING ones parked, unusable ones DROPPED.

    Never trusts a record: a block or slot out of range, a slot claimed twice,
    a table that does not fit the committed length all demote the sequence to
    DROPPED (token ids only), and a record that makes no sense is skipped.
    """
    out = Restored()
    slots_taken: set[int] = set()
    sessions: dict[str, Sequence] = {}
    full_blocks: set[int] = set()       # shareable: full committed blocks of some sequence
    writable_blocks: set[int] = set()   # a sequence's partial last block: its own
    late: dict[int, list[int]] = {pid: list(blocks) for pid, blocks in found.fences.items()} if pool_kept else {}

    def drop(seq: Sequence, reason: str) -> None:
        seq.state, seq.block_ids, seq.slots, seq.num_committed = SeqState.DROPPED, [], [], 0
        out.dropped[reason] = out.dropped.get(reason, 0) + 1

    for seq_id in sorted(found.records):
        r = found.records[seq_id]
        try:
            seq = Sequence(seq_id, str(r[MODEL]), int(r[BLOCK_SIZE]), None, SeqState(r[STATE]),
                           [int(b) for b in r[BLOCKS]], int(r[COMMITTED]), [int(t) for t in r[TOKENS]],
                           session_id=r[SESSION] or None, last_access=float(r[LAST_ACCESS]),
                           heat=float(r[HEAT]), heat_at=float(r[HEAT_AT]), slots=[int(s) for s in r[SLOTS]],
                           turn_start=int(r[TURN_START]), interrupted=bool(r[MID_TURN]),
                           turn_id=r[TURN_ID] if len(r) > TURN_ID else "")
            if not isinstance(r[MODEL], str) or not isinstance(r[SESSION], str | None) \
                    or not isinstance(seq.turn_id, str):
                raise TypeError("model, session and turn id must be strings")
        except Exception:        # any record that makes no sense is skipped
            out.discarded += 1
            continue
        if seq.block_size <= 0 or not 0 <= seq.num_committed <= len(seq.token_ids) \
                or not 0 <= seq.turn_start <= len(seq.token_ids) \
                or any(not 0 <= t < 2**32 for t in seq.token_ids):
            out.discarded += 1
            continue
        needed = blocks_for(seq.num_committed, seq.block_size)
        owner_pid = int(r[OWNER_PID]) if seq.state is SeqState.RUNNING else 0
        if seq.interrupted and seq.session_id is None:
            if owner_pid > 0 and pool_kept:   # only its worker knew it; what that worker may still write is fenced
                late.setdefault(owner_pid, []).extend(seq.block_ids[seq.num_full_blocks:])
            continue
        if seq.state is SeqState.RUNNING:
            if owner_pid > 0 and pool_kept:       # as KvManager.reclaim fences: its whole blocks stay
                seq.num_committed -= seq.num_committed % seq.block_size
                needed = seq.num_full_blocks
                late.setdefault(owner_pid, []).extend(seq.block_ids[needed:])
            seq.state, seq.block_ids = SeqState.PARKED, seq.block_ids[:needed]
        if seq.state is not SeqState.SWAPPED:
            seq.slots = []
        if r[PENDING]:
            drop(seq, "pages being filled when memd stopped")
        elif seq.state is SeqState.PARKED:
            if not pool_kept:
                drop(seq, "pool not reopened")
            elif len(seq.block_ids) != needed or len(set(seq.block_ids)) != needed \
                    or any(not 0 <= b < num_blocks for b in seq.block_ids):
                drop(seq, "block table does not fit the pool")
            else:
                full = seq.block_ids[:seq.num_full_blocks]
                tail = set(seq.block_ids[seq.num_full_blocks:])
                if writable_blocks.intersection(full) or not tail.isdisjoint(full_blocks | writable_blocks):
                    drop(seq, "block table clashes with another sequence's")
                else:
                    full_blocks.update(full)
                    writable_blocks.update(tail)
        elif seq.state is SeqState.SWAPPED:
            if not swap_kept:
                drop(seq, "swap tier not reopened")
            elif len(seq.slots) != needed or any(not 0 <= s < num_slots or s in slots_taken for s in seq.slots) \
                    or len(set(seq.slots)) != needed or seq.block_ids:
                drop(seq, "swap slots do not fit the swap tier")
            else:
                slots_taken.update(seq.slots)
        elif seq.state is SeqState.DROPPED:
            seq.block_ids, seq.slots, seq.num_committed = [], [], 0
        if seq.session_id:
            earlier = sessions.get(seq.session_id)
            if earlier is not None:            # cannot happen; keep the newer sequence
                out.sequences.remove(earlier)
                out.discarded += 1
            sessions[seq.session_id] = seq
        out.sequences.append(seq)
    for seq in out.sequences:
        out.by_state[seq.state.value] = out.by_state.get(seq.state.value, 0) + 1
    held = {b for seq in out.sequences for b in seq.block_ids}
    for pid, blocks in late.items():       # pages a worker alive before may still write: fenced again
        fenced = [b for b in dict.fromkeys(blocks) if 0 <= b < num_blocks and b not in held]
        held.update(fenced)
        if fenced:
            out.fences[pid] = fenced
    return out


def _owner_pid(seq: Sequence, manager: KvManager) -> int:
    worker = manager.workers.get(seq.owner) if seq.owner is not None else None
    return worker.pid if worker is not None else 0


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
