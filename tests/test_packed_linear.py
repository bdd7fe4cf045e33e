"""Linear weights laid out for oneDNN: the same products as F.linear, in every pass kind, or left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferd.checkpoint import load_weights, read_config
from inferd.decoder_weights import DecoderWeights, one_row_prefers_checkpoint
from inferd.model import PagedDecoder, build_batch
from inferd.packed_linear import linear, packed
from inferd.tiny import make_tiny_model

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@onednn
@pytest.mark.parametrize("rows", [1, 16, 37])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_products_match_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(96, 64, generator=gen), torch.randn(rows, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    laid_out = packed(weight)
    assert laid_out.is_mkldnn and laid_out.shape == weight.shape
    torch.testing.assert_close(linear(x, laid_out, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@onednn
def test_bfloat16_products_are_f_linears_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 64, generator=gen).bfloat16()
    x = torch.randn(16, 64, generator=gen).bfloat16()
    laid_out = packed(weight)
    if not laid_out.is_mkldnn:
        pytest.skip("oneDNN offers no bfloat16 layout on this CPU")
    assert torch.equal(linear(x, laid_out), F.linear(x, weight))


def test_a_weight_without_a_layout_is_left_alone():
    weight = torch.randn(8, 4, dtype=torch.float64)        # oneDNN lays out no float64 weight
    assert packed(weight) is weight
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(linear(x, weight), F.linear(x, weight))


@onednn
def test_a_dtype_the_cpu_cannot_lay_out_keeps_its_weight_and_products():
    """fp16 needs AVX512-FP16 or AVX-NE-CONVERT: without them the layout is refused and the weight kept."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 64, generator=gen).half()
    x = torch.randn(4, 64, generator=gen).half()
    laid_out = packed(weight)
    assert laid_out is weight or laid_out.is_mkldnn
    torch.testing.assert_close(linear(x, laid_out), F.linear(x, weight), rtol=2e-3, atol=2e-3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("packed") / "model", hidden=64, layers=2, heads=4,
                                kv_heads=2, vocab=256)
    config = read_config(model_dir)
    return config, load_weights(model_dir, config.dtype)


@onednn
def test_a_decoders_passes_run_through_onednn_with_the_checkpoint_layouts_results(tiny):
    """Prompt, then a decode step of two sequences, traced: logits as with the checkpoint's layout,
    and the traced graph holds oneDNN's matmul and no aten::linear."""
    config, weights = tiny
    pool = torch.zeros(8, *config.page_shape(4))
    laid_out = PagedDecoder(config, DecoderWeights.prepare(config, weights, one_row=True), pool.clone())
    plain = PagedDecoder(config, weights, pool.clone(), pack_weights=False)
    assert laid_out.weight_layout == "onednn+checkpoint" and plain.weight_layout == "checkpoint"
    prompts = [([5, 9, 13, 2, 7], 0, [0, 1]), ([3, 4, 6], 0, [2, 3])]
    steps = [build_batch(prompts, 4), build_batch([([11], 5, [0, 1]), ([12], 3, [2, 3])], 4),
             build_batch([([14], 6, [0, 1])], 4)]                        # one sequence's step: one row
    for batch in steps:
        torch.testing.assert_close(laid_out.forward(batch), plain.forward(batch), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(laid_out.kv, plain.kv, rtol=1e-4, atol=1e-5)
    assert laid_out.traced_graphs == ["batch", "single"]
    graph = str(laid_out._graphs._graphs["batch"].graph)
    assert "packed_matmul" in graph and "aten::linear" not in graph      # oneDNN's call, scripted
    graph = str(laid_out._graphs._graphs["single"].graph)                # one row: MKL, the checkpoint's layout
    assert "aten::linear" in graph and "packed_matmul" not in graph


@onednn
def test_a_one_row_step_takes_the_checkpoint_layout_where_the_machine_says_so_and_the_copy_is_small(tiny, monkeypatch):
    config, weights = tiny
    monkeypatch.setattr("inferd.decoder_weights.one_row_prefers_checkpoint", lambda *layers: True)
    prepared = DecoderWeights.prepare(config, weights)
    assert prepared.one_row is not None and prepared.layout == "onednn+checkpoint"
    head, layers = prepared.one_row
    assert not head.is_mkldnn and not any(w.is_mkldnn for layer in layers for w in layer if w is not None)
    assert torch.equal(layers[0][3], weights["model.layers.0.self_attn.o_proj.weight"])
    monkeypatch.setattr("inferd.decoder_weights.ONE_ROW_COPY_BYTES", 1024)     # a model too large for the copy
    assert DecoderWeights.prepare(config, weights).layout == "onednn"
    monkeypatch.undo()
    monkeypatch.setattr("inferd.decoder_weights.one_row_prefers_checkpoint", lambda *layers: False)
    assert DecoderWeights.prepare(config, weights).layout == "onednn"         # where oneDNN is as fast at one row
    assert DecoderWeights.prepare(config, weights, pack=False).one_row is None  # nothing laid out: one layout


@onednn
def test_the_machine_is_asked_once_per_process_for_a_set_of_shapes(tiny, monkeypatch):
    config, weights = tiny
    checkpoint = DecoderWeights.prepare(config, weights, pack=False).layers[0]
    laid_out = DecoderWeights.prepare(config, weights, one_row=False).layers[0]
    first = one_row_prefers_checkpoint(checkpoint, laid_out)
    assert isinstance(first, bool)
    def timed_again(*args: object) -> None:
        raise AssertionError("the machine was asked again")
    monkeypatch.setattr("inferd.decoder_weights.linear", timed_again)
    assert one_row_prefers_checkpoint(checkpoint, laid_out) is first


def test_decoders_built_on_prepared_weights_share_them_and_refuse_another_device(tiny):
    """As inferd serve builds one decoder per attachment to memd: the weights are prepared once."""
    config, weights = tiny
    prepared = DecoderWeights.prepare(config, weights)
    pool = torch.zeros(8, *config.page_shape(4))
    first, second = PagedDecoder(config, prepared, pool), PagedDecoder(config, prepared, pool)
    assert first.layers is second.layers is prepared.layers and first.lm_head is prepared.lm_head
    assert first.flops_per_token() == PagedDecoder(config, weights, pool, pack_weights=False).flops_per_token()
    with pytest.raises(ValueError, match="prepared on cpu"):
        PagedDecoder(config, prepared, pool, device="meta")
