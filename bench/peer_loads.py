"""The loads `bench_peer.py` puts on either server: the same client, the same requests, the same order.

The client is the official `openai` async package, streaming, greedy, with
`ignore_eos` so every reply has the length asked for. A chat user resends the
whole conversation every turn, as OpenAI clients do, with its `X-Session-Id`
(kvpool parks the conversation between turns; vLLM ignores the header), and
thinks between turns. Times are taken where the client sees them: time to
first token from the request to the first chunk with text, inter-token latency
between chunks with text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import openai
from bench_http_chat import pct, streamed_chat

Filler = Callable[[int, str], str]     # (tokens, leading text) -> a text of that many tokens starting so
QUESTIONS = ["What does the memory manager do?", "And what happens when a worker crashes?",
             "How are cold sessions swapped out?", "What is time to first token?", "Why share prefixes?",
             "What does a block table hold?", "Which sessions are evicted first?", "How is a page checked?"]


@dataclass(frozen=True)
class Chat:
    """Users chatting at once; `prompts` system prompts, user i takes number i % prompts."""
    users: int
    turns: int
    think_s: float
    max_tokens: int
    system: list[str]            # the system prompts, shared by groups of users
    question_tokens: int = 0     # each question padded to this many tokens (a long turn), 0 = as it is
    name: str = ""               # the load's own: user i's session is "<name>-user-<i>", never another load's


@dataclass
class Observed:
    ttft_first: list[float] = field(default_factory=list)       # seconds, turn 1
    ttft_later: list[float] = field(default_factory=list)       # seconds, turns >= 2
    itl: list[float] = field(default_factory=list)              # seconds between chunks with text
    tokens: int = 0
    prompt_later: int = 0
    cached_later: int = 0
    wall_s: float = 0.0


def question(chat: Chat, user: int, turn: int, filler: Filler) -> str:
    text = f"User {user}, turn {turn}: {QUESTIONS[(user + turn) % len(QUESTIONS)]}"
    return filler(chat.question_tokens, text) if chat.question_tokens else text


async def one_user(client: openai.AsyncOpenAI, model: str, chat: Chat, user: int, seen: Observed,
                   filler: Filler) -> None:
    messages = [{"role": "system", "content": chat.system[user % len(chat.system)]}]
    for turn in range(chat.turns):
        if turn and chat.think_s:
            await asyncio.sleep(chat.think_s)         # the user reads and types: think time, not a wait
        messages.append({"role": "user", "content": question(chat, user, turn, filler)})
        first, reply, usage = await streamed_chat(client, model, messages, chat.max_tokens, seen.itl,
                                                  {"X-Session-Id": f"{chat.name}-user-{user}"})
        messages.append({"role": "assistant", "content": reply})
        (seen.ttft_later if turn else seen.ttft_first).append(first)
        seen.tokens += usage.completion_tokens
        if turn:
            seen.prompt_later += usage.prompt_tokens
            details = usage.prompt_tokens_details
            seen.cached_later += (details.cached_tokens or 0) if details is not None else 0


async def chat_load(url: str, model: str, chat: Chat, filler: Filler) -> Observed:
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as client:
        seen = Observed()
        started = time.perf_counter()
        await asyncio.gather(*[one_user(client, model, chat, user, seen, filler) for user in range(chat.users)])
        seen.wall_s = time.perf_counter() - started
        return seen


@dataclass
class Decoded:
    tokens: int            # tokens after each request's first
    span_s: float          # first chunk of the earliest to last chunk of the latest
    texts: list[str]


async def decode_load(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> Decoded:
    """`prompts` at once through /v1/completions: decode tokens/s over the window all of them decode in."""
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as client:
        async def one(prompt: list[int]) -> tuple[float, float, int, str]:
            first = last = 0.0
            text, count = "", 0
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                     stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    count = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].text:
                    last = time.perf_counter()
                    first = first or last
                    text += chunk.choices[0].text
            if count != max_tokens:
                raise RuntimeError(f"{count} tokens came of {max_tokens}")
            return first, last, count, text

        runs = await asyncio.gather(*[one(p) for p in prompts])
    return Decoded(sum(count - 1 for _, _, count, _ in runs), max(r[1] for r in runs) - min(r[0] for r in runs),
                   [text for *_, text in runs])


def summary(seen: Observed) -> dict[str, float]:
    return {"ttft1_p50_s": pct(seen.ttft_first, 50), "ttft2_p50_s": pct(seen.ttft_later, 50),
            "ttft2_p99_s": pct(seen.ttft_later, 99), "itl_p50_ms": 1000 * pct(seen.itl, 50),
            "itl_p99_ms": 1000 * pct(seen.itl, 99), "output_tok_s": seen.tokens / seen.wall_s,
            "wall_s": seen.wall_s,
            "cached_share_later": seen.cached_later / seen.prompt_later if seen.prompt_later else 0.0}
