"""memd.host_pages: which pages a shm pool gets, read from the mounts as the kernel has them."""

from __future__ import annotations

from pathlib import Path

import pytest

from memd import host_pages

MOUNTS = """\
22 1 0:21 / / rw,relatime - ext4 /dev/vda1 rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684092k
42 25 0:39 / /dev/shm/kvpool-memd rw,relatime - tmpfs tmpfs rw,size=12582912k,huge=within_size
43 25 0:40 / /dev/shm/kvpool-never rw,relatime - tmpfs tmpfs rw,huge=never
44 22 0:41 / /srv/state rw,relatime - ext4 /dev/vdb rw
"""


@pytest.fixture
def mounts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mountinfo").write_text(MOUNTS)
    (tmp_path / "shmem_enabled").write_text("always within_size advise [never] deny force\n")
    monkeypatch.setattr(host_pages, "MOUNTINFO", tmp_path / "mountinfo")
    monkeypatch.setattr(host_pages, "SHMEM_ENABLED", tmp_path / "shmem_enabled")
    return tmp_path


@pytest.mark.parametrize(("path", "huge"), [
    ("/dev/shm/kvpool-memd/pool", True),           # the innermost mount decides
    ("/dev/shm/kvpool-memd", True),
    ("/dev/shm/kvpool-memdx/pool", False),         # a sibling whose name starts alike is not inside it
    ("/dev/shm/other/pool", False),                # tmpfs without huge=: never
    ("/dev/shm/kvpool-never/pool", False),
    ("/srv/state/pool", False),                    # not tmpfs
])
def test_a_pool_file_gets_huge_pages_where_its_tmpfs_is_mounted_for_them(mounts, path, huge):
    assert host_pages.huge_pages(Path(path)) is huge


def test_a_memfd_follows_shmem_enabled_and_force_overrides_every_mount(mounts):
    assert host_pages.huge_pages(None) is False
    (mounts / "shmem_enabled").write_text("always [within_size] advise never deny force\n")
    assert host_pages.huge_pages(None) is True
    (mounts / "shmem_enabled").write_text("always within_size advise never deny [force]\n")
    assert host_pages.huge_pages(Path("/srv/state/pool")) is True


def test_unreadable_mounts_mean_small_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(host_pages, "MOUNTINFO", tmp_path / "absent")
    monkeypatch.setattr(host_pages, "SHMEM_ENABLED", tmp_path / "absent")
    assert host_pages.huge_pages(Path("/dev/shm/pool")) is False and host_pages.huge_pages(None) is False
