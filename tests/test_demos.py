"""The README's first command ends in these demos: they must keep working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_demo(module: str) -> str:
    done = subprocess.run([sys.executable, "-m", module], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.processes
def test_the_chat_demo_shows_later_turns_reusing_the_conversation():
    out = run_demo("inferd.demo")
    turns = [line for line in out.splitlines() if "reused from memd" in line]
    assert len(turns) == 3
    assert "of which 0 reused" in turns[0]
    for line in turns[1:]:
        prompt = int(line.split("prompt ")[1].split(" tokens")[0])
        reused = int(line.split("of which ")[1].split(" reused")[0])
        assert reused > prompt * 0.9                     # only the new message is computed
    assert "sequences running 0, parked 1, swapped 0, dropped 0" in out and "check: ok" in out


@pytest.mark.processes
def test_the_pool_demo_shares_bytes_between_two_workers():
    out = run_demo("memd.demo")
    assert "K/V bytes identical: True" in out and "sharing alice's first 64 tokens" in out
    assert "check: ok" in out
