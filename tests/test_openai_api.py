"""inferd's OpenAI-compatible HTTP API, driven by the clients users run (openai, httpx) on memd + inferd processes."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from inferd.tiny import CORPUS, make_tiny_model
from tests.test_inferd_service import memd_state, wait_until

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

KEY = "sekret"
MODEL = "tiny"
SYSTEM = "You are a helpful assistant for a serving team.\n" + CORPUS


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def template_ids(hf_tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt transformers builds from the checkpoint's chat template."""
    out = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


async def start_stack(memd_factory, inferd_factory, model_dir: Path, *args: str):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                              "--block-size", "16")
    inferd = await inferd_factory(model_dir, memd.address, "--http", "127.0.0.1:0", "--api-key", KEY,
                                  "--served-model-name", MODEL, *args)
    url = f"http://{(await inferd.log.wait_for('inferd ready'))['http']}"
    return memd, inferd, url


@pytest.fixture
async def api(memd_factory, inferd_factory, model_dir):
    return await start_stack(memd_factory, inferd_factory, model_dir)


def ids_of(choice: Any) -> list[int]:
    """The generated token ids, from logprobs named by id (vLLM's return_tokens_as_token_ids)."""
    return [int(entry.token.removeprefix("token_id:")) for entry in choice.logprobs.content]


GREEDY = {"temperature": 0, "logprobs": True, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}


@pytest.mark.parametrize("session", [None, "chat-1"], ids=["stateless", "x-session-id"])
async def test_a_two_turn_chat_answers_as_transformers_does_and_reuses_turn_one(api, model_judge, hf_tokenizer,
                                                                                  session):
    memd, _inferd, url = api
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    headers = {"X-Session-Id": session} if session else {}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does memd do?"}]
    first = await asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=8,
                                    extra_headers=headers, **GREEDY)
    prompt1, got1 = template_ids(hf_tokenizer, messages), ids_of(first.choices[0])
    model_judge.assert_greedy(prompt1, got1, 8, "turn 1")
    assert first.choices[0].message.content == hf_tokenizer.decode(got1)
    assert first.usage.prompt_tokens == len(prompt1) and first.usage.completion_tokens == 8
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And when a worker crashes?"}]
    second = await asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=8,
                                     extra_headers=headers, **GREEDY)
    prompt2 = template_ids(hf_tokenizer, messages)
    model_judge.assert_greedy(prompt2, ids_of(second.choices[0]), 8, "turn 2")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens == len(prompt2)
    assert len(prompt1) - 16 <= cached < len(prompt2)           # most of turn 1, none of what is new
    if session:                                                # the session kept turn 1's partial block too
        assert cached >= common_prefix(prompt1 + got1, prompt2) - 1
    states, _, ok = await memd_state(memd)
    assert states["running"] == 0 and states["parked"] == (1 if session else 0) and ok


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def test_an_edited_conversation_reuses_only_what_still_matches(api, model_judge, hf_tokenizer):
    _memd, _inferd, url = api
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
    headers = {"X-Session-Id": "edited"}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me a story."}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_headers=headers,
                                                 **GREEDY)
    edited = [{"role": "system", "content": "You answer in French.\n" + CORPUS},     # an earlier message changed
              {"role": "user", "content": "Tell me a story."},
              {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "Another one."}]
    second = await client.chat.completions.create(model=MODEL, messages=edited, max_tokens=6, extra_headers=headers,
                                                  **GREEDY)
    prompt = template_ids(hf_tokenizer, edited)
    model_judge.assert_greedy(prompt, ids_of(second.choices[0]), 6, "edited")
    assert second.usage.prompt_tokens_details.cached_tokens < 16       # the edit is in the first block
    await client.close()


async def test_streaming_follows_openai_chunk_by_chunk(api, hf_tokenizer):
    _memd, _inferd, url = api
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
    messages = [{"role": "user", "content": "Hello! How are you today?"}]
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0.9, seed=3, n=2, stream=True,
        stream_options={"include_usage": True}, logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == len(template_ids(hf_tokenizer, messages))
    assert all(chunk.usage is None for chunk in chunks[:-1])
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
        assert mine[-1].delta.content is not None and mine[-1].logprobs is not None   # rides on the last token
        ids = [int(e.token.removeprefix("token_id:")) for c in mine if c.logprobs for e in c.logprobs.content]
        assert len(ids) == 12
        # The text streamed, joined, is the detokenization of the whole answer (held-back half characters too).
        assert "".join(c.delta.content or "" for c in mine) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    await client.close()


async def test_continuous_usage_puts_each_choice_s_usage_so_far_on_every_chunk(api, hf_tokenizer):
    """vLLM's stream_options.continuous_usage_stats (aiperf's --per-chunk-usage reads it)."""
    _memd, _inferd, url = api
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
    messages = [{"role": "user", "content": "Count the pages."}]
    prompt = len(template_ids(hf_tokenizer, messages))
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, n=2, temperature=0.9, seed=1, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    await client.close()
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    for index in (0, 1):
        mine = [c for c in chunks[:-1] if c.choices[0].index == index]
        done = [c.usage.completion_tokens for c in mine]
        assert done[0] == 0 and done == sorted(done) and done[-1] == 6        # the role chunk first, then growing
        assert all(c.usage.prompt_tokens == prompt and c.usage.total_tokens == prompt + c.usage.completion_tokens
                   for c in mine)


async def test_render_gives_the_token_ids_a_request_would_run_and_runs_nothing(api, hf_tokenizer):
    """vLLM's /render endpoints, through which llm-d's router tokenizes as the server does."""
    memd, _inferd, url = api
    auth = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    async with httpx.AsyncClient(timeout=30) as http:
        chat = (await http.post(f"{url}/v1/chat/completions/render", headers=auth | {"x-request-id": "r1"},
                                json={"model": MODEL, "messages": messages, "max_tokens": 7, "seed": 5})).json()
        texts = (await http.post(f"{url}/v1/completions/render", headers=auth,
                                 json={"model": MODEL, "prompt": ["Pages of KV", "and more"], "max_tokens": 3})).json()
        refused = await http.post(f"{url}/v1/chat/completions/render", headers=auth,
                                  json={"model": "other", "messages": messages})
    assert chat["token_ids"] == template_ids(hf_tokenizer, messages) and chat["request_id"] == "chatcmpl-r1"
    assert (chat["model"], chat["sampling_params"]["max_tokens"], chat["sampling_params"]["seed"]) == (MODEL, 7, 5)
    assert [t["token_ids"] for t in texts] == [hf_tokenizer(p)["input_ids"] for p in ("Pages of KV", "and more")]
    assert [t["request_id"][-2:] for t in texts] == ["-0", "-1"]
    assert refused.status_code == 404
    async with memd.admin() as admin:
        stats = await admin.stats()
    assert stats.used_blocks == 0 and sum(stats.sequences.values()) == 0          # nothing ran


async def test_a_cache_salt_keeps_a_prompt_from_any_other_salt_s_cached_blocks(api, hf_tokenizer):
    """vLLM's cache_salt: the same prompt under another salt (or none) is computed again, under its own reused."""
    _memd, _inferd, url = api
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
    whole = len(template_ids(hf_tokenizer, messages)) // 16 * 16

    async def cached(salt: str | None) -> int:
        reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                     extra_body={"cache_salt": salt} if salt else {})
        return reply.usage.prompt_tokens_details.cached_tokens

    assert [await cached(salt) for salt in ("team-a", "team-b", None)] == [0, 0, 0]
    assert await cached("team-a") >= whole - 16 > 0 and await cached(None) >= whole - 16
    with pytest.raises(openai.BadRequestError) as refused:
        await cached("team/a")
    assert refused.value.body["param"] == "cache_salt"
    await client.close()


async def test_reset_prefix_cache_forgets_cached_prefixes_and_keeps_sessions(api, hf_tokenizer):
    """vLLM's POST /reset_prefix_cache (aiperf --reset-kv-cache): a prompt cached before is computed again after
    it, while a parked session's next turn still finds its own K/V."""
    memd, _inferd, url = api
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]

    async def cached(session: str | None = None, more: list | None = None) -> int:
        reply = await client.chat.completions.create(model=MODEL, messages=messages + (more or []), max_tokens=2,
                                                     extra_headers={"X-Session-Id": session} if session else {})
        return reply.usage.prompt_tokens_details.cached_tokens

    await cached()
    await cached("kept")
    assert await cached() > 0
    async with httpx.AsyncClient(timeout=30) as http:
        refused = await http.post(f"{url}/reset_prefix_cache", headers={"Authorization": "Bearer wrong"})
        reset = await http.post(f"{url}/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 401
    assert reset.status_code == 200 and reset.json()["success"] and reset.json()["blocks"] > 0
    assert await cached() == 0                                        # forgotten: computed again
    later = [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Again"}]
    assert await cached("kept", later) >= 16                          # the session's own pages stayed
    async with memd.admin() as admin:
        assert (await admin.check()).ok
    await client.close()


async def test_version_and_ping_answer_as_vllm_s_do(api):
    _memd, _inferd, url = api
    async with httpx.AsyncClient(timeout=10) as http:
        version = await http.get(f"{url}/version")
        assert version.status_code == 200 and version.json()["version"] == importlib.metadata.version("kvpool")
        for method in ("GET", "POST"):
            ping = await http.request(method, f"{url}/ping")
            assert ping.status_code == 200 and ping.json()["status"] == "ok"
            assert ping.json()["model"] == MODEL and ping.json()["kv_namespace"].startswith("tiny")  # kvroute reads


async def test_stop_strings_logprobs_and_the_completions_endpoint(api, model_judge, hf_tokenizer):
    _memd, _inferd, url = api
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
    prompt = "The quick brown fox"
    whole = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3,
                                            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    text = whole.choices[0].text
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    lp = whole.choices[0].logprobs
    ids = [int(token.removeprefix("token_id:")) for token in lp.tokens]
    model_judge.assert_greedy(model_judge.encode(prompt), ids, 10)
    assert hf_tokenizer.decode(ids) == text and len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and top[chosen] == logprob == max(top.values())     # greedy: the likeliest
    cut = text[3:6] or text[:1]
    stopped = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[cut],
                                              logprobs=0, extra_body={"ignore_eos": True,
                                                                      "return_tokens_as_token_ids": True})
    assert stopped.choices[0].finish_reason == "stop"
    # What it generated holds the stop string, and the answer is the text before it (this run's own tokens:
    # a second run may part from the first at a near-tie).
    generated = hf_tokenizer.decode([int(t.removeprefix("token_id:")) for t in stopped.choices[0].logprobs.tokens])
    assert cut in generated and stopped.choices[0].text == generated[:generated.index(cut)]
    await client.close()


async def test_sixteen_concurrent_streaming_chats_all_finish_and_leave_nothing(api):
    memd, _inferd, url = api
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)

    async def chat(i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Question number {i}: what is a KV cache?"}],
            max_tokens=10, temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True})
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    results = await asyncio.gather(*[chat(i) for i in range(16)])
    assert all(reason == "length" for _, reason in results)
    states, _used, ok = await memd_state(memd)
    assert states["running"] == 0 and ok
    await client.close()


async def test_a_client_hanging_up_mid_stream_gets_its_blocks_back(api):
    memd, inferd, url = api
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story about a cat."}],
            "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http, http.stream("POST", f"{url}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {KEY}", "X-Session-Id": "gone"}) as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        seen = 0
        while seen < 4:                       # a few chunks in: the turn is running in memd
            seen += (await anext(lines)).startswith("data:")

    async def released() -> bool:
        states, _, ok = await memd_state(memd)
        return states["running"] == 0 and states["parked"] == 1 and ok
    await wait_until(released)
    await inferd.log.wait_for("request cancelled by its client", session="gone")


async def test_every_error_has_its_status_and_openai_shape_and_changes_nothing(api):
    memd, inferd, url = api
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ({}, b"{not json", 400, None),
        ({}, chat | {"logit_bias": {"1": 5}}, 400, "logit_bias"),
        ({}, chat | {"temperature": "hot"}, 400, "temperature"),
        ({}, chat | {"max_tokens": 5000}, 400, "max_tokens"),
        ({}, chat | {"n": 2}, 400, None),                               # n > 1 cannot continue a session
        ({"Authorization": "Bearer wrong"}, chat, 401, None),
        ({"Authorization": ""}, chat, 401, None),
        ({}, chat | {"model": "gpt-4"}, 404, "model"),
    ]
    async with httpx.AsyncClient(timeout=60) as http:
        for headers, body, status, param in cases:
            sent = {**auth, "X-Session-Id": "errors", **headers}
            if isinstance(body, bytes):
                response = await http.post(f"{url}/v1/chat/completions", content=body, headers=sent)
            else:
                response = await http.post(f"{url}/v1/chat/completions", json=body, headers=sent)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            if param is not None:
                assert error["param"] == param and param in error["message"]
        ok = await http.post(f"{url}/v1/chat/completions", json=chat, headers=auth | {"x-request-id": "req-7"})
        assert ok.status_code == 200 and ok.headers["x-request-id"] == "req-7"
        assert ok.json()["id"] == "chatcmpl-req-7"
    await inferd.log.wait_for("request finished", request="req-7")
    states, used, healthy = await memd_state(memd)
    assert states["running"] == 0 and sum(states.values()) == 0 and used == 0 and healthy
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="nope").models.list()


async def test_models_tokenize_detokenize_and_metrics_share_the_port(api, hf_tokenizer):
    _memd, _inferd, url = api
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    messages = [{"role": "user", "content": "Hello!"}]
    auth = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=30) as http:
        tokens = (await http.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages},
                                  headers=auth)).json()
        assert tokens["tokens"] == template_ids(hf_tokenizer, messages) and tokens["count"] == len(tokens["tokens"])
        text = (await http.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, headers=auth)).json()
        assert text["prompt"] == hf_tokenizer.decode(tokens["tokens"])
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        metrics = (await http.get(f"{url}/metrics")).text
        assert 'kvpool_inferd_requests_total{finish_reason="length"} 1.0' in metrics
        assert (await http.get(f"{url}/health")).status_code == 200
    await client.close()


async def test_health_is_503_while_memd_is_away_and_200_once_it_is_back(memd_factory, inferd_factory, model_dir):
    memd, _inferd, url = await start_stack(memd_factory, inferd_factory, model_dir)
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"{url}/health")).status_code == 200
        await memd.kill()

        async def status(code: int) -> Any:
            async def check() -> bool:
                return (await http.get(f"{url}/health")).status_code == code
            return check
        await wait_until(await status(503))
        refused = await http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                                  headers={"Authorization": f"Bearer {KEY}"})
        assert refused.status_code == 503 and "memd" in refused.json()["error"]["message"]
        await memd_factory("--device", "cpu", "--pool-bytes", "8MiB", "--model", str(model_dir),
                           "--block-size", "16")
        await wait_until(await status(200), timeout=60)


async def test_a_checkpoint_without_a_chat_template_says_so_and_completions_still_work(memd_factory, inferd_factory,
                                                                                       tmp_path):
    bare = make_tiny_model(tmp_path / "bare", arch="llama", seed=5)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    _memd, _inferd, url = await start_stack(memd_factory, inferd_factory, bare)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "chat template" in str(refused.value)
    done = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert done.usage.completion_tokens <= 2
    await client.close()


async def test_a_session_in_use_is_a_409_and_a_drain_is_a_503_until_it_ends(api):
    memd, _inferd, url = api
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "temperature": 0,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=chat | {"stream": True, "max_tokens": 3000},
                               headers=auth | {"X-Session-Id": "busy"}) as long:
            lines = long.aiter_lines()
            while not (await anext(lines)).startswith("data:"):
                pass                                   # the first turn is running
            again = await http.post(f"{url}/v1/chat/completions", json=chat | {"max_tokens": 2},
                                    headers=auth | {"X-Session-Id": "busy"})
            assert again.status_code == 409 and again.json()["error"]["code"] == "session_busy"
        async with memd.admin() as admin:
            await admin.drain()
            try:
                async def draining() -> bool:
                    return (await http.get(f"{url}/health")).status_code == 503
                await wait_until(draining)
                refused = await http.post(f"{url}/v1/chat/completions", json=chat | {"max_tokens": 2}, headers=auth)
                assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
            finally:
                await admin.drain(undo=True)

        async def serving() -> bool:
            return (await http.get(f"{url}/health")).status_code == 200
        await wait_until(serving)
        done = await http.post(f"{url}/v1/chat/completions", json=chat | {"max_tokens": 2}, headers=auth)
        assert done.status_code == 200


async def test_stopping_inferd_ends_its_streams_cleanly(api):
    memd, inferd, url = api
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 3000,
            "temperature": 0, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        missing = await http.get(f"{url}/v1/nothing-here")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {KEY}"}) as response:
            lines, chunks = response.aiter_lines(), []
            while len(chunks) < 3:
                if (line := await anext(lines)).startswith("data:"):
                    chunks.append(line)
            stopping = asyncio.ensure_future(inferd.stop())            # SIGTERM, as systemctl stop sends
            chunks += [line async for line in lines if line.startswith("data:")]
    assert chunks[-1] == "data: [DONE]"
    assert json.loads(chunks[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert await stopping == 0
    states, _, ok = await memd_state(memd)
    assert states["running"] == 0 and ok
