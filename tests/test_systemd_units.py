"""The shipped systemd units, checked by systemd's own `systemd-analyze verify`.

verify fails on a missing ExecStart binary but only warns on unknown keys or
bad values, so every line it prints counts as a failure here. ExecStart is
pointed at this checkout's installed scripts instead of /opt/kvpool/bin, where
the install in docs/operations.md ("Installing on a host") puts them.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "systemd"
ANALYZE = shutil.which("systemd-analyze")
INSTALLED = "/opt/kvpool"          # the virtual environment of the install in docs/operations.md
STATE_MOUNT = "dev-shm-kvpool\\x2dmemd.mount"    # memd's state directory on CPU, /dev/shm/kvpool-memd
pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (.ci/run installs it)")


def verify(unit_dir: Path, *names: str) -> str:
    """Everything systemd-analyze says about the units; empty when they are clean."""
    proc = subprocess.run([ANALYZE, "verify", "--man=no", *names], cwd=unit_dir, capture_output=True,  # type: ignore[list-item]
                          text=True, timeout=60)
    said = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0 and not said:
        said = f"exit code {proc.returncode}"
    return said


def installed(tmp_path: Path, edit: str = "") -> Path:
    """The units with ExecStart at this venv's scripts, plus `edit` appended to [Service] of memd."""
    bindir = Path(sys.executable).parent
    for unit in UNITS.glob("*.service"):
        text = unit.read_text().replace(f"{INSTALLED}/bin/", f"{bindir}/")
        if edit and unit.name == "memd.service":
            text = text.replace("[Service]\n", f"[Service]\n{edit}\n")
        (tmp_path / unit.name).write_text(text)
    return tmp_path


@pytest.mark.processes
def test_the_units_verify_without_a_single_warning(tmp_path):
    assert (Path(sys.executable).parent / "memd").exists(), "the package's scripts are not installed"
    assert verify(installed(tmp_path), "memd.service", "inferd@llama.service") == ""


@pytest.mark.processes
def test_the_cluster_store_unit_verifies_where_kvpool_cluster_is_installed(tmp_path):
    if not (Path(sys.executable).parent / "mooncake_master").exists():
        pytest.skip("kvpool[cluster] is not installed: no mooncake_master to run")
    assert verify(installed(tmp_path), "kvpool-store.service") == ""


@pytest.mark.processes
def test_the_router_unit_verifies(tmp_path):
    assert verify(installed(tmp_path), "kvroute.service") == ""


@pytest.mark.processes
def test_the_state_directory_mount_unit_verifies_and_is_named_for_its_path():
    assert verify(UNITS, STATE_MOUNT) == ""
    mount = configparser.ConfigParser(interpolation=None)
    mount.read(UNITS / STATE_MOUNT)
    escaped = subprocess.run(["systemd-escape", "-p", "--suffix=mount", mount["Mount"]["Where"]],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert escaped == STATE_MOUNT and mount["Mount"]["Where"] == "/dev/shm/kvpool-memd"


@pytest.mark.processes
async def test_the_state_directory_mount_gives_memd_huge_pages(memd_factory, tmp_path):
    """The unit's own mount options, on a directory of the test's (its user for kvpool): memd's pool and swap
    files come in 2 MiB pages, as the kernel counts them. Skipped where this user may not mount."""
    shmem = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    if any(f"[{setting}]" in (shmem.read_text() if shmem.exists() else "[deny]") for setting in ("force", "deny")):
        pytest.skip("this kernel decides every tmpfs's pages itself (shmem_enabled force or deny, or no THP)")
    mount = configparser.ConfigParser(interpolation=None)
    mount.read(UNITS / STATE_MOUNT)
    options = mount["Mount"]["Options"].replace("uid=kvpool", f"uid={os.getuid()}") \
        .replace("gid=kvpool", f"gid={os.getgid()}")
    where = tmp_path / "state"
    where.mkdir()
    done = subprocess.run(["mount", "-t", mount["Mount"]["Type"], "-o", options, mount["Mount"]["What"], str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        before = shmem_huge_pages_kib()
        memd = await memd_factory("--device", "cpu", "--pool-bytes", "64MiB", "--block-bytes", "64KiB",
                                  "--state-dir", str(where))
        ready = await memd.log.wait_for("memd ready")
        assert ready["pool_pages"] == "2 MiB"
        assert shmem_huge_pages_kib() - before >= 64 * 1024       # the whole pool, allocated before READY=1
        assert await memd.stop() == 0
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


def shmem_huge_pages_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("ShmemHugePages:"))


@pytest.mark.processes
def test_a_typo_in_a_unit_is_caught(tmp_path):
    # The check above is only worth something if a warning-level mistake fails it.
    assert "Unknown key" in verify(installed(tmp_path, "ProtectSytem=strict"), "memd.service")


def test_the_units_run_hardened_as_users_of_their_own():
    for unit, user in (("memd.service", "kvpool"), ("inferd@.service", "kvpool-worker")):
        lines = set((UNITS / unit).read_text().splitlines())
        for setting in ("Type=notify", f"User={user}", f"Group={user}", "NoNewPrivileges=yes", "ProtectSystem=strict",
                        "ProtectHome=yes", "PrivateTmp=yes", "CapabilityBoundingSet=", "UMask=0007"):
            assert setting in lines, f"{unit} lacks {setting}"
    assert "SupplementaryGroups=kvpool" in (UNITS / "inferd@.service").read_text().splitlines()
    memd = (UNITS / "memd.service").read_text()
    assert "LimitMEMLOCK=infinity" in memd and "RuntimeDirectory=memd" in memd


def settings(unit: str) -> dict[str, list[str]]:
    """Each key of a unit file with its values, in order (a key may repeat)."""
    found: dict[str, list[str]] = {}
    for line in (UNITS / unit).read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def test_a_memd_restart_leaves_the_workers_running():
    # BindsTo= or Requires= would stop or restart every worker with memd; inferd re-attaches by itself.
    inferd = settings("inferd@.service")
    assert inferd["Wants"] == ["memd.service"] and inferd["After"] == ["memd.service"]
    assert "BindsTo" not in inferd and "Requires" not in inferd and "PartOf" not in inferd


def test_each_setting_has_one_place_the_config_file():
    # A flag on ExecStart would silently beat the same key in the TOML file and hide from --print-config.
    for unit, config in (("memd.service", "/etc/kvpool/memd.toml"), ("inferd@.service", "/etc/kvpool/inferd-%i.toml")):
        exec_start, = settings(unit)["ExecStart"]
        assert exec_start.split()[-2:] == ["--config", config], unit
        assert all(not word.startswith("--") or word == "--config" for word in exec_start.split()), unit


def test_the_example_configs_meet_at_memds_socket_inside_its_runtime_directory():
    memd = tomllib.loads((UNITS / "memd.toml.example").read_text())
    inferd = tomllib.loads((UNITS / "inferd.toml.example").read_text())
    runtime, = settings("memd.service")["RuntimeDirectory"]
    assert memd["listen"] == inferd["memd"] == f"unix:/run/{runtime}/memd.sock"
    assert "listen" not in inferd            # the worker's socket is its unit's: $RUNTIME_DIRECTORY/inferd.sock


def test_the_units_run_what_the_install_installs():
    for unit in UNITS.glob("*.service"):
        unit_settings = settings(unit.name)
        assert unit_settings["ExecStart"][0].startswith(f"{INSTALLED}/bin/"), unit.name
        assert unit_settings["Documentation"] == [f"file://{INSTALLED}/share/doc/kvpool/README.md"], unit.name
    install = (ROOT / "docs" / "operations.md").read_text()        # "Installing on a host"
    assert f"python3 -m venv {INSTALLED}" in install
    assert f"install -Dm644 README.md {INSTALLED}/share/doc/kvpool/README.md" in install
    assert f"install -Dm644 -t {INSTALLED}/share/doc/kvpool/docs docs/*.md" in install   # README.md's links
