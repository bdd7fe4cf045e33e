"""inferd's heap keeps what a forward pass frees for the next one, instead of faulting it in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

# A decode pass's pattern: several tensors of a few MiB, each written, then all freed, on a thread of its own (as
# inferd's forward thread), a little larger every pass as contexts grow. The minor page faults of the last passes
# are the pages the kernel mapped and zeroed: the heap's growth, and what it was given back and must give again.
PASSES = r"""
import json, resource, sys, threading
import torch
from inferd.heap_policy import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "kept" else None
faults = []
def passes():
    for i in range(40):
        if i == 10:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        tensors = [torch.empty(512 * 1024 + 16384 * i + 1000 * k).fill_(1.0) for k in range(8)]
        del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
thread = threading.Thread(target=passes)
thread.start()
thread.join()
print(json.dumps({"applied": applied, "faults": faults[1] - faults[0]}))
"""


def run_passes(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PASSES, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_tensors_are_reused_without_page_faults():
    kept, default = run_passes("kept"), run_passes("default")
    assert kept["applied"] is True
    # 30 passes of 16-24 MiB: ~4,000-6,000 pages each when glibc gives them back (210-220k here); kept, only the
    # heap's growth (7-8k).
    assert kept["faults"] * 10 < default["faults"]


def test_malloc_settings_the_user_chose_are_left_alone():
    chosen = run_passes("kept", GLIBC_TUNABLES="glibc.malloc.tcache_count=7")
    assert chosen["applied"] is False
