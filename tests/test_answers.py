"""The judge of answers compared across batch shapes (tests/answers.py): ties pass, anything else fails."""

from __future__ import annotations

import pytest

from tests.answers import TIE, Divergence

PROMPT = [5, 9, 14, 3, 77, 120, 41, 8, 8, 230]


def test_agreeing_answers_pass(judge):
    answer = judge.greedy(PROMPT, 8)
    assert judge.divergence(PROMPT, answer, answer) is None
    assert judge.assert_same(PROMPT, answer, answer) and judge.assert_greedy(PROMPT, answer, 8)


def test_a_token_the_model_would_not_pick_fails_with_its_logit_gap(judge):
    answer = judge.greedy(PROMPT, 8)
    unlikely = int(judge.logits(PROMPT + answer[:3]).argmin())
    wrong = answer[:3] + [unlikely] + answer[4:]
    found = judge.divergence(PROMPT, wrong, answer)
    assert found is not None and found.position == 3 and found.got == unlikely and found.top == answer[3]
    assert found.gap > 1.0 and not found.near_tie
    with pytest.raises(AssertionError, match="first differs at token 3"):
        judge.assert_same(PROMPT, wrong, answer, "served")


def test_answers_of_other_lengths_fail(judge):
    answer = judge.greedy(PROMPT, 6)
    with pytest.raises(AssertionError, match="answers of 5 and 6 tokens"):
        judge.assert_same(PROMPT, answer[:5], answer)


def test_only_a_gap_within_fp32_noise_is_a_tie():
    assert Divergence(0, 1, 2, gap=TIE / 2, top=2, top_gap=0.0).near_tie
    assert not Divergence(0, 1, 2, gap=0.2, top=2, top_gap=0.0).near_tie
    assert not Divergence(0, 1, 2, gap=TIE / 2, top=3, top_gap=0.05).near_tie    # both lose to a third


def test_a_chat_is_compared_up_to_its_first_tie(judge):
    first = judge.greedy(PROMPT, 5)
    second = judge.greedy(PROMPT + first + [17, 18], 5)
    assert judge.assert_same_chats({"c": [(PROMPT, first, first), ([17, 18], second, second)]}) == 0
    wrong = second[:1] + [int(judge.logits(PROMPT + first + [17, 18] + second[:1]).argmin())] + second[2:]
    with pytest.raises(AssertionError, match="chat 'c', turn 1"):
        judge.assert_same_chats({"c": [(PROMPT, first, first), ([17, 18], wrong, second)]})
