"""K/V is reused only under the weights that wrote it: the model fingerprint covers every byte that matters."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file, save_file

from inferd.checkpoint import read_config
from inferd.fingerprint import CACHE_NAME, model_fingerprint
from inferd.tiny import make_tiny_model
from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc
from tests.answers import Reference

BIG = {"arch": "llama", "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096, "seed": 3}
DEEP = "model.layers.3.self_attn.k_proj.weight"


def offset_of(weights: Path, name: str) -> int:
    """Where a tensor's bytes start in a safetensors file."""
    with weights.open("rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    return 8 + size + header[name]["data_offsets"][0]


def fine_tune_in_place(model_dir: Path) -> None:
    """One attention projection changed, deep in the file; the file keeps its size."""
    weights = model_dir / "model.safetensors"
    tensors = load_file(str(weights))
    size = weights.stat().st_size
    tensors[DEEP] = tensors[DEEP] * 1.5
    save_file(tensors, str(weights))
    assert weights.stat().st_size == size


def test_a_tensor_changed_past_the_first_mib_changes_the_fingerprint_and_the_cache_saves_a_rehash(tmp_path):
    model = make_tiny_model(tmp_path / "m", **BIG)
    assert offset_of(model / "model.safetensors", DEEP) > 1 << 20
    config = read_config(model)
    before = model_fingerprint(model, config, 16)
    assert model_fingerprint(model, config, 16) == before and (model / CACHE_NAME).exists()
    assert model_fingerprint(model, config, 32) != before                   # another page layout
    fine_tune_in_place(model)
    assert model_fingerprint(model, config, 16) != before


@pytest.mark.processes
async def test_a_session_resumed_on_fine_tuned_weights_answers_as_the_new_weights_do(memd_factory, inferd_factory,
                                                                                      tmp_path):
    model = make_tiny_model(tmp_path / "m", **BIG)
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "32MiB", "--model", str(model), "--block-size", "16")
    first = await inferd_factory(model, memd.address, name="old")
    turn1 = [5 + i for i in range(40)]
    answer1, _ = await generate(first.address, turn1, "chat")
    await first.stop()
    fine_tune_in_place(model)
    second = await inferd_factory(model, memd.address, name="new")
    turn2 = [7, 8, 9]
    answer2, usage2 = await generate(second.address, turn2, "chat")
    assert usage2.cached_tokens == 0                       # none of the old weights' K/V is read
    assert usage2.prompt_tokens == len(turn1) + len(answer1) + len(turn2)   # the history is kept
    Reference.load(model).assert_greedy(turn1 + answer1 + turn2, answer2, len(answer2), "on the new weights")
    async with memd.admin() as admin:
        stats = await admin.stats()
        assert stats.counters["resumed_under_other_weights"] == 1 and (await admin.check()).ok


async def generate(address: str, prompt: list[int], session: str) -> tuple[list[int], pb.Usage]:
    tokens, usage = [], None
    async with grpc.aio.insecure_channel(address) as channel:
        async for reply in pb_grpc.InferdStub(channel).Generate(pb.GenerateRequest(
                prompt_ids=prompt, session_id=session, max_tokens=8, ignore_eos=True)):
            tokens += reply.token_ids
            usage = reply.usage if reply.finish_reason else usage
    return tokens, usage
