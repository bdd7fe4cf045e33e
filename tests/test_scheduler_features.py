"""Request features the OpenAI layer asks of the scheduler: logprobs, min_tokens, whole-conversation sessions.

All run the real scheduler on an in-process memd, and judge answers against `transformers` on the same weights.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from scheduling import BS, assert_clean, collect, greedy, on_step

from inferd.requests import Event, TokenLogprob
from inferd.sampling import BadParams, SamplingParams, hold_eos, token_logprobs
from inferd.scheduler import GenerationError, Request
from shared.ops import Open

pytest.importorskip("transformers")

TOL = 1e-4      # paged fp32 against transformers fp32: different summation orders move logits by ~1e-5


async def answer(scheduler, prompt: list[int], n: int) -> tuple[list[int], str]:
    """The greedy answer's tokens and text, with no stop and no minimum."""
    request = Request(prompt, greedy(n))
    scheduler.submit(request)
    tokens, text, _ = await collect(request)
    return tokens, text


async def events_of(request: Request) -> list[Event]:
    """Every event up to the request's final one (n = 1)."""
    events = []
    while True:
        events.append(await asyncio.wait_for(request.events.get(), 120))
        if events[-1].finish_reason or events[-1].error:
            return events


def assert_matches_reference(judge, context: list[int], logprob: TokenLogprob, k: int) -> None:
    """`logprob` is the raw log_softmax of transformers' logits after `context`, alternatives included."""
    expected = torch.log_softmax(judge.logits(context), -1)
    assert logprob.logprob == pytest.approx(float(expected[logprob.token_id]), abs=TOL)
    assert len(logprob.top) == k
    values = [value for _, value in logprob.top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(expected.topk(k).values.tolist(), abs=TOL)
    for token_id, value in logprob.top:                 # ids checked by value: a tie may order them either way
        assert value == pytest.approx(float(expected[token_id]), abs=TOL)


# ---- logprobs ------------------------------------------------------------------------------------------


async def test_greedy_logprobs_are_the_models_raw_log_softmax(served, judge):
    memd, scheduler = served
    prompt = [10, 20, 30, 40, 50, 60, 70]
    asked = Request(prompt, greedy(8, logprobs=3))
    plain = Request(list(range(80, 91)), greedy(8))      # in the same batches, and asks for nothing
    scheduler.submit(asked)
    scheduler.submit(plain)
    events, plain_events = await asyncio.gather(events_of(asked), events_of(plain))
    tokens = [t for e in events for t in e.token_ids]
    judge.assert_greedy(prompt, tokens, 8)
    for event in events:
        if not event.token_ids:
            assert event.logprobs is None and event.finish_reason == "length"
            continue
        assert event.logprobs is not None and len(event.logprobs) == len(event.token_ids)
    logprobs = [lp for e in events for lp in e.logprobs or []]
    assert [lp.token_id for lp in logprobs] == tokens
    for position, lp in enumerate(logprobs):
        assert lp.logprob == pytest.approx(lp.top[0][1], abs=TOL)      # greedy took the likeliest
        assert_matches_reference(judge, prompt + tokens[:position], lp, 3)
    assert all(e.logprobs is None for e in plain_events)
    await assert_clean(memd)


async def test_logprobs_zero_gives_the_chosen_tokens_alone(served, judge):
    _, scheduler = served
    prompt = [5, 6, 7, 8, 9]
    request = Request(prompt, SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, logprobs=0))
    scheduler.submit(request)
    events = await events_of(request)
    tokens = [t for e in events for t in e.token_ids]
    logprobs = [lp for e in events for lp in e.logprobs or []]
    assert [lp.token_id for lp in logprobs] == tokens and len(tokens) == 5
    for position, lp in enumerate(logprobs):          # sampled at temperature 1, reported raw all the same
        assert lp.top == []
        expected = torch.log_softmax(judge.logits(prompt + tokens[:position]), -1)
        assert lp.logprob == pytest.approx(float(expected[lp.token_id]), abs=TOL)


async def test_no_logprobs_asked_none_given(served):
    _, scheduler = served
    request = Request([1, 2, 3], greedy(4))
    scheduler.submit(request)
    assert all(e.logprobs is None for e in await events_of(request))


async def test_n_completions_each_carry_their_logprobs(served, judge):
    memd, scheduler = served
    prompt = list(range(40, 58))
    request = Request(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=100, ignore_eos=True, n=2,
                                             logprobs=2))
    scheduler.submit(request)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[TokenLogprob]] = {0: [], 1: []}
    finished = 0
    while finished < 2:
        event = await asyncio.wait_for(request.events.get(), 120)
        assert event.error is None, event.error
        finished += event.finish_reason is not None
        if event.token_ids:
            assert event.logprobs is not None and len(event.logprobs) == len(event.token_ids)
            tokens[event.index] += event.token_ids
            logprobs[event.index] += event.logprobs
    for index in (0, 1):                      # the child's first token came from the parent's logits
        assert len(tokens[index]) == 6 and [lp.token_id for lp in logprobs[index]] == tokens[index]
        for position, lp in enumerate(logprobs[index]):
            assert_matches_reference(judge, prompt + tokens[index][:position], lp, 2)
    parent_top, child_top = logprobs[0][0].top, logprobs[1][0].top
    assert [t for t, _ in parent_top] == [t for t, _ in child_top]
    assert [v for _, v in parent_top] == pytest.approx([v for _, v in child_top], abs=1e-6)
    await assert_clean(memd)


def test_token_logprobs_shares_one_row_among_choices():
    logits = torch.tensor([[0.0, 3.0, 2.5, -1.0, 1.0]])
    expected = torch.log_softmax(logits[0], -1)
    first, second = token_logprobs(logits, [2, 4], [2, 1])
    assert (first.token_id, second.token_id) == (2, 4)
    assert first.logprob == pytest.approx(float(expected[2])) and second.logprob == pytest.approx(float(expected[4]))
    assert [t for t, _ in first.top] == [1, 2] and [t for t, _ in second.top] == [1]


# ---- min_tokens ----------------------------------------------------------------------------------------


def early_eos_prompt(judge, eos: int, within: int = 3) -> tuple[list[int], list[int]]:
    """A prompt whose greedy answer (EOS not ending it) holds EOS among its first `within` tokens."""
    for t in range(3, 512):
        prompt = [t, (t * 7) % 500 + 3, (t * 13) % 500 + 3]
        answer = judge.greedy(prompt, within)
        if eos in answer:
            return prompt, answer
    raise AssertionError("no prompt of the tiny model says EOS early: pick another family of prompts")


def greedy_holding_eos(judge, prompt: list[int], n: int, hold: int, eos: tuple[int, ...]) -> list[int]:
    """transformers' greedy answer with EOS masked for the first `hold` tokens, as min_tokens asks."""
    out: list[int] = []
    for _ in range(n):
        logits = judge.logits(prompt + out).clone()        # an inference tensor: not masked in place
        if len(out) < hold:
            logits[list(eos)] = float("-inf")
        out.append(int(logits.argmax()))
        if len(out) > hold and out[-1] in eos:
            break
    return out


async def test_min_tokens_holds_eos_back(served, judge):
    memd, scheduler = served
    eos = scheduler.model.config.eos_token_ids
    prompt, answer = early_eos_prompt(judge, eos[0])
    at = answer.index(eos[0])

    early = Request(prompt, SamplingParams(max_tokens=12))
    scheduler.submit(early)
    tokens, _, final = await collect(early)
    assert final.finish_reason == "stop" and tokens == answer[:at + 1]     # the case: EOS ends it early

    held = Request(prompt, SamplingParams(max_tokens=12, min_tokens=8, logprobs=1))
    scheduler.submit(held)
    events = await events_of(held)
    tokens = [t for e in events for t in e.token_ids]
    assert len(tokens) >= 8 and not set(tokens[:8]) & set(eos)
    assert events[-1].error is None and events[-1].finish_reason in ("stop", "length")
    judge.assert_same(prompt, tokens, greedy_holding_eos(judge, prompt, 12, 8, eos), "min_tokens")
    # Logprobs stay raw: the held EOS is still among the alternatives the model wanted.
    first = events[0].logprobs[0]
    if at == 0:
        assert first.top[0][0] == eos[0] and first.token_id != eos[0]

    ignoring = Request(prompt, SamplingParams(max_tokens=6, min_tokens=6, ignore_eos=True))   # EOS is a token
    scheduler.submit(ignoring)
    tokens, _, final = await collect(ignoring)
    assert final.finish_reason == "length" and tokens == judge.greedy(prompt, 6)
    await assert_clean(memd)


async def test_min_tokens_passes_over_an_early_stop_string(served):
    memd, scheduler = served
    prompt = [1, 2, 3]
    probe_tokens, text = await answer(scheduler, prompt, 10)
    stop = next(text[i:i + 2] for i in range(len(text) - 1) if text.count(text[i:i + 2]) == 1)
    cut = text.find(stop)
    assert cut + len(stop) <= len(scheduler.tokenizer.decode(probe_tokens[:4])), "the stop should end by token 4"

    plain = Request(prompt, greedy(10, stop=(stop,)))
    scheduler.submit(plain)
    tokens, shown, final = await collect(plain)
    assert final.finish_reason == "stop" and shown == text[:cut] and len(tokens) < 10     # the case

    held = Request(prompt, greedy(10, stop=(stop,), min_tokens=5))
    scheduler.submit(held)
    tokens, shown, final = await collect(held)
    assert final.finish_reason == "length" and tokens == probe_tokens and shown == text   # it appears once only
    await assert_clean(memd)


async def test_a_stop_string_after_min_tokens_still_ends_it(served):
    _, scheduler = served
    prompt = [1, 2, 3]
    probe_tokens, text = await answer(scheduler, prompt, 12)
    late = len(scheduler.tokenizer.decode(probe_tokens[:6]))          # text the first 6 tokens make
    start = next(i for i in range(late, len(text) - 1) if text.count(text[i:i + 2]) == 1)
    stop = text[start:start + 2]
    request = Request(prompt, greedy(12, stop=(stop,), min_tokens=3))
    scheduler.submit(request)
    _, shown, final = await collect(request)
    assert final.finish_reason == "stop" and shown == text[:start]


def test_hold_eos_masks_only_rows_short_of_min_tokens():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0], [0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = [SamplingParams(min_tokens=2), SamplingParams(min_tokens=2), SamplingParams(),
              SamplingParams(min_tokens=2, ignore_eos=True)]
    masked = hold_eos(logits, params, [1, 2, 0, 0], (1,))
    assert masked[:, 1].tolist() == [float("-inf"), 5.0, 5.0, 5.0]
    assert logits[0, 1] == 5.0                                              # the raw rows stay for logprobs
    assert hold_eos(logits, params[1:3], [2, 0], (1,)) is logits           # nothing held: no copy


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(logprobs=21), "logprobs"), (SamplingParams(logprobs=-1), "logprobs"),
    (SamplingParams(min_tokens=-1), "min_tokens"), (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
])
def test_out_of_range_feature_parameters_are_refused(params, message):
    with pytest.raises(BadParams, match=message):
        params.check()
    SamplingParams(logprobs=20, max_tokens=5, min_tokens=5).check()


# ---- whole_history ------------------------------------------------------------------------------------


async def turn(scheduler, conversation: list[int], session: str | None = "c", n: int = 6):
    request = Request(conversation, greedy(n), session_id=session, whole_history=session is not None)
    scheduler.submit(request)
    tokens, _, final = await collect(request)
    assert final.error is None, final.error
    return tokens, final.usage


async def test_a_resent_conversation_reuses_the_session_and_an_edit_answers_like_a_fresh_run(served, judge):
    memd, scheduler = served
    prompt = [10, 20, 30, 40, 50, 60, 70]
    out1, usage1 = await turn(scheduler, prompt)
    assert usage1["prompt_tokens"] == len(prompt) and usage1["cached_tokens"] == 0
    judge.assert_greedy(prompt, out1, 6)

    conversation = prompt + out1 + [80, 90, 100]
    out2, usage2 = await turn(scheduler, conversation)
    assert usage2["prompt_tokens"] == len(conversation)
    assert usage2["cached_tokens"] == len(prompt + out1) - 1     # turn 1's last sampled token was never computed
    judge.assert_greedy(conversation, out2, 6)
    await assert_clean(memd, parked=1)

    again, usage = await turn(scheduler, conversation)           # the same conversation resent: regenerate
    assert usage["prompt_tokens"] == len(conversation) and 0 < usage["cached_tokens"] < len(conversation)
    judge.assert_same(conversation, again, out2, "regenerated")

    edited = conversation + out2 + [110, 120]
    edited[5] = 400                                              # an early message changed
    fresh, _ = await turn(scheduler, edited, session=None)
    out3, usage3 = await turn(scheduler, edited)
    # Nothing of the session's own K/V past the edit; past it, the blocks the fresh run just computed of these
    # very tokens, from the prefix cache (every full block but the one holding the last token).
    assert usage3["prompt_tokens"] == len(edited) and usage3["cached_tokens"] == (len(edited) - 1) // BS * BS
    judge.assert_same(edited, out3, fresh, "edited conversation")
    judge.assert_greedy(edited, out3, 6)
    stats = await assert_clean(memd, parked=1)
    assert stats.used_blocks > 0

    out4, usage4 = await turn(scheduler, edited + out3 + [7])   # and it goes on from the edited one
    assert usage4["cached_tokens"] == len(edited + out3) - 1
    judge.assert_greedy(edited + out3 + [7], out4, 6)
    await assert_clean(memd, parked=1)


async def test_a_conversation_resent_with_a_reply_that_differs_mid_block_keeps_the_kv_before_it(served, judge):
    """A client resends the reply as text, and text tokenizes otherwise than it was sampled more often than
    not: the history differs from the session's inside a full block. The K/V before that point is kept (the
    block is copied: it is in the prefix cache and never written again), not rounded down to whole blocks."""
    memd, scheduler = served
    prompt = [11, 21, 31, 41, 51, 61]
    out1, _ = await turn(scheduler, prompt, session="mid", n=9)
    cut = len(prompt) + 3                                        # a full block holds prompt[4:6] + out1[0:2]
    assert cut % BS and cut // BS < (len(prompt) + len(out1) - 1) // BS
    resent = prompt + out1[:3] + [(out1[3] + 1) % 256, 5, 6, 7]  # the reply "retokenized" from its 4th token
    out2, usage = await turn(scheduler, resent, session="mid")
    assert usage["cached_tokens"] == cut                         # was cut // BS * BS: 1 to BS-1 tokens again
    judge.assert_greedy(resent, out2, 6)
    await assert_clean(memd, parked=1)


async def test_whole_history_needs_a_session(served):
    _, scheduler = served
    with pytest.raises(GenerationError, match="whole_history") as err:
        scheduler.submit(Request([1, 2, 3], greedy(3), whole_history=True))
    assert err.value.code.name == "INVALID_ARGUMENT" and not scheduler.waiting


async def test_a_memd_that_appends_the_conversation_fails_the_turn(served):
    """A memd that ignores whole_history (an older one) would answer a conversation nobody sent."""
    memd, scheduler = served
    await turn(scheduler, [10, 20, 30, 40, 50])
    original = scheduler.client.step

    async def step(*ops, **kwargs):
        ops = tuple(replace(op, whole_history=False) if isinstance(op, Open) else op for op in ops)
        return await original(*ops, **kwargs)
    scheduler.client.step = step
    request = Request([10, 20, 30, 40, 50, 60], greedy(3), session_id="c", whole_history=True)
    scheduler.submit(request)
    tokens, _, final = await collect(request)
    assert tokens == [] and final.error is not None and final.error.code.name == "FAILED_PRECONDITION"
    scheduler.client.step = original
    stats = await assert_clean(memd, parked=0)                   # the muddled history is freed
    assert stats.used_blocks == 0



async def test_completions_forked_after_a_cancel_end_at_once(served):
    memd, scheduler = served
    request = Request([5, 6, 7, 8, 9], SamplingParams(max_tokens=50, n=3, ignore_eos=True, temperature=1.0, seed=1))

    async def cancel_once_admitted(ops) -> None:
        if any(isinstance(op, Open) for op in ops):
            scheduler.cancel(request)                # the client hangs up while its prompt is prefilled
    on_step(scheduler.client, cancel_once_admitted)
    scheduler.submit(request)
    finals = []
    while len(finals) < 3:
        event = await asyncio.wait_for(request.events.get(), 60)
        if event.finish_reason is not None or event.error is not None:
            finals.append(event)
    assert {e.finish_reason for e in finals} <= {"cancelled"}
    assert all(e.usage["completion_tokens"] <= 1 for e in finals)             # nobody decodes for no one
    await assert_clean(memd)


@pytest.mark.parametrize("stop_at", [None, "length"])
async def test_streamed_text_is_decoded_a_token_at_a_time_and_holds_half_characters(served, stop_at):
    """Each token's text is what it adds to the whole: a token ending inside a UTF-8 character shows
    nothing until the character is whole, and the deltas join into exactly the tokenizer's decode."""
    _, scheduler = served
    text = "héllo wörld 日本 ✓ café"
    ids = scheduler.tokenizer.encode(text).ids
    cut = len(ids) - 1 if stop_at == "length" else len(ids)
    request = Request([1, 2, 3], greedy(cut))
    deltas = []
    for token in ids[:cut]:                      # as _forward hands each sampled token on
        request.seq.tokens.append(token)
        request.generated.append(token)
        scheduler._emit(request, token)
        deltas.append(request.events.get_nowait().text)
    assert "".join(deltas) == scheduler.tokenizer.decode(ids[:cut])
    assert all("\ufffd" not in d for d in deltas[:-1]) and "" in deltas[:-1]    # some token held half a character
