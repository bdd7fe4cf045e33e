"""Every benchmark's --quick run: a bench that no longer runs fails here, not on the day its figures are needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.processes


def quick(script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", "--json", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_http_chat_bench_runs_and_only_its_reuse_runs_reuse():
    report = quick("bench_http_chat.py")
    runs = report["runs"]
    assert set(runs) == {"no reuse", "prefix cache", "session"}
    assert runs["no reuse"]["cached_share_later"] == 0
    assert runs["prefix cache"]["cached_share_later"] > 0.5 and runs["session"]["cached_share_later"] > 0.5
    assert all(r["output_tok_s"] > 0 for r in runs.values())
