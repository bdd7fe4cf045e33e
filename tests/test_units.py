"""Small pure pieces: sizes, geometry formulas, positions, handle codec."""

from __future__ import annotations

import json
import socket

import msgpack
import pytest

from memd.errors import PositionError
from memd.page_effects import Copy
from memd.sequences import SeqState, Sequence, locate
from shared.geometry import GeometryError, ModelShape, plan_pool, read_model_shape
from shared.launch import free_ports
from shared.ops import Extend
from shared.protobuf_codec import WireError, decode_handle, encode_handle
from shared.sizes import format_size, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), ("64KiB", 65536), ("64MiB", 64 << 20), ("1.5GiB", 3 << 29), ("512MB", 512_000_000),
    ("2 gib", 2 << 30), ("1TiB", 1 << 40),
])
def test_sizes_parse_as_operators_write_them(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-5", "12XB", "1.2.3KiB"])
def test_nonsense_sizes_are_refused(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_sizes_format_for_humans():
    assert format_size(512) == "512 B" and format_size(64 << 20) == "64.0 MiB"


def test_sizing_formulas_for_a_7b_model():
    # Llama-2-7B: 32 layers x 2 x 32 kv heads x 128 x 2 bytes = 512 KiB per token.
    # A page holds every layer: 0.5 MiB (32 x 128 x 32 x 2 x 2) is one layer's share of a 32-token block.
    shape = ModelShape(num_layers=32, num_kv_heads=32, head_dim=128, dtype="float16")
    assert shape.bytes_per_token == 524_288
    geometry = plan_pool(20 << 30, shape=shape, block_size=32)
    assert geometry.block_bytes == 32 * 524_288
    assert geometry.num_blocks == (20 << 30) // (32 * 524_288)
    assert shape.page_shape(32) == (32, 2, 32, 32, 128)


def test_model_config_gqa_and_explicit_head_dim(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 2048,
        "head_dim": 256, "torch_dtype": "bfloat16"}))
    shape = read_model_shape(tmp_path)
    assert (shape.num_kv_heads, shape.head_dim, shape.dtype_bytes) == (8, 256, 2)
    assert read_model_shape(tmp_path, dtype="float32").bytes_per_token == 28 * 2 * 8 * 256 * 4


def test_geometry_refuses_what_cannot_make_a_pool():
    with pytest.raises(GeometryError, match="holds no block"):
        plan_pool(1000, block_bytes=4096)
    with pytest.raises(GeometryError, match="multiple of 16"):
        plan_pool(1 << 20, block_bytes=1000)
    with pytest.raises(GeometryError, match="block size in tokens"):
        plan_pool(1 << 20, shape=ModelShape(1, 1, 8, "float32"), block_size=0)


def test_locate_uses_floor_division_and_refuses_bad_positions():
    seq = Sequence(7, "m", 16, 1, SeqState.RUNNING, [40, 41, 42], 35, list(range(36)))
    assert locate(seq, 0) == (40, 0)
    assert locate(seq, 16) == (41, 0)
    assert locate(seq, 34) == (42, 2)
    for pos in (-1, -16, 35, 48):           # -1 // 16 would silently pick the last block
        with pytest.raises(PositionError):
            locate(seq, pos)


def test_pool_handles_round_trip_and_reject_tampering():
    handle = {"backend": "shm", "size": 4096, "socket": "/run/memd/memd.sock.fd", "token": b"x" * 16}
    assert decode_handle(encode_handle(handle)) == {"v": 1, **handle}
    with pytest.raises(WireError, match="not msgpack"):
        decode_handle(b"\xc1")
    with pytest.raises(WireError, match="unknown backend"):
        decode_handle(encode_handle({"backend": "nfs"}))
    with pytest.raises(WireError, match="'token'"):
        decode_handle(encode_handle({**handle, "token": "text"}))
    with pytest.raises(WireError, match="version"):
        decode_handle(msgpack.packb({"v": 99}))


def test_a_page_a_step_takes_and_gives_back_gets_no_effect():
    from memd.manager import KvManager
    from shared.geometry import PoolGeometry
    from shared.ops import Fork, Free, Open, Park

    manager = KvManager(PoolGeometry(num_blocks=16, block_bytes=4096, block_size=4))
    worker = manager.attach("w", 1, "m", 4, 0)
    warm = manager.step(worker.worker_id, [Open(list(range(60)))]).results[0]    # dirty every page
    manager.step(worker.worker_id, [Free(warm.seq_id)])
    outcome = manager.step(worker.worker_id, [Open(list(range(100, 132)), session_id="x"), Park(2, commit_to=0)])
    assert outcome.effects == []                                  # all 8 pages free again: nothing to zero
    parent = manager.step(worker.worker_id, [Open([1, 2, 3, 4, 5, 6], reserve=2)]).results[0]
    manager.step(worker.worker_id, [Extend(parent.seq_id, commit_to=6)])
    outcome = manager.step(worker.worker_id, [Fork(parent.seq_id), Free(4)])
    assert not any(isinstance(e, Copy) for e in outcome.effects)  # the child went away in the same Step
    assert manager.violations() == []


def test_swap_copies_coalesce_runs_consecutive_on_both_sides():
    from memd.swap import pair_index, spans
    pairs = [(4, 0), (5, 1), (6, 2), (9, 3), (10, 4), (2, 5), (3, 7)]
    assert spans(pair_index(pairs)) == [(4, 0, 3), (9, 3, 2), (2, 5, 1), (3, 7, 1)]
    assert spans(pair_index([])) == []


@pytest.mark.parametrize("staging_rows", [None, 3, 64])
def test_gpu_swap_gathers_scattered_pages_and_scatters_them_back(staging_rows):
    """PinnedSwap.move's gather/scatter through a staging buffer, on CPU tensors (the GPU run checks CUDA)."""
    import torch

    from memd.pinned_swap import PinnedSwap

    swap = PinnedSwap.__new__(PinnedSwap)
    swap.pages = torch.randint(0, 256, (40, 8), dtype=torch.uint8)
    swap.slots = torch.zeros((24, 8), dtype=torch.uint8)
    swap._staging = {} if staging_rows is None else {d: torch.empty((staging_rows, 8), dtype=torch.uint8)
                                                        for d in ("out", "in")}
    blocks = [3, 17, 5, 6, 7, 30, 1, 22, 9, 11, 38, 0, 25]          # scattered: more runs than GATHER_RUNS
    slots = [20, 21, 22, 23, 0, 1, 2, 9, 10, 4, 5, 6, 7]
    swap.move(list(zip(blocks, slots, strict=True)), "out")
    assert torch.equal(swap.slots[slots], swap.pages[blocks])
    back = [39, 2, 12, 14, 16, 18, 8, 27, 33, 35, 13, 19, 10]
    expected = swap.slots[slots].clone()
    swap.move(list(zip(slots, back, strict=True)), "in")
    assert torch.equal(swap.pages[back], expected)


def test_a_refused_step_that_parked_then_resumed_restores_the_block_table_in_order():
    # Found by the state machine: Park cut the table, Resume in the same Step grew it again, a later op
    # failed, and the rollback put the pages back in the wrong order.
    from memd.errors import OpError
    from memd.manager import KvManager
    from shared.geometry import PoolGeometry
    from shared.ops import Free, Open, Park, Resume

    manager = KvManager(PoolGeometry(num_blocks=8, block_bytes=4096, block_size=4))
    worker = manager.attach("w", 1, "m", 4, 0).worker_id
    seq = manager.step(worker, [Open([], 8)]).results[0]
    assert manager.seqs[seq.seq_id].block_ids == [0, 1]
    with pytest.raises(OpError):
        manager.step(worker, [Park(seq.seq_id), Resume(seq_id=seq.seq_id, reserve=1), Free(999)])
    assert manager.seqs[seq.seq_id].block_ids == [0, 1]
    assert manager.violations() == []


def test_free_ports_are_different_ports_nothing_listens_on():
    ports = free_ports(64)
    assert len(set(ports)) == 64
    for port in ports:                         # each can be bound now: nothing holds it
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
