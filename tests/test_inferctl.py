"""inferctl refuses bad input in one line, never with a traceback.

Every test calls inferctl's main in-process (no subprocess), so none is marked `processes`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import grpc
import pytest

from inferd import inferctl


def _no_connection(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("inferctl connected before refusing its command line")


BAD_FLAGS = [
    ("--max-tokens", "-3"),
    ("--max-tokens", "0"),
    ("--max-tokens", str(2**32)),
    ("--max-tokens", "1.5"),
    ("--max-tokens", "many"),
    ("--top-k", "-1"),
    ("--top-k", str(2**32)),
    ("--seed", "-1"),
    ("--seed", str(2**63)),
    ("--seed", str(2**64)),
    ("--temperature", "-0.1"),
    ("--temperature", "100.5"),
    ("--temperature", "nan"),
    ("--temperature", "inf"),
    ("--temperature", "warm"),
    ("--top-p", "0"),
    ("--top-p", "-0.5"),
    ("--top-p", "1.01"),
    ("--top-p", "nan"),
    ("--top-p", "1e-50"),           # float32 rounds it to 0, which inferd reads as 1.0
    ("--timeout", "0"),
    ("--timeout", "-1"),
    ("--timeout", "nan"),
    ("--timeout", "inf"),
    ("--timeout", "1e10"),          # past gRPC's int64-nanosecond deadline
    ("--stop", ""),
    ("--session", "s\udcff"),       # a command line that is not UTF-8
]


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(("flag", "value"), BAD_FLAGS, ids=[f"{f}={v!r}" for f, v in BAD_FLAGS])
def test_bad_flag_is_one_argparse_error(command: str, flag: str, value: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc.aio, "insecure_channel", _no_connection)
    argv = ["--address", "unix:/nonexistent/inferd.sock", command]
    argv += ["hello"] if command == "generate" else []
    with pytest.raises(SystemExit) as exc:
        inferctl.main([*argv, f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1                   # no usage block: the one line that matters, naming the flag
    assert lines[0].startswith(f"inferctl {command}: error: argument {flag}: ")


@pytest.mark.parametrize("argv", [
    ["--address", "unix:/tmp/\udcff.sock", "reset", "s"],
    ["--address", "unix:/tmp/a\0b.sock", "reset", "s"],
    ["--address", "unix:/nonexistent/inferd.sock", "generate", "caf\udce9"],
    ["--address", "unix:/nonexistent/inferd.sock", "reset", "s\udcff"],
], ids=["address-not-utf8", "address-nul", "prompt-not-utf8", "session-not-utf8"])
def test_bad_argument_is_one_argparse_error(argv: list[str], capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc.aio, "insecure_channel", _no_connection)
    with pytest.raises(SystemExit) as exc:
        inferctl.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert ": error: argument " in err.strip().splitlines()[-1]


def test_bad_address_in_the_environment(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc.aio, "insecure_channel", _no_connection)
    monkeypatch.setenv("INFERD_ADDRESS", "unix:/tmp/\udcff.sock")
    with pytest.raises(SystemExit) as exc:
        inferctl.main(["reset", "s"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("inferctl: error: $INFERD_ADDRESS: not valid UTF-8")


@pytest.mark.parametrize(("flag", "value"), [
    ("--max-tokens", "1"), ("--max-tokens", str(2**32 - 1)),
    ("--top-k", "0"), ("--top-k", str(2**32 - 1)),
    ("--seed", "0"), ("--seed", str(2**63 - 1)),
    ("--temperature", "0"), ("--temperature", "100"),
    ("--top-p", "1"), ("--top-p", "1e-45"),
    ("--timeout", "0.001"), ("--timeout", str(365 * 86400)),
])
def test_edge_of_each_range_makes_a_request(flag: str, value: str) -> None:
    """The ranges' ends are accepted, and protobuf takes them: the checks are no tighter than the fields."""
    args = inferctl.build_parser().parse_args(["generate", "hello", flag, value])
    msg = inferctl.request_of(args, args.prompt, args.session)
    assert msg.ByteSize() > 0


def test_unreachable_address_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = f"unix:{tmp_path / 'no-inferd.sock'}"
    status = inferctl.main(["--address", target, "generate", "hello", "--max-tokens", "8", "--temperature", "0.7",
                            "--top-p", "0.9", "--top-k", "40", "--seed", "7", "--stop", "\n", "--timeout", "10"])
    assert status != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1
    assert err == (f"inferctl: inferd is not reachable at {target} (no such file or directory): give --address or "
                   "set INFERD_ADDRESS\n")


def test_chat_message_not_utf8_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n  \ncaf\xe9\n"), encoding="utf-8"))
    status = inferctl.main(["--address", f"unix:{tmp_path / 'no-inferd.sock'}", "chat", "--timeout", "10"])
    assert status == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("inferctl: a message on standard input is not valid UTF-8")
