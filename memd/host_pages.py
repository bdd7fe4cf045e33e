"""Which pages the kernel backs a shm pool with: 4 KiB ones, or 2 MiB huge ones.

It decides start-up time. memd allocates every page of the pool before it
says READY=1 (a short host fails then, not under load), and tmpfs allocates
4 KiB pages one at a time: about 0.4 s per GiB on a VM, whatever the threads
(3.0-3.5 s for 8 GiB). A tmpfs mounted with huge=within_size (or always)
allocates 2 MiB pages, 512 times fewer: the same 8 GiB in ~0.02 s, and the
workers' reads of K/V miss the TLB less. memd reports which it got and, for a
large pool on small pages, how to get the other.
"""

from __future__ import annotations

import os
from pathlib import Path

HUGE_MODES = {"always", "within_size", "force"}
SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
MOUNTINFO = Path("/proc/self/mountinfo")


def huge_pages(path: Path | None) -> bool:
    """Whether a shm file at `path` (None: a memfd) is allocated in huge pages, as far as the mounts say."""
    forced = _selected(SHMEM_ENABLED)
    if forced == "force":
        return True
    if path is None:                       # a memfd lives on the kernel's own tmpfs: shmem_enabled decides
        return forced in HUGE_MODES
    mount = _mount_of(path)
    if mount is None or mount[0] != "tmpfs":
        return False
    huge = next((option.split("=", 1)[1] for option in mount[1].split(",") if option.startswith("huge=")), "never")
    return huge in HUGE_MODES


def _selected(setting: Path) -> str | None:
    """The [bracketed] choice of a sysfs setting, None where it cannot be read."""
    try:
        text = setting.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _mount_of(path: Path) -> tuple[str, str] | None:
    """(file system type, its super options) of the mount holding `path`: the longest mount point above it."""
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[int, str, str] | None = None
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        fstype, _source, options = line.split(" - ", 1)[1].split()[:3]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fstype, options)
    return None if best is None else (best[1], best[2])
