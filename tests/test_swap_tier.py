"""The pool's and the swap tier's memory in-process: allocation at start-up, and copies that come back exact."""

from __future__ import annotations

import os

import pytest

from memd.memory import Allocation, PoolMemoryError, ShmMemory
from memd.swap import HostSwap


def test_pages_allocated_on_a_thread_fail_start_up_when_waited_for():
    read, write = os.pipe()                     # fallocate refuses a pipe, as it would a full tmpfs
    try:
        allocation = Allocation(read, 1 << 20, "pool", background=True)
        with pytest.raises(PoolMemoryError, match=r"cannot allocate a pool of 1\.0 MiB"):
            allocation.wait()
        allocation.wait(check=False)            # closing waits without raising again
    finally:
        os.close(read)
        os.close(write)


def test_a_swap_file_is_allocated_whole_before_it_is_reported_allocated(tmp_path):
    pool = ShmMemory(8, 64 << 10, tmp_path / "pool", background=True)
    swap = HostSwap(pool, 4, 64 << 10, path=tmp_path / "swap")
    try:
        pool.allocated()
        swap.allocated()
        for path, size in ((tmp_path / "pool", 8 << 16), (tmp_path / "swap", 4 << 16)):
            st = path.stat()
            assert st.st_size == size and st.st_blocks * 512 >= size      # every page there, none a hole
    finally:
        swap.close()
        pool.close()
