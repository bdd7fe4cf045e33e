"""memd's state directory: pool file, swap file and journal, which outlive a memd crash.

A memd killed with kill -9 (or stopped and started again, as `systemctl
restart` does) finds its parked conversations where it left them: the pool
pages live in a file on tmpfs, not in memd, and a write-ahead journal of
msgpack records says which sequence holds which page. Nothing else is needed
to resume them; in particular no worker has to survive to hand the pool back,
and a memd restarted with nothing attached serves parked sessions at once.

The journal (`memd.journal`) is written there; on start-up `memd.recovery`
decides which of its sequences to trust.

fsync: the journal and the pool are on tmpfs by default, where a record
written is safe from a memd crash the moment write() returns, and fsync
guards only against losing the machine, which takes the pool's pages with
it. `--journal-fsync always` is there for a state directory on a disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from memd.journal import FORMAT, VERSION, Recovered, read_journal
from shared.pool_files import stripe_paths

log = structlog.get_logger("memd.state_dir")

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
            # The directory itself, never its parents: a typo in --state-dir must not become a directory tree.
            self.path.mkdir(mode=0o700, exist_ok=True)
            self._check_private()
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            raise StateError(f"cannot use the state directory {self.path}: its parent {self.path.parent} "
                             "does not exist") from None
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

    def _check_private(self) -> None:
        """Refuse a directory someone else could have made: in a shared place such as /dev/shm another user may
        take the name first, and whoever can write there can read and replace the pool's pages."""
        st = os.lstat(self.path)
        if not stat.S_ISDIR(st.st_mode):
            raise StateError(f"the state directory {self.path} is not a directory (a symbolic link?)")
        if st.st_uid != os.geteuid():
            raise StateError(f"the state directory {self.path} belongs to uid {st.st_uid}, not to memd's user "
                             f"(uid {os.geteuid()}): remove it, or give memd another --state-dir")
        if st.st_mode & 0o022:
            raise StateError(f"the state directory {self.path} may be written by others (mode "
                             f"{stat.S_IMODE(st.st_mode):o}): chmod go-w it, or give memd another --state-dir")

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
            return read_journal(self.journal)
        except ValueError as exc:
            raise StateError(str(exc)) from None

    def pool_files(self) -> list[Path]:
        """The pool's files there now: `pool`, and `pool.1` ... for a pool kept in several (shared.pool_files)."""
        more = [p for p in self.path.glob("pool.*") if p.name[5:].isdigit()]
        return [self.pool, *sorted(more, key=lambda p: int(p.name[5:]))]

    def keep_pool(self, sizes: list[int]) -> None:
        """Leave the pool's files only if they are what a pool kept in files of `sizes` bytes is (any more
        are removed): another layout's pages cannot be reopened, and they would hold memory meanwhile."""
        wanted = stripe_paths(self.pool, len(sizes))
        if [p.stat().st_size if p.exists() else None for p in wanted] != sizes:
            self.remove_pool()
            return
        for extra in set(self.pool_files()) - set(wanted):
            with contextlib.suppress(FileNotFoundError):
                extra.unlink()

    def made_new(self, what: str) -> Path:
        """The mark of `what` ("pool" or "swap") being made anew, there from before its files are made until
        the journal that describes them is written. A start that dies between the two leaves the journal
        before it beside new files of the right sizes, zeroed: the mark says they are not that journal's."""
        return self.path / f"{what}.new"

    def mark_new(self, what: str) -> None:
        try:
            self.made_new(what).touch(mode=0o600)
        except OSError as exc:
            raise StateError(f"cannot write in the state directory {self.path}: {exc.strerror}") from None

    def remove_new(self) -> None:
        """Remove the files a start that failed made anew (their marks stay): they hold memory and no pages
        anyone may resume, and the next start makes them again."""
        if self.made_new("pool").exists():
            self.remove_pool()
        if self.made_new("swap").exists():
            with contextlib.suppress(FileNotFoundError):
                self.swap.unlink()

    def unmark_new(self) -> None:
        """The journal now describes the files there (written after they were made)."""
        for what in ("pool", "swap"):
            with contextlib.suppress(FileNotFoundError):
                self.made_new(what).unlink()

    def remove_pool(self) -> None:
        for p in self.pool_files():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def discard(self, reason: str | None) -> None:
        """Remove a pool, swap file and journal that cannot be reused (logged with a reason: sessions are lost)."""
        files = [*self.pool_files(), self.swap, self.journal, self.made_new("pool"), self.made_new("swap")]
        present = [p.name for p in files if p.exists()]
        if not present:
            return
        for p in files:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        if reason is not None:
            log.warning("discarded the state of an earlier memd", state_dir=str(self.path), files=present,
                        reason=reason)
