"""What flex decode refuses before anything compiles (pools, pages and head layouts torch's GPU kernel cannot
serve), and its page lists in int64 for large pools.

(Its results are checked in test_model and test_inferd_service, compiled for the CPU, and on a GPU in
test_cuda_ipc.)"""

from __future__ import annotations

import pytest
import torch

from inferd.flex_decode import FlexDecode, unavailable
from tests.attention_reference import attention_over_a_copy

GPU = torch.device("cuda:0")          # a device object only: nothing here touches a GPU


@pytest.mark.parametrize(("pool", "block_size", "heads", "kv_heads", "dim", "reason"), [
    (torch.device("cpu"), 16, 32, 8, 64, "reads a GPU pool"),
    (GPU, 8, 32, 8, 64, "at least 16 tokens"),
    (GPU, 24, 32, 8, 64, "power of two of at least 16"),
    (GPU, 16, 12, 5, 64, "12 query heads over 5 KV heads"),
    (GPU, 16, 4, 2, 8, "heads of 8"),
])
def test_pools_and_models_the_gpu_kernel_cannot_serve_are_named(pool, block_size, heads, kv_heads, dim, reason):
    assert reason in unavailable(pool, block_size, heads, kv_heads, dim, pool_elements=1 << 20)


def test_a_gpu_pool_of_two_billion_elements_or_more_is_refused_naming_the_way_out():
    # Llama-1B's 16-token pages are 2**18 elements (512 KiB in bfloat16): 8192 of them are 2**31 elements.
    page = 16 * 2 * 16 * 8 * 64
    why = unavailable(GPU, 16, 32, 8, 64, pool_elements=8192 * page)
    assert why is not None and "2.0Gi elements" in why and "--attention gather" in why
    assert "2Gi elements" not in (unavailable(GPU, 16, 32, 8, 64, pool_elements=8191 * page) or "")


def test_a_gpu_decode_step_is_refused_past_the_kernels_grid():
    # The GPU kernel's grid has a row per (sequence, KV head), at most 65,535: with 8 KV heads, 4,096 sequences.
    flex = FlexDecode(torch.empty(4, 2, 2, 16, 8, 64, device="meta"), 32, max_context=64)
    assert flex.max_rows == 4096
    with pytest.raises(ValueError, match=r"at most 4096 .*--max-num-seqs"):
        flex.mask(torch.zeros(4097, 1, dtype=torch.long, device="meta"), torch.ones(4097, dtype=torch.long,
                                                                                    device="meta"))


@pytest.mark.processes                         # torch's compiler builds the kernel in processes of its own
def test_page_lists_in_int64_read_what_int32_lists_read():
    # A pool of 2**31 elements or more gets its page lists in int64 (the GPU kernel needs them so): compiled
    # for the CPU, both widths read each sequence's pages as attention over a copy of them does.
    gen = torch.Generator().manual_seed(0)
    layers, bs, kv_heads, dim, heads, blocks = 2, 16, 2, 32, 4, 64
    pages = torch.randn(blocks, layers, 2, bs, kv_heads, dim, generator=gen)
    tables = torch.tensor([[0, 63, 20], [62, 1, 2], [61, 60, 59]])
    lens = torch.tensor([40, 33, 48])
    q = torch.randn(3, heads, dim, generator=gen)
    out = {}
    for wide in (False, True):
        flex = FlexDecode(pages, heads, max_context=256, wide=wide)
        assert flex.index_dtype == (torch.int64 if wide else torch.int32)
        mask = flex.mask(tables, lens)
        out[wide] = [flex.attend(q, pages[:, layer], mask, dim ** -0.5) for layer in range(layers)]
    for layer in range(layers):
        assert torch.equal(out[True][layer], out[False][layer])
        for i in range(3):
            ref = attention_over_a_copy(q[i], pages, layer, tables[i], lens[i])
            torch.testing.assert_close(out[True][layer][i], ref, atol=1e-5, rtol=1e-5)
    assert FlexDecode(torch.empty(4, 2, 2, 16, 8, 64, device="meta"), 32, max_context=64).index_dtype == torch.int32
    assert FlexDecode(torch.empty(8192, 16, 2, 16, 8, 64, device="meta"), 32, max_context=64).index_dtype == \
        torch.int64                                     # 2**31 elements


@pytest.mark.processes                         # torch's compiler builds the kernel in processes of its own
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (14, 2), (4, 2)])     # 3 and 7 a KV head (Qwen2's 7)
def test_query_groups_of_any_size_read_what_attention_over_a_copy_reads(heads, kv_heads):
    # The kernel takes a power of two query heads per KV head: other groups are padded with zero queries,
    # whose outputs are dropped, and a GPU no longer refuses them.
    assert "query heads" not in (unavailable(GPU, 16, heads, kv_heads, 32, pool_elements=1 << 20) or "")
    gen = torch.Generator().manual_seed(1)
    bs, dim, blocks = 16, 32, 16
    pages = torch.randn(blocks, 1, 2, bs, kv_heads, dim, generator=gen)
    tables = torch.tensor([[3, 15, 7], [14, 1, 2]])
    lens = torch.tensor([40, 17])
    q = torch.randn(2, heads, dim, generator=gen)
    flex = FlexDecode(pages, heads, max_context=64)
    assert (flex.group, flex.padded_group) == (heads // kv_heads, 1 << (heads // kv_heads - 1).bit_length())
    out = flex.attend(q, pages[:, 0], flex.mask(tables, lens), dim ** -0.5)
    assert out.shape == (2, heads * dim)
    for i in range(2):
        ref = attention_over_a_copy(q[i], pages, 0, tables[i], lens[i])
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
