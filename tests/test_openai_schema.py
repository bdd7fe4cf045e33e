"""What the OpenAI API accepts, and how it refuses the rest: checked before anything runs."""

from __future__ import annotations

import pytest

from inferd.openai_schema import ApiError, ChatBody, CompletionBody, parse

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(kind, body) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(kind, body)
    assert err.value.status == 400
    return err.value


def test_nulls_are_the_defaults_and_a_reply_appended_as_the_client_dumps_it_is_accepted():
    reply = {"role": "assistant", "content": "hello", "refusal": None, "annotations": [], "audio": None,
             "function_call": None, "tool_calls": None}           # openai's ChatCompletionMessage.model_dump()
    body = parse(ChatBody, CHAT | {"n": None, "stream": None, "logprobs": None, "temperature": None,
                                   "messages": [*CHAT["messages"], reply], "repetition_penalty": 1.0})
    assert body.n == 1 and body.stream is False and body.logprob_count() is None
    assert body.messages[1].as_dict() == {"role": "assistant", "content": "hello"}
    parts = parse(ChatBody, CHAT | {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]})
    assert parts.messages[0].as_dict()["content"][0]["text"] == "hi"


@pytest.mark.parametrize(("body", "param", "words"), [
    (CHAT | {"logit_bias": {"1": 2}}, "logit_bias", "unsupported parameter"),
    (CHAT | {"tools": [{"type": "function"}]}, "tools", "unsupported parameter"),
    (CHAT | {"repetition_penalty": 1.1}, "repetition_penalty", "only 1"),
    (CHAT | {"presence_penalty": 0.5}, "presence_penalty", "only 0"),
    (CHAT | {"stream_options": {"include_usage": True}}, None, "stream: true"),
    (CHAT | {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]},
     "messages.0.tool_calls", "not supported"),
    (CHAT | {"n": 17}, "n", "16"),
    ({"messages": CHAT["messages"]}, "model", "missing"),
    (CHAT | {"top_logprobs": 2}, "top_logprobs", "logprobs"),
])
def test_a_body_users_get_wrong_is_a_400_naming_the_field(body, param, words):
    if param == "top_logprobs":
        with pytest.raises(ApiError) as err:
            parse(ChatBody, body).logprob_count()
        error = err.value
    else:
        error = refused(ChatBody, body)
    assert error.param == param and words in error.message


def test_completions_refuse_what_they_cannot_do_by_name():
    assert refused(CompletionBody, {"model": "m", "prompt": "x", "echo": True}).param == "echo"
    assert refused(CompletionBody, {"model": "m", "prompt": "x", "suffix": "y"}).param == "suffix"
    assert refused(ChatBody, []).message == "the request body must be a JSON object"


def test_logprob_bytes_are_each_tokens_own_even_inside_a_character(checkpoint):
    from inferd.checkpoint import load_tokenizer
    from inferd.openai_api import token_bytes

    tokenizer = load_tokenizer(checkpoint)
    text = "héllo wörld 日本 ✓"
    ids = tokenizer.encode(text).ids
    pieces = [token_bytes(tokenizer, i) for i in ids]
    assert b"".join(pieces).decode() == text
    assert any(piece and not piece.decode(errors="ignore") for piece in pieces)   # some hold half a character
