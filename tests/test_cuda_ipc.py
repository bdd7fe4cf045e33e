"""The CUDA backend: memd's pool on a GPU, opened by two other processes through CUDA IPC.

Skipped without a GPU; run it wherever one is present.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


async def test_two_processes_share_a_gpu_pool(memd_factory, spawn_worker):
    memd = await memd_factory("--device", "cuda:0", "--pool-bytes", "64MiB", "--block-bytes", "64KiB")
    writer = await spawn_worker(memd.address)
    reader = await spawn_worker(memd.address)
    opened, = await writer.step({"kind": "open", "token_ids": list(range(40)), "session_id": "gpu"})
    written = [await writer.call("write", block=b, seed=i) for i, b in enumerate(opened["block_ids"])]
    await writer.step({"kind": "park", "seq_id": opened["seq_id"], "commit_to": 40})

    resumed, = await reader.step({"kind": "resume", "session_id": "gpu"})
    for block, expected in zip(resumed["block_ids"], written, strict=True):
        assert (await reader.call("read", block=block))["digest"] == expected["digest"]

    await reader.step({"kind": "free", "seq_id": resumed["seq_id"]})
    again, = await writer.step({"kind": "open", "token_ids": [5, 6, 7]})
    assert (await writer.call("read", block=again["block_ids"][0]))["zero"]
    async with memd.admin() as admin:
        assert (await admin.stats()).backend == "cuda"
        assert (await admin.check()).ok
