"""inferd's CPU ops for a layer's small steps against the torch ops they stand for (inferd/layer_kernels.cpp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from inferd import paged_kernel

pytestmark = pytest.mark.skipif(paged_kernel.compiler() is None, reason="no C++ compiler to build the kernels")

BLOCKS, BLOCK_SIZE, LAYERS = 16, 4, 2
HALF_PRECISION = (torch.bfloat16, torch.float16)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert paged_kernel.load()


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMS norm, as inferd computes it without its kernels."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def torch_rope_store(qkv, cos, signed_sin, cache, blocks, offsets, heads, kv_heads) -> None:
    """RoPE on Q and K, then K and V into their slots, as inferd does it with torch's ops."""
    dim = cache.shape[-1]
    qk = qkv[:, :(heads + kv_heads) * dim].view(-1, heads + kv_heads, dim)
    qk.copy_(qk * cos + qk.roll(dim // 2, dims=-1) * signed_sin)
    cache[blocks, :, offsets] = qkv[:, heads * dim:].view(-1, 2, kv_heads, dim)


def angles(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1).to(dtype)[:, None], torch.cat((-sin, sin), -1).to(dtype)[:, None]


def rope_case(seed: int, dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int):
    """qkv rows, their angles, one layer of a pool of pages, and a distinct slot per token."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    cos, signed_sin = angles(torch.randint(0, 4096, (tokens,), generator=gen), dim, dtype)
    pages = torch.randn(BLOCKS, LAYERS, 2, BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[:tokens]
    return qkv, cos, signed_sin, pages[:, 1], slots // BLOCK_SIZE, slots % BLOCK_SIZE


def far_apart(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """Where two half-precision tensors differ by more than two units in the last place."""
    ulp = torch.finfo(theirs.dtype).eps * theirs.float().abs().clamp_min(torch.finfo(theirs.dtype).tiny)
    return (ours.float() - theirs.float()).abs() > 2 * ulp


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_PRECISION])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 256), (16, 256), (37, 896), (512, 64), (3, 20)])
def test_rms_norm_is_transformers_rms_norm(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    ours, theirs = torch.ops.kvpool.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6)
    assert ours.dtype == dtype and ours.shape == x.shape
    if dtype == torch.float32:                 # the sum of squares added in another order: the last bits
        torch.testing.assert_close(ours, theirs, atol=0, rtol=1e-6)
    else:                                      # rounded to half precision: equal but for a rare neighbour
        assert (ours != theirs).float().mean() < 1e-2 and not far_apart(ours, theirs).any()


def test_rms_norm_reads_rows_with_a_stride():
    x, weight = torch.randn(8, 2, 64), torch.randn(64)
    rows = x[:, 1]                             # every other row of 64: a stride of 128
    assert not rows.is_contiguous()
    torch.testing.assert_close(torch.ops.kvpool.rms_norm(rows, weight, 1e-5), torch_rms_norm(rows, weight, 1e-5),
                               atol=0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_PRECISION])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 4, 32), (4, 1, 64), (2, 2, 128), (6, 2, 20)])
def test_rope_store_is_torch_rope_and_store_bit_for_bit(dtype, heads, kv_heads, dim):
    qkv, cos, signed_sin, cache, blocks, offsets = rope_case(dim, dtype, 13, heads, kv_heads, dim)
    expected_qkv, expected_cache = qkv.clone(), cache.clone()
    torch_rope_store(expected_qkv, cos, signed_sin, expected_cache, blocks, offsets, heads, kv_heads)
    torch.ops.kvpool.rope_store(qkv, cos, signed_sin, cache, blocks, offsets, heads, kv_heads)
    assert torch.equal(qkv, expected_qkv)
    assert torch.equal(cache, expected_cache)  # the tokens' slots written, every other slot as it was


@given(seed=st.integers(0, 2**31), tokens=st.integers(1, 40), groups=st.sampled_from([(4, 1), (6, 2), (2, 2)]),
       dim=st.sampled_from([8, 32, 64]), threads=st.sampled_from([1, 2]))
def test_any_tokens_and_head_shapes_rotate_and_store_as_torch_does(seed, tokens, groups, dim, threads):
    qkv, cos, signed_sin, cache, blocks, offsets = rope_case(seed, torch.float32, tokens, *groups, dim)
    expected_qkv, expected_cache = qkv.clone(), cache.clone()
    torch_rope_store(expected_qkv, cos, signed_sin, expected_cache, blocks, offsets, *groups)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.ops.kvpool.rope_store(qkv, cos, signed_sin, cache, blocks, offsets, *groups)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(qkv, expected_qkv) and torch.equal(cache, expected_cache)


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: {**a, "blocks": a["blocks"].clone().fill_(BLOCKS)}, "outside the pool's 16"),
    (lambda a: {**a, "blocks": a["blocks"].clone().fill_(-1)}, "outside the pool's 16"),
    (lambda a: {**a, "offsets": a["offsets"] + BLOCK_SIZE}, "outside a block's 4 slots"),
    (lambda a: {**a, "blocks": a["blocks"][:1]}, "one int64 block and offset per token"),
    (lambda a: {**a, "offsets": a["offsets"].int()}, "one int64 block and offset per token"),
    (lambda a: {**a, "heads": 3}, "qkv's width"),
    (lambda a: {**a, "cos": a["cos"].double()}, "dtypes differ"),
    (lambda a: {**a, "signed_sin": a["signed_sin"][:2]}, "cos and signed_sin"),
])
def test_bad_slots_and_shapes_are_refused_before_anything_is_written(change, message):
    qkv, cos, signed_sin, cache, blocks, offsets = rope_case(5, torch.float32, 6, 4, 2, 16)
    args = change({"qkv": qkv, "cos": cos, "signed_sin": signed_sin, "cache": cache, "blocks": blocks,
                   "offsets": offsets, "heads": 4, "kv_heads": 2})
    qkv_before, cache_before = qkv.clone(), cache.clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvpool.rope_store(*args.values())
    assert torch.equal(qkv, qkv_before) and torch.equal(cache, cache_before)


@pytest.mark.parametrize(("x", "weight", "message"), [
    (torch.randn(4, 8), torch.randn(7), "x \\[rows, hidden\\] and weight \\[hidden\\]"),
    (torch.randn(4, 8), torch.randn(8).double(), "dtypes differ"),
    (torch.randn(8, 4).t(), torch.randn(8), "contiguous"),
    (torch.randn(4, 8).double(), torch.randn(8).double(), "float32, bfloat16 or float16 only"),
])
def test_bad_norm_inputs_are_refused(x, weight, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvpool.rms_norm(x, weight, 1e-6)
