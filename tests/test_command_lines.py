"""Every kvpool program refuses a bad command line in one line that names the flag, and never with a traceback.

The table is what operators got wrong (or got a traceback for) before: each
row runs through the program's own main(), in-process where parsing refuses
it (fast, no process), and memctl's rows once more as processes against a
live memd, which must come out of them unchanged.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from inferd import __main__ as inferd_main
from inferd import inferctl
from kvroute import __main__ as kvroute_main
from memd import __main__ as memd_main
from memd import memctl
from shared.command_line import EXIT_CLOSED_PIPE

ROOT = Path(__file__).resolve().parent.parent
HUGE = str(2**64)                    # one past the protocols' widest integers
MAINS: dict[str, Callable[[list[str]], int]] = {
    "memd": memd_main.main, "memctl": memctl.main, "inferd": inferd_main.main, "inferctl": inferctl.main,
    "kvroute": kvroute_main.main,
}
NO_INFERD = "unix:/nonexistent/inferd.sock"

# (program, argv, what the one line must say). {tmp} is the test's temporary directory.
BAD = [
    ("memctl", ["evict", "--seq", "-1"], "argument --seq"),
    ("memctl", ["evict", "--seq", HUGE], "argument --seq"),
    ("memctl", ["evict", "--blocks", HUGE], "argument --blocks"),
    ("memctl", ["evict", "--worker", HUGE], "argument --worker"),
    ("memctl", ["evict", "--idle", "nan"], "argument --idle"),
    ("memctl", ["drain", "--worker", HUGE], "argument --worker"),
    ("memctl", ["drain", "--undo", "--wait", "5"], "--wait means nothing with --undo"),
    ("memctl", ["sequences", "--worker", HUGE], "argument --worker"),
    ("memctl", ["top", "--interval", "0"], "argument --interval"),
    ("memctl", ["--timeout", "0", "stats"], "argument --timeout"),
    ("memctl", ["scrub", "--rate", "-1"], "argument --rate"),
    ("inferctl", ["--address", NO_INFERD, "generate", "hi", "--max-tokens", "-1"], "argument --max-tokens"),
    ("inferctl", ["--address", NO_INFERD, "generate", "hi", "--max-tokens", HUGE], "argument --max-tokens"),
    ("inferctl", ["--address", NO_INFERD, "generate", "hi", "--top-k", "-3"], "argument --top-k"),
    ("inferctl", ["--address", NO_INFERD, "generate", "hi", "--seed", "-1"], "argument --seed"),
    ("inferctl", ["--address", NO_INFERD, "generate", "hi", "--seed", HUGE], "argument --seed"),
    ("inferctl", ["--address", NO_INFERD, "generate", "caf\udce9"], "argument prompt: not valid UTF-8"),
    ("memd", ["--metrics-port", "70000"], "argument --metrics-port"),
    ("memd", ["--block-bytes", "0"], "argument --block-bytes"),
    ("memd", ["--cluster-replicas", "0"], "argument --cluster-replicas"),
    ("memd", ["--lease-timeout", "0"], "argument --lease-timeout"),
    ("memd", ["--heat-interval", "inf"], "argument --heat-interval"),
    ("memd", ["--config", "{tmp}/binary.toml"], "binary.toml is not valid TOML"),
    ("inferd", ["serve", "--model", "{tmp}", "--metrics-port", "70000"], "argument --metrics-port"),
    ("inferd", ["serve", "--model", "{tmp}", "--threads", "-2"], "argument --threads"),
    ("inferd", ["serve", "--model", "{tmp}", "--max-num-seqs", "0"], "argument --max-num-seqs"),
    ("inferd", ["serve", "--model", "{tmp}", "--max-batch-tokens", "0"], "argument --max-batch-tokens"),
    ("inferd", ["serve", "--model", "{tmp}", "--block-size", "0"], "argument --block-size"),
    ("inferd", ["make-tiny-model", "{tmp}/tiny", "--vocab", "-5"], "argument --vocab"),
    ("kvroute", ["--http", "127.0.0.1:0", "--worker", "http://127.0.0.1:1", "--health-interval", "0"],
     "argument --health-interval"),
]


def _argv(argv: list[str], tmp: Path) -> list[str]:
    (tmp / "binary.toml").write_bytes(bytes(range(256)))
    return [a.replace("{tmp}", str(tmp)) for a in argv]


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("program", "argv", "says"), BAD, ids=[f"{p} {' '.join(a)}" for p, a, _ in BAD])
def test_a_bad_command_line_is_refused_in_one_line(program: str, argv: list[str], says: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = MAINS[program](_argv(argv, tmp_path))
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"{program}") and says in line, line


@pytest.mark.parametrize("program", sorted(MAINS))
def test_every_program_says_its_version(program: str, capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version
    with pytest.raises(SystemExit) as exc:
        MAINS[program](["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"{program} (kvpool) {version('kvpool')}"


def test_settings_that_do_nothing_together_are_pointed_out(capsys: pytest.CaptureFixture[str]) -> None:
    assert memd_main.main(["--swap-ratio", "0.5", "--disable-swap", "--block-size", "32", "--print-config"]) == 0
    err = capsys.readouterr().err
    assert "memd: warning: --swap-ratio is ignored: --disable-swap leaves no swap tier" in err
    assert "memd: warning: --block-size is ignored" in err


def test_a_tiny_model_is_readable_by_the_user_that_serves_it(model_dir: Path) -> None:
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in model_dir.iterdir()} == dict.fromkeys(
        ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"), "0o644")


async def run(*argv: str, env: dict[str, str] | None = None, stdout: int = asyncio.subprocess.PIPE,
              stdin: bytes | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", *argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=stdout,
        stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.PIPE if stdin is not None else None)
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    return proc.returncode, (out or b"").decode(), err.decode()


async def test_bad_memctl_command_lines_leave_memd_as_it_was(memd, tmp_path):
    from test_memctl import park_a_session
    from test_memd_errors import fingerprint
    await park_a_session(memd)
    before = await fingerprint(memd)
    rows = [(argv, says) for program, argv, says in BAD if program == "memctl"]
    results = await asyncio.gather(*(run("memd.memctl", *argv, env={"MEMD_ADDRESS": memd.address})
                                     for argv, _ in rows))
    for (argv, says), (rc, out, err) in zip(rows, results, strict=True):
        assert rc == 2 and out == "" and says in _one_line(err), (argv, err)
    assert await fingerprint(memd) == before
    rc, out, _ = await run("memd.memctl", "--address", memd.address, "check")
    assert rc == 0 and out.strip() == "check: ok"


async def test_a_reader_that_stops_reading_ends_memctl_quietly(memd):
    read_end, write_end = os.pipe()
    os.close(read_end)                       # `memctl stats | head -1`, once head has its line
    try:
        rc, _, err = await run("memd.memctl", "--address", memd.address, "stats", stdout=write_end)
    finally:
        os.close(write_end)
    assert rc == EXIT_CLOSED_PIPE and err == ""


@pytest.mark.processes
async def test_memd_makes_no_directory_tree_out_of_a_typo(tmp_path):
    missing = tmp_path / "typo" / "deeper"
    flags = ("--device", "cpu", "--pool-bytes", "1MiB", "--log-format", "json")
    cases = [
        (("--listen", f"unix:{missing}/memd.sock"), f"cannot listen on {missing}/memd.sock: the directory "
                                                    f"{missing} does not exist"),
        (("--listen", f"unix:{tmp_path}/a.sock", "--state-dir", str(missing / "state")),
         f"cannot use the state directory {missing}/state: its parent {missing} does not exist"),
        (("--listen", f"unix:{tmp_path}/b.sock", "--token-file", str(missing / "worker.token")),
         f"cannot write the token file {missing}/worker.token: the directory {missing} does not exist"),
    ]
    results = await asyncio.gather(*(run("memd", *flags, *case) for case, _ in cases))
    for (case, says), (rc, _, err) in zip(cases, results, strict=True):
        assert rc == 1 and _one_line(err) == f"memd: {says}", (case, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []          # not even the first level of the typo


async def test_a_second_inferd_on_a_live_socket_is_refused_and_the_first_serves_on(memd_factory, inferd_factory,
                                                                                   model_dir):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "4MiB", "--model", str(model_dir))
    first = await inferd_factory(model_dir, memd.address)
    sock = first.address.removeprefix("unix:")
    rc, _, err = await run("inferd", "serve", "--model", str(model_dir), "--memd", memd.address,
                           "--listen", first.address)
    assert rc == 1 and _one_line(err) == f"inferd: another inferd is already listening on {sock}"
    assert Path(sock).exists() and first.proc.returncode is None
    # Replies end their line on stdout, where a script reads them; the statistics go to stderr.
    rc, out, _ = await run("inferd.inferctl", "--address", first.address, "chat", "--max-tokens", "3",
                           stdin=b"hello\nand again\n")
    assert rc == 0 and len(out.splitlines()) == 2 and out.endswith("\n")


async def test_a_worker_memd_can_never_attach_exits_with_memds_reason(memd_factory, model_dir, tmp_path):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "4MiB", "--model", str(model_dir))
    rc, _, err = await run("inferd", "serve", "--model", str(model_dir), "--memd", memd.address, "--listen",
                           f"unix:{tmp_path}/inferd.sock", "--block-size", "32", "--threads", "1", "--log-format",
                           "json")
    last = err.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("inferd: memd refused this worker: a block of 32 tokens") and \
        "Traceback" not in err
    assert not (tmp_path / "inferd.sock").exists()

