"""inferd's paged decode kernel against attention over a gathered copy, on pages laid out as the pool's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from inferd import paged_kernel
from inferd.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(paged_kernel.compiler() is None, reason="no C++ compiler to build the kernel")

LAYERS, BLOCKS = 2, 128          # room for the longest table: 96 blocks of 1 token


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Each row's softmax(q K^T / sqrt(dim)) V over its first `lens` keys, in float64."""
    batch, heads, dim = q.shape
    kv_heads = cache.shape[3]
    out = []
    for b in range(batch):
        pages = cache[tables[b]].double()                       # [n, 2, block_size, kv_heads, dim]
        keys = pages[:, 0].reshape(-1, kv_heads, dim)[:lens[b]].repeat_interleave(heads // kv_heads, 1)
        values = pages[:, 1].reshape(-1, kv_heads, dim)[:lens[b]].repeat_interleave(heads // kv_heads, 1)
        weights = torch.einsum("hd,thd->ht", q[b].double(), keys).mul(dim ** -0.5).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", weights, values).reshape(-1))
    return torch.stack(out)


def case(seed: int, dtype: torch.dtype, lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int):
    """q as the decoder passes it (a view into the fused QKV rows) and one layer of a pool of pages."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randn(BLOCKS, LAYERS, 2, block_size, kv_heads, dim, generator=gen).to(dtype)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, :heads * dim].view(-1, heads, dim)
    width = max(-(-n // block_size) for n in lens)
    tables = torch.stack([torch.randperm(BLOCKS, generator=gen)[:width] for _ in lens])
    return q, pages[:, 1], tables, torch.tensor(lens)


def test_the_kernel_builds_and_loads():
    assert paged_kernel.load()
    assert paged_kernel.build().exists()


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("dim", [32, 128])
def test_decode_rows_attend_as_over_a_gathered_copy(dtype, atol, heads, kv_heads, dim):
    lens = [1, 15, 16, 17, 100, 33, 64, 2]     # one key, a block's (and a tile's) edge either side, several
    q, cache, tables, lens_t = case(1, dtype, lens, heads, kv_heads, dim, 16)
    out = paged_kernel.paged_decode(q, cache, tables, lens_t, dim ** -0.5)
    assert out.dtype == dtype and out.shape == (len(lens), heads * dim)
    torch.testing.assert_close(out.double(), reference(q, cache, tables, lens_t), atol=atol, rtol=0)


@given(seed=st.integers(0, 2**31), lens=st.lists(st.integers(1, 96), min_size=1, max_size=6),
       groups=st.sampled_from([(4, 1), (6, 2), (2, 2)]), dim=st.sampled_from([8, 20, 32, 64, 128]),
       block_size=st.sampled_from([1, 4, 16]), threads=st.sampled_from([1, 2]))
def test_any_lengths_tables_and_head_shapes_attend_as_over_a_gathered_copy(seed, lens, groups, dim, block_size,
                                                                            threads):
    # Fewer rows than threads splits a row's KV heads among them; the result must not depend on that.
    q, cache, tables, lens_t = case(seed, torch.float32, lens, *groups, dim, block_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_kernel.paged_decode(q, cache, tables, lens_t, dim ** -0.5)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), reference(q, cache, tables, lens_t), atol=2e-6, rtol=0)


@pytest.mark.parametrize(("change", "message"), [
    (lambda q, c, t, n: (q, c, t.clone().fill_(BLOCKS), n), "outside the pool's 128"),
    (lambda q, c, t, n: (q, c, t.clone().fill_(-1), n), "outside the pool's 128"),
    (lambda q, c, t, n: (q, c, t, n.clone().fill_(0)), "outside the table's"),
    (lambda q, c, t, n: (q, c, t, n + 16), "outside the table's"),
    (lambda q, c, t, n: (q, c, t.int(), n), "int64"),
    (lambda q, c, t, n: (q.double(), c, t, n), "dtypes differ"),
    (lambda q, c, t, n: (q[:, :3], c, t, n), "multiple of kv_heads"),
    (lambda q, c, t, n: (q, c, t[:1], n), "one table and length per row"),
])
def test_bad_tables_and_shapes_are_refused_before_anything_is_read(change, message):
    args = change(*case(2, torch.float32, [5, 16, 40], 4, 2, 16, 16))
    with pytest.raises(RuntimeError, match=message):
        paged_kernel.paged_decode(*args, 0.25)


@pytest.mark.processes
def test_without_a_compiler_build_kernel_says_so_in_one_line(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "inferd", "build-kernel"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"inferd: no C++ compiler ({tmp_path / 'no-such-c++'}) on PATH"]
    assert not (tmp_path / "cache" / "kvpool" / "kernels").exists() or \
        not list((tmp_path / "cache" / "kvpool" / "kernels").glob("*.so"))


NO_COMPILER = """
import sys
from pathlib import Path
import torch
from inferd.checkpoint import load_weights, read_config
from inferd.model import PagedDecoder
from inferd.paged_kernel import KernelUnavailable
model = Path(sys.argv[1])
config = read_config(model)
weights, pages = load_weights(model, config.dtype), torch.zeros(4, *config.page_shape(4))
print(PagedDecoder(config, weights, pages).attention)
try:
    PagedDecoder(config, weights, pages, attention="paged")
except KernelUnavailable as exc:
    print(exc)
"""


@pytest.mark.processes
def test_without_a_compiler_a_decoder_attends_through_the_gathered_copy(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", NO_COMPILER, str(model)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [
        "gather", "the paged kernel could not be built or loaded (inferd build-kernel says why)"]
    assert "the paged kernel is unavailable" in done.stdout + done.stderr
