"""The pool's and the swap tier's memory in-process: allocation at start-up, and copies that come back exact."""

from __future__ import annotations

import os
import threading

import pytest

from memd.memory import Allocation, PoolMemoryError, ShmMemory, allocate_pages
from memd.swap import HostSwap
from shared import pool_files


def test_pages_allocated_on_a_thread_fail_start_up_when_waited_for():
    read, write = os.pipe()                     # fallocate refuses a pipe, as it would a full tmpfs
    try:
        allocation = Allocation([(read, 1 << 20)], "pool", background=True)
        with pytest.raises(PoolMemoryError, match=r"cannot allocate a pool of 1\.0 MiB"):
            allocation.wait()
        allocation.wait(check=False)            # closing waits without raising again
    finally:
        os.close(read)
        os.close(write)


def test_a_swap_file_is_not_allocated_when_the_pools_pages_could_not_be(tmp_path):
    read, write = os.pipe()                     # the pool's "file": fallocate refuses it
    try:
        pool = Allocation([(read, 1 << 20)], "pool", background=True)
        with (tmp_path / "swap").open("wb") as f:
            f.truncate(1 << 20)
            swap = Allocation([(f.fileno(), 1 << 20)], "swap tier", background=True, after=pool)
            with pytest.raises(PoolMemoryError, match="swap tier was not allocated: the pool could not be"):
                swap.wait()
        assert (tmp_path / "swap").stat().st_blocks == 0
    finally:
        os.close(read)
        os.close(write)


def test_an_allocation_told_to_stop_allocates_no_more(tmp_path):
    stop = threading.Event()
    stop.set()
    with (tmp_path / "pool").open("wb") as f:
        f.truncate(1 << 20)
        assert not allocate_pages(f.fileno(), 1 << 20, "pool", stop=stop)
        assert (tmp_path / "pool").stat().st_blocks == 0
        assert allocate_pages(f.fileno(), 1 << 20, "pool")
        assert (tmp_path / "pool").stat().st_blocks * 512 >= 1 << 20


def test_a_pool_in_several_files_starts_on_a_huge_page_boundary(monkeypatch):
    monkeypatch.setattr(pool_files, "STRIPE_BYTES", 2 << 20)
    pool = ShmMemory(96, 68 << 10)             # 6.375 MiB: four files, the last not a whole huge page
    try:
        assert pool.stripes == [2 << 20] * 3 + [(96 * 68 << 10) - (6 << 20)]
        assert pool.base % pool_files.ALIGN == 0
        pool.view()[-4:] = b"last"             # the range ends where the pool does
        assert bytes(pool.view()[-4:]) == b"last" and len(pool.view()) == 96 * 68 << 10
    finally:
        pool.close()


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


def test_a_pool_file_kept_whole_from_the_last_memd_is_reopened_without_allocating_again(tmp_path, monkeypatch):
    first = ShmMemory(8, 64 << 10, tmp_path / "pool")
    first.view()[:5] = b"kept!"
    first.close()

    def refuse(fd: int, offset: int, length: int) -> None:
        raise AssertionError("a pool file already allocated whole was allocated again")

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    again = ShmMemory(8, 64 << 10, tmp_path / "pool")
    try:
        assert again.reopened and bytes(again.view()[:5]) == b"kept!"
    finally:
        again.close()


def test_a_kept_pool_file_with_holes_is_allocated_whole(tmp_path):
    path = tmp_path / "pool"
    with path.open("wb") as f:                  # the right size, no page allocated: a memd killed while allocating
        f.truncate(8 << 16)
    pool = ShmMemory(8, 64 << 10, path)
    try:
        assert pool.reopened and path.stat().st_blocks * 512 >= 8 << 16
    finally:
        pool.close()


def test_a_pool_in_several_files_reopens_with_its_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(pool_files, "STRIPE_BYTES", 2 << 20)       # a 6 MiB pool in three files of 2 MiB
    pool = ShmMemory(96, 64 << 10, tmp_path / "pool")
    assert pool.stripes == [2 << 20] * 3 and not pool.reopened
    for offset in (0, (2 << 20) - 3, (4 << 20) + 5, (6 << 20) - 4):   # across the files' seams too
        pool.view()[offset:offset + 4] = offset.to_bytes(4, "little")
    pool.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool", "pool.1", "pool.2"]
    assert all(p.stat().st_size == 2 << 20 for p in tmp_path.iterdir())

    again = ShmMemory(96, 64 << 10, tmp_path / "pool")
    try:
        assert again.reopened
        for offset in (0, (2 << 20) - 3, (4 << 20) + 5, (6 << 20) - 4):
            assert bytes(again.view()[offset:offset + 4]) == offset.to_bytes(4, "little")
        assert again.export()["stripes"] == [2 << 20] * 3
    finally:
        again.close()


PAGE = 4096


def marked(memory_view: memoryview, rows: int) -> None:
    """Row i holds bytes derived from i (and its offset), so a page copied to the wrong place shows."""
    for i in range(rows):
        memory_view[i * PAGE:(i + 1) * PAGE] = bytes((i * 7 + k) % 251 for k in range(0, PAGE, 16)) * 16


PAIR_SHAPES = {
    "gather: scattered pages to consecutive slots (and back: a scatter)": [(2 * i, i) for i in range(16)],
    "scatter: consecutive pages to scattered slots": [(i, 23 - 2 * i) for i in range(10)],
    "runs on both sides": [(4, 0), (5, 1), (6, 2), (9, 3), (10, 4), (2, 5), (3, 7)],
    "scattered on both sides": [(17, 3), (2, 9), (30, 0), (8, 5), (11, 1)],
    "one page": [(13, 6)],
    "mixed": [(0, 10), (1, 11), (2, 12), (7, 13), (9, 14), (5, 2), (6, 3), (20, 20), (3, 21), (4, 22), (5, 23)],
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", list(PAIR_SHAPES))
def test_swapped_pages_land_byte_identical_in_their_slots_and_back(shape, threads, monkeypatch):
    import memd.swap

    monkeypatch.setattr(memd.swap, "COPY_THREADS", threads)
    monkeypatch.setattr(memd.swap, "PARALLEL_BYTES", 0 if threads > 1 else 1 << 40)
    pool = ShmMemory(32, PAGE)
    swap = HostSwap(pool, 24, PAGE)
    try:
        marked(pool.view(), 32)
        before = bytes(pool.view())
        pairs = PAIR_SHAPES[shape]                         # (page, slot)
        swap.copy_out(pairs)
        for page, slot in pairs:
            assert swap.view()[slot * PAGE:(slot + 1) * PAGE] == before[page * PAGE:(page + 1) * PAGE]
        swap.view()[:] = bytes(24 * PAGE)
        assert swap.copy_out_checked(pairs) == pool.checksums([p for p, _ in pairs])     # memd's swap-out
        for page, slot in pairs:
            assert swap.view()[slot * PAGE:(slot + 1) * PAGE] == before[page * PAGE:(page + 1) * PAGE]
        pool.view()[:] = bytes(32 * PAGE)
        swap.copy_in([(slot, page) for page, slot in pairs])
        after = bytes(pool.view())
        for page in range(32):
            expected = before[page * PAGE:(page + 1) * PAGE] if any(p == page for p, _ in pairs) else bytes(PAGE)
            assert after[page * PAGE:(page + 1) * PAGE] == expected, page
        assert swap.copy_in_checked([(slot, page) for page, slot in pairs]) == pool.checksums([p for p, _ in pairs])
    finally:
        swap.close()
        pool.close()


def test_a_swap_copy_naming_a_page_past_the_pool_is_refused():
    pool = ShmMemory(4, PAGE)
    swap = HostSwap(pool, 4, PAGE)
    try:
        with pytest.raises(IndexError):
            swap.copy_out([(4, 0)])
        with pytest.raises(IndexError):
            swap.copy_in([(0, 1), (5, 2)])
        with pytest.raises(IndexError):                     # the checked copies too: a memmove per page
            swap.copy_out_checked([(0, 0), (1, 4)])
        with pytest.raises(IndexError):
            swap.copy_in_checked([(0, 1), (0, -1)])
    finally:
        swap.close()
        pool.close()


def test_memds_copy_threads_give_way_to_its_event_loop():
    """Copies run below the loop's priority: a Step arriving during a swap storm gets a core first."""
    import os
    import threading

    from memd.background import BACKGROUND_NICE
    from memd.page_copier import PageCopier

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    pool = ShmMemory(4, PAGE)
    copier = PageCopier(pool, None, PAGE)
    try:
        here = nice()
        for threads in (copier._effects, copier._swap_outs):
            assert threads.submit(nice).result() == min(here + BACKGROUND_NICE, 19)
        assert nice() == here                                     # the caller's own priority is untouched
    finally:
        copier.close()
        pool.close()
