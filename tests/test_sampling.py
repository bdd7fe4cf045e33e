"""The choice of the next token."""

from __future__ import annotations

import pytest
import torch

from inferd.sampling import BadParams, SamplingParams, argmax_rows, sample

LOGITS = torch.tensor([[0.0, 3.0, 2.5, -1.0, 1.0]])


def draws(params: SamplingParams, n: int = 400) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    return {sample(LOGITS, [params], [gen])[0] for _ in range(n)}


def test_greedy_takes_the_top_token_of_each_row():
    logits = torch.tensor([[0.1, 0.9, 0.0], [2.0, -1.0, 1.0]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [None, None]) == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_argmax_of_each_row_is_torchs_ties_and_nan_included(dtype):
    logits = torch.randn(16, 4096, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits[3, 10] = logits[3, 20] = logits[3, 30] = 100.0            # a tie: the first one wins
    logits[5, 7] = logits[5, 9] = float("nan")                        # NaN counts as the largest, first one wins
    logits[6] = float("-inf")
    expected = logits.argmax(-1).tolist()
    assert argmax_rows(logits) == expected and expected[3] == 10 and expected[5] == 7 and expected[6] == 0
    assert argmax_rows(logits[2:9:3]) == logits[2:9:3].argmax(-1).tolist()            # rows of a larger tensor


def test_top_k_and_top_p_cut_the_tail():
    assert draws(SamplingParams(temperature=1.0, top_k=1)) == {1}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {1, 2}
    # softmax: token 1 ~ 0.53, token 2 ~ 0.32: top_p 0.5 keeps only token 1, 0.8 keeps both
    assert draws(SamplingParams(temperature=1.0, top_p=0.5)) == {1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.8)) == {1, 2}
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}


def test_a_seed_repeats_and_temperature_sharpens():
    seq = [sample(LOGITS, [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(9)])[0]
           for _ in range(5)]
    assert len(set(seq)) == 1
    assert draws(SamplingParams(temperature=0.05)) == {1}


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(max_tokens=0), "max_tokens"), (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"), (SamplingParams(top_k=-2), "top_k"), (SamplingParams(stop=("",)), "stop"),
    (SamplingParams(n=0), "n must"), (SamplingParams(n=17), "n must"),
])
def test_nonsense_parameters_are_refused(params, message):
    with pytest.raises(BadParams, match=message):
        params.check()


def test_seeds_must_fit_a_torch_generator_for_every_completion():
    SamplingParams(seed=2**63 - 1).check()
    with pytest.raises(BadParams, match="seed"):
        SamplingParams(seed=2**63 - 1, n=2).check()
    with pytest.raises(BadParams, match="seed"):
        SamplingParams(seed=-1).check()
