"""inferd's OpenAI-compatible HTTP API: what applications, gateways and load tools speak.

Served by uvicorn on inferd's own event loop, beside gRPC, over the same
scheduler. The API is stateless: a chat client sends the whole conversation
every turn. Every request's prompt meets memd's prefix cache, so the full
blocks of an earlier turn are reused; with an `X-Session-Id` header the turn
continues that session's sequence (memd keeps the longest prefix it shares
with the conversation, its partial last block included) and is parked in
memd when it ends, as gRPC sessions are. An edited conversation reuses only
what still matches: memd compares token ids, never trusts a name.

A request ends with its HTTP exchange: a client that hangs up cancels it,
and its sequence is parked (session) or freed within a scheduler step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from grpc import StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferd.chat_template import ChatTemplate, ChatTemplateError
from inferd.completions import Completions
from inferd.engine import WorkerEngine
from inferd.metrics import InferdMetrics
from inferd.openai_schema import (
    ApiError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    parse,
    retention_seconds,
)
from inferd.requests import Event, GenerationError, Request, TokenLogprob
from inferd.sampling import BadParams, SamplingParams
from inferd.service import checked_request_id
from shared.client import MemdError
from shared.command_line import kvpool_version
from shared.http_exchange import ClientGone, or_disconnect, stream_body
from shared.tenants import Tenant, Tenants

log = structlog.get_logger("inferd.http")

# A failed request's gRPC status (GenerationError.code) as its HTTP status; any other is a 500.
HTTP_STATUS = {StatusCode.INVALID_ARGUMENT: 400, StatusCode.NOT_FOUND: 404, StatusCode.FAILED_PRECONDITION: 409,
               StatusCode.PERMISSION_DENIED: 409, StatusCode.ALREADY_EXISTS: 409, StatusCode.RESOURCE_EXHAUSTED: 503,
               StatusCode.UNAVAILABLE: 503, StatusCode.INTERNAL: 500}
# memd's reasons for a refusal (memd.errors.KvError.reason) as the error codes clients read.
API_CODES = {"session_busy": "session_busy", "retention": "retention_exceeded", "quota": "quota_exceeded",
             "model_quota": "quota_exceeded"}
BACK_OFF = {"retention", "quota", "model_quota"}
SESSION_HEADER = "x-session-id"
RETENTION_HEADER = "x-session-retention"
SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-store"),
               (b"x-accel-buffering", b"no"))       # a proxy in front (nginx) passes each chunk on at once


def _api_error(err: GenerationError) -> ApiError:
    # A tenant's own limits (a retention past its guarantee, a wait at its page max) are the client's to back off
    # from: a 429, not the 503 of a server short of memory.
    status = 429 if err.reason in BACK_OFF and err.code is StatusCode.RESOURCE_EXHAUSTED else \
        HTTP_STATUS.get(err.code, 500)
    return ApiError(status, err.message, code=API_CODES.get(err.reason))


def _retention(header: str | None, field: str | None, session: str | None) -> float:
    """Seconds to keep the session: the X-Session-Retention header's, else prompt_cache_retention's."""
    try:
        seconds = retention_seconds(header if header is not None else field)
    except ValueError as err:
        raise ApiError(400, str(err), param=RETENTION_HEADER if header is not None else "prompt_cache_retention") \
            from None
    if seconds and session is None:
        raise ApiError(400, "a retention keeps a session: send X-Session-Id with it", param="prompt_cache_retention")
    return seconds


async def _next(reader: Completions) -> Event | None:
    """The request's next event; its error as the HTTP status that says it."""
    try:
        return await reader.next()
    except GenerationError as err:
        raise _api_error(err) from None


def _finish_reason(reason: str) -> str:
    """OpenAI's names: a request ended by its client or a session reset is "abort", as vLLM says."""
    return "abort" if reason in ("cancelled", "reset") else reason


class OpenAIServer:
    def __init__(self, engine: WorkerEngine, *, served_model_name: str, tenants: Tenants,
                 template: ChatTemplate | None, metrics: InferdMetrics | None) -> None:
        self.engine, self.model_name, self.tenants = engine, served_model_name, tenants
        self.template, self.metrics = template, metrics
        self.created = int(time.time())
        self.active: set[Completions] = set()       # requests with an exchange in flight

    def close(self) -> None:
        """inferd is stopping: every request in flight is cancelled, so its answer ends within a step."""
        for reader in list(self.active):
            reader.stop()

    def app(self) -> Starlette:
        return Starlette(exception_handlers={HTTPException: _http_error}, routes=[
            Route("/v1/chat/completions", self._endpoint(self.chat), methods=["POST"]),
            Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
            Route("/v1/chat/completions/render", self._endpoint(self.render_chat), methods=["POST"]),
            Route("/v1/completions/render", self._endpoint(self.render_completions), methods=["POST"]),
            Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
            Route("/tokenize", self._endpoint(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._endpoint(self.detokenize), methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),            # vLLM's (SageMaker's) name for it
            Route("/version", self.version, methods=["GET"]),
            Route("/reset_prefix_cache", self._endpoint(self.reset_prefix_cache), methods=["POST"]),
            Route("/v1/sessions/{session_id:path}", self._endpoint(self.forget_session), methods=["DELETE"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ])

    # ---- around every API call ----------------------------------------

    def _endpoint(self, handler: Callable[[HttpRequest, str], Awaitable[Response]]
                  ) -> Callable[[HttpRequest], Awaitable[Response]]:
        async def run(http: HttpRequest) -> Response:
            request_id = None
            try:
                try:
                    request_id = checked_request_id(http.headers.get("x-request-id"))
                except GenerationError as err:
                    raise ApiError(400, err.message, param="x-request-id") from None
                http.state.tenant = self.tenants.caller(http.headers.get("authorization", ""))
                response = await handler(http, request_id)
            except ApiError as err:
                response = JSONResponse(err.body(), status_code=err.status)
            except ClientGone:
                response = Response(status_code=499)     # nobody reads it
            if request_id is not None:
                response.headers["x-request-id"] = request_id
            return response
        return run

    async def _body(self, http: HttpRequest) -> Any:
        try:
            return json.loads(await http.body())
        except ClientDisconnect:
            raise ClientGone from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # ---- generation ----------------------------------------------------

    async def chat(self, http: HttpRequest, request_id: str) -> Response:
        body = parse(ChatBody, await self._body(http))
        self._check_model(body.model)
        prompt_ids = self._chat_ids([m.as_dict() for m in body.messages], body.add_generation_prompt)
        return await self._generate(http, request_id, body, prompt_ids, chat=True)

    async def completions(self, http: HttpRequest, request_id: str) -> Response:
        body = parse(CompletionBody, await self._body(http))
        self._check_model(body.model)
        prompts = self._prompt_ids(body)
        if len(prompts) != 1:
            raise ApiError(400, "one prompt per request (a batch of prompts is not supported)", param="prompt")
        return await self._generate(http, request_id, body, prompts[0], chat=False)

    def _prompt_ids(self, body: CompletionBody) -> list[list[int]]:
        """The token ids of each prompt of a completions body: text, token ids, or a list of either."""
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]                                       # type: ignore[list-item]
        return [self.engine.tokenizer.encode(p).ids if isinstance(p, str) else list(p)   # type: ignore[arg-type]
                for p in prompt]

    def _chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        if self.template is None:
            raise ApiError(400, "this model has no chat template (tokenizer_config.json chat_template or "
                                "chat_template.jinja); start inferd with --chat-template FILE, or use "
                                "/v1/completions", param="messages", code="no_chat_template")
        try:
            return self.template.encode(messages, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as err:
            raise ApiError(400, str(err), param="messages") from None

    def _params(self, body: ChatBody | CompletionBody, prompt_len: int) -> SamplingParams:
        limit = self.engine.config.max_position
        budget = body.token_budget()
        if budget is None:
            budget = limit - prompt_len                 # as vLLM: up to the model's positions
        if prompt_len + budget > limit or budget < 1:
            raise ApiError(400, f"a prompt of {prompt_len} tokens plus max_tokens {budget} exceeds the model's "
                                f"{limit} positions", param="max_tokens", code="context_length_exceeded")
        return SamplingParams(max_tokens=budget, temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=body.top_p or 1.0, top_k=max(body.top_k or 0, 0), seed=body.seed,
                              stop=body.stops(), ignore_eos=body.ignore_eos, n=body.n,
                              logprobs=body.logprob_count(), min_tokens=body.min_tokens)

    def _scheduler(self) -> Any:
        scheduler = self.engine.scheduler
        if scheduler is None:
            raise ApiError(503, "not attached to memd (it is down or restarting); retry shortly")
        return scheduler

    def _check_vocab(self, ids: list[int], param: str) -> None:
        vocab = self.engine.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param=param)

    async def _generate(self, http: HttpRequest, request_id: str, body: ChatBody | CompletionBody,
                        prompt_ids: list[int], *, chat: bool) -> Response:
        self._check_vocab(prompt_ids, "prompt")
        scheduler = self._scheduler()
        tenant: Tenant = http.state.tenant
        session = tenant.session(http.headers.get(SESSION_HEADER) or None)
        params = self._params(body, len(prompt_ids))
        request = Request(prompt_ids, params, session_id=session, whole_history=session is not None,
                          cache_salt=tenant.salt(body.cache_salt), tenant=tenant.name or None,
                          retain_s=_retention(http.headers.get(RETENTION_HEADER), body.prompt_cache_retention,
                                              session))
        request.request_id = request_id
        try:
            scheduler.submit(request)
        except BadParams as err:
            raise ApiError(400, str(err)) from None
        except GenerationError as err:
            raise _api_error(err) from None
        reader = Completions(request, scheduler.cancel, self.metrics)
        self.active.add(reader)
        shape = _Shape(chat, self.model_name, request_id, self.engine.tokenizer, params.n,
                       body.return_tokens_as_token_ids)
        streaming = False
        try:
            first = await or_disconnect(http.receive, _next(reader))     # a refusal is an error status, not a stream
            if body.stream:
                options = body.stream_options
                usage = options is not None and options.include_usage
                streaming = True
                return _Stream(self, reader, self._stream(
                    reader, shape, first, usage, continuous=usage and options is not None and
                    options.continuous_usage_stats))
            events = [first]
            while (event := await or_disconnect(http.receive, _next(reader))) is not None:
                events.append(event)
            return JSONResponse(shape.whole(events, reader.usage()))
        finally:
            if not streaming:
                reader.abandon()                       # a no-op once every completion ended
                self.active.discard(reader)

    async def _stream(self, reader: Completions, shape: _Shape, first: Event | None, include_usage: bool, *,
                      continuous: bool = False) -> AsyncIterator[str]:
        """OpenAI's chunks: the role first (chat), the text, the finish reason on the last text chunk.

        A token's event says whether it ends its completion, so no chunk waits for the next one.
        `continuous` (vLLM's continuous_usage_stats): each chunk carries its choice's usage so far.
        """
        ended: set[int] = set()                        # completions whose finish reason was sent
        sent: dict[int, int] = {}                      # characters of text sent, per completion
        generated: dict[int, int] = {}                 # tokens so far, per completion

        def usage(index: int) -> dict[str, int] | None:
            if not continuous:
                return None
            prompt, done = reader.request.num_prompt, generated.get(index, 0)
            return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

        try:
            for index in range(shape.n) if shape.chat else ():
                yield shape.chunk_json(shape.chunk(index, {"role": "assistant", "content": ""}), include_usage,
                                       usage(index))
            event = first
            while event is not None:
                generated[event.index] = generated.get(event.index, 0) + len(event.token_ids)
                if event.token_ids and (event.text or event.logprobs or event.ends):
                    chunk = shape.chunk(event.index, {"content": event.text} if shape.chat else event.text,
                                        event.logprobs, sent.get(event.index, 0))
                    sent[event.index] = sent.get(event.index, 0) + len(event.text)
                    if event.ends is not None:
                        chunk["choices"][0]["finish_reason"] = _finish_reason(event.ends)
                        ended.add(event.index)
                    yield shape.chunk_json(chunk, include_usage, usage(event.index))
                elif event.finish_reason is not None and event.index not in ended:   # ended with no token
                    chunk = shape.chunk(event.index, {} if shape.chat else "")
                    chunk["choices"][0]["finish_reason"] = _finish_reason(event.finish_reason)
                    yield shape.chunk_json(chunk, include_usage, usage(event.index))
                event = await _next(reader)
            if include_usage:
                yield json.dumps(shape.envelope([], usage=reader.usage()))
        except ApiError as err:                        # an error mid-stream: said in the stream, as vLLM does
            yield json.dumps(err.body())
        finally:
            reader.abandon()                           # a no-op once every completion ended
        yield "[DONE]"

    # ---- rendering: what a request would run, without running it ----------

    async def render_chat(self, http: HttpRequest, request_id: str) -> Response:
        """vLLM's render: the token ids a chat request would run (its template applied) and its sampling, so
        that a router (llm-d's precise prefix routing) tokenizes as this server does."""
        body = parse(ChatBody, await self._body(http))
        self._check_model(body.model)
        ids = self._chat_ids([m.as_dict() for m in body.messages], body.add_generation_prompt)
        return JSONResponse(self._rendered(body, ids, f"chatcmpl-{request_id}"))

    async def render_completions(self, http: HttpRequest, request_id: str) -> Response:
        """One rendered request per prompt, as vLLM's."""
        body = parse(CompletionBody, await self._body(http))
        self._check_model(body.model)
        prompts = self._prompt_ids(body)
        names = [f"cmpl-{request_id}"] if len(prompts) == 1 else [f"cmpl-{request_id}-{i}" for i in range(len(prompts))]
        return JSONResponse([self._rendered(body, ids, name) for ids, name in zip(prompts, names, strict=True)])

    def _rendered(self, body: ChatBody | CompletionBody, ids: list[int], request_id: str) -> dict[str, Any]:
        self._check_vocab(ids, "prompt")
        p = self._params(body, len(ids))
        sampling = {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                    "seed": p.seed, "stop": list(p.stop), "n": p.n, "ignore_eos": p.ignore_eos,
                    "min_tokens": p.min_tokens, "logprobs": p.logprobs}
        return {"request_id": request_id, "token_ids": ids, "sampling_params": sampling, "model": self.model_name,
                "stream": body.stream, "stream_options": body.stream_options.model_dump() if body.stream_options
                else None, "cache_salt": body.cache_salt, "output_mode": "tokens"}

    # ---- the rest of the API ------------------------------------------

    async def models(self, http: HttpRequest, request_id: str) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvpool",
            "root": self.engine.namespace, "max_model_len": self.engine.config.max_position}]})

    async def tokenize(self, http: HttpRequest, request_id: str) -> Response:
        body = parse(TokenizeBody, await self._body(http))
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give a prompt or messages", param="prompt")
        if body.messages is not None:
            tokens = self._chat_ids([m.as_dict() for m in body.messages], body.add_generation_prompt)
        else:
            tokens = self.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens).ids
        return JSONResponse({"count": len(tokens), "max_model_len": self.engine.config.max_position,
                             "tokens": tokens})

    async def detokenize(self, http: HttpRequest, request_id: str) -> Response:
        body = parse(DetokenizeBody, await self._body(http))
        self._check_model(body.model)
        self._check_vocab(body.tokens, "tokens")
        return JSONResponse({"prompt": self.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)})

    async def health(self, http: HttpRequest) -> Response:
        """200 while requests can be served: attached to memd and not draining (a balancer's check). Its body
        names the model served and its K/V's namespace in memd: kvroute routes by them."""
        scheduler = self.engine.scheduler
        if scheduler is None:
            return JSONResponse({"status": "not attached to memd"}, status_code=503)
        if scheduler.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_name, "kv_namespace": self.engine.namespace})

    async def reset_prefix_cache(self, http: HttpRequest, request_id: str) -> Response:
        """vLLM's: the cached prefixes of this worker's model leave memd's prefix cache (a load test's clean
        start: aiperf --reset-kv-cache). Sessions keep their pages, other models their cache. Behind the API
        key, like every call that changes something."""
        if not http.state.tenant.admin:
            raise ApiError(403, "resetting the prefix cache is for an admin tenant (admin = true)",
                           code="permission_denied")
        scheduler = self._scheduler()
        try:
            blocks = await scheduler.client.reset_prefix_cache()
        except MemdError as err:
            raise ApiError(503, f"memd did not reset the prefix cache: {err.message}") from None
        log.info("prefix cache reset", request=request_id, blocks=blocks)
        return JSONResponse({"success": True, "blocks": blocks})

    async def forget_session(self, http: HttpRequest, request_id: str) -> Response:
        """kvpool's: forget a session (X-Session-Id): a turn in flight ends, memd frees its K/V. Only the
        caller's own sessions are found: another tenant's is a 404, as one that does not exist."""
        name = http.path_params["session_id"]
        try:
            await self._scheduler().reset(http.state.tenant.session(name))
        except GenerationError as err:
            raise _api_error(err) from None
        return JSONResponse({"id": name, "object": "session", "deleted": True})

    async def version(self, http: HttpRequest) -> Response:
        return JSONResponse({"version": kvpool_version()})

    async def prometheus(self, http: HttpRequest) -> Response:
        if self.metrics is None:
            return Response(status_code=404)
        # Off the loop: the collector reads the batch's state on the loop, and waits for it.
        data = await asyncio.to_thread(generate_latest, self.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


class _Stream(Response):
    """OpenAI's chunks as server-sent events, each sent as it comes; the request is cancelled however the
    exchange ends, even before the first chunk.

    A streamed token costs one `send` of its bytes: sse-starlette's task group and timeout scope per chunk
    took a third of inferd's event loop at 16 streams. No keep-alive comments: OpenAI and vLLM send none,
    and a client's read timeout covers a request still queued."""

    def __init__(self, server: OpenAIServer, reader: Completions, events: AsyncIterator[str]) -> None:
        self.server, self.reader, self.events = server, reader, events
        self.status_code, self.background, self.raw_headers = 200, None, list(SSE_HEADERS)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            broke = await stream_body(receive, send, self._encoded())
            if broke is not None:
                raise broke
        finally:
            self.reader.abandon()
            self.server.active.discard(self.reader)

    async def _encoded(self) -> AsyncIterator[bytes]:
        async for event in self.events:
            yield b"data: " + event.encode() + b"\n\n"


async def _http_error(http: HttpRequest, exc: Exception) -> Response:
    """An unknown path or method, in OpenAI's error shape too."""
    assert isinstance(exc, HTTPException)
    error = ApiError(exc.status_code, f"{http.method} {http.url.path}: {exc.detail}")
    return JSONResponse(error.body(), status_code=exc.status_code)


@dataclass(frozen=True)
class _Shape:
    """How answers look: chat or text completion, whole or in chunks."""

    chat: bool
    model: str
    request_id: str
    tokenizer: Any
    n: int
    ids_as_tokens: bool = False          # logprobs name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, choices: list[dict[str, Any]], *, chunk: bool = True,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
            prefix = "chatcmpl"
        else:
            kind, prefix = "text_completion", "cmpl"
        out: dict[str, Any] = {"id": f"{prefix}-{self.request_id}", "object": kind, "created": self.created,
                               "model": self.model, "choices": choices}
        if usage is not None or not chunk:
            out["usage"] = usage
        return out

    def chunk(self, index: int, delta: Any, logprobs: list[TokenLogprob] | None = None,
              offset: int = 0) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": None,
                                  "logprobs": self.logprobs(logprobs, offset) if logprobs else None}
        choice["delta" if self.chat else "text"] = delta
        return self.envelope([choice])

    def chunk_json(self, chunk: dict[str, Any], include_usage: bool, usage: dict[str, int] | None = None) -> str:
        if include_usage:
            chunk["usage"] = usage                      # as OpenAI: every chunk has it, the last one filled
        return json.dumps(chunk)

    def whole(self, events: list[Event], usage: dict[str, Any]) -> dict[str, Any]:
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        finish: dict[int, str | None] = {}
        for event in events:
            texts.setdefault(event.index, []).append(event.text)
            logprobs.setdefault(event.index, []).extend(event.logprobs or [])
            if event.finish_reason is not None:
                finish[event.index] = _finish_reason(event.finish_reason)
        choices = []
        for index in range(self.n):
            text = "".join(texts.get(index, []))
            choice: dict[str, Any] = {"index": index, "finish_reason": finish.get(index),
                                      "logprobs": self.logprobs(logprobs[index]) if logprobs.get(index) else None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return self.envelope(choices, chunk=False, usage=usage)

    def logprobs(self, entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        """OpenAI's logprobs; `offset`: characters of this completion's text before these tokens (streaming)."""
        decode = (lambda ids: f"token_id:{ids[0]}") if self.ids_as_tokens else self.tokenizer.decode
        if self.chat:
            def one(token_id: int, logprob: float) -> dict[str, Any]:
                return {"token": decode([token_id]), "logprob": logprob,
                        "bytes": list(token_bytes(self.tokenizer, token_id))}
            return {"content": [one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                                for e in entries]}
        tokens = [decode([e.token_id]) for e in entries]
        offsets = [offset]
        for token in tokens[:-1]:
            offsets.append(offsets[-1] + len(token))
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{decode([t]): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets[:len(tokens)]}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as one printable character; this maps them back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's own bytes, also when it holds part of a character (its text then decodes to U+FFFD).

    Byte-level BPE (Llama 3, Qwen2, GPT-2) spells bytes as characters; SentencePiece vocabularies
    (Llama 2, Mistral) write "▁" for a space and "<0xNN>" for a byte they fall back to.
    """
    piece = tokenizer.id_to_token(token_id) or ""
    if piece and all(c in BYTE_LEVEL for c in piece) and "ByteLevel" in type(tokenizer.decoder).__name__ + \
            repr(tokenizer.decoder):
        return bytes(BYTE_LEVEL[c] for c in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()
