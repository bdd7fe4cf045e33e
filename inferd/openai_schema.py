"""The OpenAI API's request bodies, checked, and its error shape.

A body is checked before anything runs: a field out of range, of the wrong
type or unknown is a 400 that names it (an unsupported parameter is never
silently ignored: a client that asks for `logit_bias` must learn it got none).
The extra parameters vLLM accepts (`top_k`, `ignore_eos`, `min_tokens`) are
taken from the body as vLLM takes them.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.http_exchange import ApiError

MAX_SEED = 2**63 - 1          # torch generators take a signed 64-bit seed
MAX_N = 16
MAX_LOGPROBS = 20
MAX_SALT = 128


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (its choice's tokens), not only the last.
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Penalties are not implemented: their neutral values are accepted (clients send them by default;
    # vLLM's bench sends repetition_penalty 1.0).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    # vLLM's: the prompt's prefix-cache namespace. A prompt never reuses K/V cached under another salt (or
    # none), here or in the cluster store: one tenant cannot time another's prompts by their cache hits.
    cache_salt: str | None = None
    # OpenAI's: how long to keep the prompt's cache. "in_memory" (the default) promises nothing; a duration
    # ("24h", "30m", "90s") keeps the X-Session-Id session that long: swapped perhaps, never dropped.
    prompt_cache_retention: str | None = None

    @field_validator("prompt_cache_retention")
    @classmethod
    def _retention(cls, value: str | None) -> str | None:
        retention_seconds(value)          # a ValueError names what is accepted
        return value

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, salt: str | None) -> str | None:
        if salt is not None and (not salt or len(salt) > MAX_SALT or any(c in salt for c in "@/\\\0")):
            raise ValueError(f"1 to {MAX_SALT} characters, none of @ / \\ or NUL (as vLLM takes it)")
        return salt

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 stop strings, none empty")
        return stops

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _neutral(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported (only 0)")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _neutral_repetition(cls, value: float | None) -> float | None:
        if value is not None and value != 1.0:
            raise ValueError("penalties are not supported (only 1)")
        return value

    @model_validator(mode="after")
    def _options_need_a_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())        # the validator made it a list


class ContentPart(BaseModel):
    """A part of a message's content; kinds other than text are refused by the chat template, by name."""

    model_config = ConfigDict(extra="allow")       # e.g. cache_control, which gateways add
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # What a client that appends `response.choices[0].message` sends back: accepted while empty.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    tool_calls: list[Any] | None = None
    reasoning_content: str | None = None

    @field_validator("audio", "function_call", "tool_calls")
    @classmethod
    def _empty(cls, value: Any) -> Any:
        if value:
            raise ValueError("tool calls and audio are not supported")
        return value

    def as_dict(self) -> dict[str, Any]:
        """For the chat template (parts are kept as dicts; the template module joins text parts)."""
        out: dict[str, Any] = {"role": self.role}
        if isinstance(self.content, list):
            out["content"] = [part.model_dump(exclude_none=True) for part in self.content]
        else:
            out["content"] = self.content or ""
        for key in ("name", "tool_call_id", "reasoning_content"):
            if (value := getattr(self, key)) is not None:
                out[key] = value
        return out


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True            # vLLM's: continue the last message instead when False
    return_tokens_as_token_ids: bool = False      # vLLM's: logprobs name tokens "token_id:N", not by text

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    return_tokens_as_token_ids: bool = False

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value:
            raise ValueError("not supported")
        return value

    def token_budget(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        return self.logprobs


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages under the template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


Body = TypeVar("Body", bound=BaseModel)


def parse(kind: type[Body], raw: Any) -> Body:
    """The body as `kind`, or a 400 naming the first field that is wrong."""
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object")
    raw = {key: value for key, value in raw.items() if value is not None}     # null: the default, as OpenAI's
    try:
        return kind.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise ApiError(400, f"unsupported parameter: {param}", param=param,
                           code="unsupported_parameter") from None
        if error["type"] == "missing":
            raise ApiError(400, f"missing required parameter: {param}", param=param) from None
        message = error["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"invalid {param or 'request'}: {message}", param=param) from None


RETENTION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_RETENTION_S = 86400                   # OpenAI's longest, 24h


def retention_seconds(value: str | None) -> float:
    """A retention as OpenAI and the X-Session-Retention header write it: 0 for none ("in_memory")."""
    if value is None or value in ("in_memory", "in-memory"):
        return 0.0
    found = RETENTION.fullmatch(value.strip())
    seconds = float(found[1]) * UNIT_S[found[2]] if found else 0.0
    if not 0 < seconds <= MAX_RETENTION_S:
        raise ValueError(f"a retention is in_memory or a duration up to 24h (90s, 30m, 24h), not {value!r}")
    return seconds
