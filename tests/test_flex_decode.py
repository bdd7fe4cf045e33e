"""What flex decode refuses before anything compiles: pools, pages and head layouts torch's GPU kernel cannot serve.

(Its results are checked in test_model and test_inferd_service, compiled for the CPU, and on a GPU in
test_cuda_ipc.)"""

from __future__ import annotations

import pytest
import torch

from inferd.flex_decode import FlexDecode, unavailable

GPU = torch.device("cuda:0")          # a device object only: nothing here touches a GPU


@pytest.mark.parametrize(("pool", "block_size", "heads", "kv_heads", "dim", "reason"), [
    (torch.device("cpu"), 16, 32, 8, 64, "reads a GPU pool"),
    (GPU, 8, 32, 8, 64, "at least 16 tokens"),
    (GPU, 24, 32, 8, 64, "power of two of at least 16"),
    (GPU, 16, 14, 2, 64, "14 query heads over 2 KV heads"),       # Qwen2-0.5B: 7 a KV head
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
