"""Where clients look for memd and inferd when the operator names no address."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from shared import address as addr


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A host with no address in the environment, an empty per-user runtime directory and `tmp/run` for /run."""
    for name in ("MEMD_ADDRESS", "INFERD_ADDRESS", "RUNTIME_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(addr, "SYSTEM_RUN", tmp_path / "run")
    return tmp_path


def listen(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    return sock


def test_without_a_unit_a_client_looks_at_the_per_user_socket(host: Path) -> None:
    assert addr.connect_target(None) == f"unix:{host}/user/kvpool/memd.sock"
    assert addr.connect_target(None, "inferd") == f"unix:{host}/user/kvpool/inferd.sock"


def test_with_memd_service_running_and_no_socket_of_ones_own_memctl_calls_the_unit(host: Path) -> None:
    (host / "run" / "memd").mkdir(parents=True)
    assert addr.connect_target(None) == f"unix:{host}/run/memd/memd.sock"
    with listen(host / "user" / "kvpool" / "memd.sock"):              # one's own memd comes first
        assert addr.connect_target(None) == f"unix:{host}/user/kvpool/memd.sock"


def test_a_named_address_is_never_replaced(host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (host / "run" / "memd").mkdir(parents=True)
    assert addr.connect_target("/srv/memd.sock") == "unix:/srv/memd.sock"
    monkeypatch.setenv("MEMD_ADDRESS", "10.0.0.5:7000")
    assert addr.connect_target(None) == "10.0.0.5:7000"


def test_inferctl_takes_the_unit_socket_only_when_one_worker_runs(host: Path) -> None:
    workers = host / "run" / "inferd"
    (workers / "llama").mkdir(parents=True)
    assert addr.connect_target(None, "inferd") == f"unix:{workers}/llama/inferd.sock"
    (workers / "qwen").mkdir()
    assert addr.connect_target(None, "inferd") == f"unix:{host}/user/kvpool/inferd.sock"


def test_a_daemon_without_listen_keeps_its_per_user_socket(host: Path) -> None:
    (host / "run" / "memd").mkdir(parents=True)
    assert addr.resolve(None) == f"unix:{host}/user/kvpool/memd.sock"


def test_not_reachable_is_one_sentence_with_the_way_out() -> None:
    details = ("failed to connect to all addresses; last error: FAILED_PRECONDITION: unix:/run/memd/memd.sock: "
               "connect failed: addr: unix:/run/memd/memd.sock error: Permission denied")
    assert addr.not_reachable("memd", "unix:/run/memd/memd.sock", details) == (
        "memd is not reachable at unix:/run/memd/memd.sock (permission denied): give --address or set MEMD_ADDRESS")
