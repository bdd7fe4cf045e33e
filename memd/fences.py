"""Fenced pages: what a reclaimed worker may still write stays out of use until its process is gone.

A worker whose lease ended without a goodbye may still be in a forward pass
(`KvManager.reclaim` fences the pages that pass may write). Each fence is
lifted when the worker's process exits — a pidfd turns readable — or when
that process attaches again, which it does only once its last pass is over.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import structlog

from memd.manager import KvManager

log = structlog.get_logger("memd")


class FenceWatch:
    def __init__(self, manager: KvManager, persist: Callable[[], None]) -> None:
        self.manager, self.persist = manager, persist
        self._pidfds: dict[int, int] = {}

    def watch(self) -> None:
        """Lift each pid's fence when its process exits; at once if it is gone already."""
        loop = asyncio.get_running_loop()
        for pid in list(self.manager.fences):
            if pid in self._pidfds:
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                self.lift(pid, "its process is gone")
                continue
            except OSError as exc:        # no pidfd here: the fence lasts until the worker attaches again
                log.warning("cannot watch a fenced worker's process", pid=pid, error=exc.strerror)
                self._pidfds[pid] = -1
                continue
            self._pidfds[pid] = pidfd
            loop.add_reader(pidfd, self.lift, pid, "its process exited")
            log.info("pages fenced until the worker's process exits or attaches again", pid=pid,
                     blocks=len(self.manager.fences[pid]))

    def lift(self, pid: int, why: str) -> None:
        self._unwatch(pid)
        freed = self.manager.lift(pid)
        self.persist()
        log.info("fence lifted", pid=pid, reason=why, blocks_freed=freed)

    def attached(self, pid: int) -> None:
        """A process attached: if it was fenced, its last pass is over."""
        if pid in self.manager.fences:
            self.lift(pid, "it attached again: its last pass is over")

    def _unwatch(self, pid: int) -> None:
        pidfd = self._pidfds.pop(pid, None)
        if pidfd is not None and pidfd >= 0:
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)

    def close(self) -> None:
        for pid in list(self._pidfds):
            self._unwatch(pid)
