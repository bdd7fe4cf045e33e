"""kvroute's HTTP side: each OpenAI request forwarded to the worker chosen for it, its answer streamed back.

Bytes pass through as the worker sends them (SSE chunks are not buffered);
a client that hangs up closes the worker's exchange, so inferd cancels the
request and parks or frees its sequence. A worker that cannot be reached, or
drops the exchange before answering, or answers 503 (draining, memd away),
is left for another (reason "failover"); a connection failure also takes it
out until its next health check passes. So is a request a worker has not
begun to answer once that worker has been down `STALLED_FAILOVER_S` in all
while it held the request (frozen, or waiting for a memd that is restarting,
or attaching again after it lost its lease: its health may flap meanwhile):
nothing of it reached the client, and the worker, once it runs again, sees
the exchange closed and cancels its copy. A stream the worker breaks midway is
broken to the client too (the connection closes without the final chunk),
never passed off as complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvroute.directory import SessionDirectory
from kvroute.kv_index import EventSource, keys
from kvroute.metrics import RouteMetrics
from kvroute.placement import place, prefix_key
from kvroute.workers import Worker, Workers
from shared.command_line import kvpool_version
from shared.http_exchange import ApiError, ClientGone, or_disconnect, stream_body
from shared.tenants import Tenants

log = structlog.get_logger("kvroute")

SESSION_HEADER = "x-session-id"
RENDER_TIMEOUT_S = 5.0           # a worker's /render that takes longer: the request is placed by its text
WORKER_HEADER = "x-kvroute-worker"       # which worker answered: for operators and tests
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "host", "content-length"})


STALLED_FAILOVER_S = 5.0      # a worker down this long in all, holding a request it has not begun to answer: elsewhere


class WorkerStalled(Exception):
    """The worker went down holding a request it never began to answer."""


def error(status: int, message: str, *, code: str | None = None) -> JSONResponse:
    """OpenAI's error shape, as the workers answer."""
    return JSONResponse(ApiError(status, message, code=code).body(), status_code=status)


class Router:
    def __init__(self, workers: Workers, directory: SessionDirectory, metrics: RouteMetrics,
                 client: httpx.AsyncClient, *, tenants: Tenants, slack: int,
                 sources: list[EventSource] | None = None) -> None:
        self.workers, self.directory, self.metrics, self.client = workers, directory, metrics, client
        self.tenants, self.slack = tenants, slack
        self.sources = sources or []             # --kv-events: each pool's blocks, from its memd

    def app(self) -> Starlette:
        return Starlette(exception_handlers={HTTPException: _http_error}, routes=[
            Route("/v1/chat/completions", self._guarded(self.generate), methods=["POST"]),
            Route("/v1/completions", self._guarded(self.generate), methods=["POST"]),
            Route("/v1/models", self._guarded(self.anywhere), methods=["GET"]),
            Route("/tokenize", self._guarded(self.anywhere), methods=["POST"]),
            Route("/detokenize", self._guarded(self.anywhere), methods=["POST"]),
            Route("/v1/chat/completions/render", self._guarded(self.anywhere), methods=["POST"]),
            Route("/v1/completions/render", self._guarded(self.anywhere), methods=["POST"]),
            Route("/reset_prefix_cache", self._guarded(self.reset_prefix_cache), methods=["POST"]),
            Route("/v1/sessions/{session_id:path}", self._guarded(self.forget_session), methods=["DELETE"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ])

    def _guarded(self, handler: Callable[[HttpRequest, bytes], Awaitable[Response]]
                 ) -> Callable[[HttpRequest], Awaitable[Response]]:
        async def run(http: HttpRequest) -> Response:
            try:
                http.state.tenant = self.tenants.caller(http.headers.get("authorization", ""))
            except ApiError as refused:
                return JSONResponse(refused.body(), status_code=refused.status)
            try:
                return await handler(http, await http.body())
            except (ClientDisconnect, ClientGone):
                return Response(status_code=499)                 # nobody reads it
        return run

    # ---- routing -----------------------------------------------------------

    async def generate(self, http: HttpRequest, raw: bytes) -> Response:
        """A completion: to its session's worker, else by prefix and load."""
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None                                          # forwarded as it is: the worker says what is wrong
        # The directory keeps a tenant's sessions under its name, as memd does (the worker names it itself).
        session = http.state.tenant.session(http.headers.get(SESSION_HEADER) or None)
        model = str(body.get("model", "")) if isinstance(body, dict) else ""
        salt = _salt_of(http, body)
        key = prefix_key(body)
        choice = await self._place(key, session, model, http if body is not None else None, raw, salt)
        if choice is None:
            return self._unplaced()
        worker, reason = choice
        return await self._forward(http, raw, worker, reason, key=key, session=session, model=model)

    def _place_by_blocks(self, tokens: list[int], up: list[Worker], salt: str) -> tuple[Worker, str] | None:
        """--kv-events: the worker whose pool holds the longest run of the prompt's leading blocks (of its model,
        under the request's salt), if its load is within the slack of the least loaded's; None to place by the
        text rule."""
        best, holders = 0, []
        for source in self.sources:
            by_namespace: dict[str, list[Worker]] = {}
            for w in up:
                if w.url in source.workers:
                    by_namespace.setdefault(w.namespace, []).append(w)
            for namespace, on in by_namespace.items():
                index = source.index(namespace)
                if index is None or not index.block_size:
                    continue
                matched = index.matched(keys(tokens, index.block_size, salt))
                if matched > best:
                    best, holders = matched, list(on)
                elif matched == best and matched:
                    holders += on
        if not holders:
            return None
        chosen = min(holders, key=lambda w: w.load)
        return (chosen, "kv") if chosen.load <= min(w.load for w in up) + self.slack else None

    async def _render(self, http: HttpRequest, raw: bytes, up: list[Worker]) -> list[int] | None:
        """The prompt's token ids, as the workers tokenize it: their /render endpoint (any of them, the same)."""
        worker = min(up, key=lambda w: w.load)
        try:
            answer = await self.client.post(f"{worker.url}{http.url.path}/render", content=raw,
                                            headers=_passed_on(http, b"authorization", b"content-type"),
                                            timeout=RENDER_TIMEOUT_S)
            rendered = answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            rendered = None
        if isinstance(rendered, list):
            rendered = rendered[0] if len(rendered) == 1 else None
        tokens = rendered.get("token_ids") if isinstance(rendered, dict) else None
        return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else None

    async def anywhere(self, http: HttpRequest, raw: bytes) -> Response:
        """/v1/models, /tokenize, /detokenize: any worker answers the same."""
        up = self.workers.up()
        if not up:
            return self._unplaced()
        worker = place(None, up, self.slack).worker
        return await self._forward(http, raw, worker, "load", key=None, session=None, model="", counted=False)

    async def reset_prefix_cache(self, http: HttpRequest, raw: bytes) -> Response:
        """Every worker's: each host's pool forgets its cached prefixes; 200 once all did (a worker that is down
        did not: its 503 is the answer)."""
        answers = await self._ask_every_worker(http, raw)
        if answers is None:
            return self._unplaced()
        ok = all(status == 200 for _, status, _ in answers)
        blocks = sum(body.get("blocks", 0) for _, status, body in answers if status == 200 and isinstance(body, dict))
        status = 200 if ok else next(s for _, s, _ in answers if s != 200)
        return JSONResponse({"success": ok, "blocks": blocks, "workers": {url: s for url, s, _ in answers}},
                            status_code=status)

    async def forget_session(self, http: HttpRequest, raw: bytes) -> Response:
        """DELETE /v1/sessions/NAME: every worker's memd is asked. 200 if one had it and every worker answered,
        404 if none had it. A worker that is down or did not answer may hold the session (a host that served it
        before a failover keeps its copy): its status is the answer, so the client asks again rather than
        taking a session that lives on for one that is gone."""
        answers = await self._ask_every_worker(http, raw)
        if answers is None:
            return self._unplaced()
        unsure = [(status, body) for _, status, body in answers if status not in (200, 404)]
        if unsure:
            status, body = unsure[0]
            return JSONResponse(body, status_code=status)
        session = http.state.tenant.session(http.path_params["session_id"])
        for model in {w.model for w in self.workers.all if w.model is not None} | {""}:
            self.directory.forget_soon(model, session)          # its next turn is placed like a new session's
        found = [body for _, status, body in answers if status == 200]
        return JSONResponse(found[0]) if found else JSONResponse(answers[0][2], status_code=404)

    async def _ask_every_worker(self, http: HttpRequest, raw: bytes) -> list[tuple[str, int, Any]] | None:
        """The request sent to every worker that is up, at once: (url, status, JSON body) each, and a 503 for
        each worker that is down (not asked); None if none is up."""
        up = self.workers.up()
        if not up:
            return None
        down = [(w.url, 503, ApiError(503, f"the worker {w.url} is down ({w.why_down}): it was not asked",
                                      code="worker_down").body()) for w in self.workers.all if w not in up]
        headers = _passed_on(http, b"authorization")

        async def one(worker: Worker) -> tuple[str, int, Any]:
            try:
                answer = await self.client.request(http.method, f"{worker.url}{http.url.path}", headers=headers,
                                                   content=raw, timeout=RENDER_TIMEOUT_S)
                return worker.url, answer.status_code, answer.json()
            except (httpx.HTTPError, ValueError) as exc:
                return worker.url, 502, ApiError(502, f"the worker {worker.url} did not answer ({_describe(exc)})",
                                                 code="worker_failed").body()

        return list(await asyncio.gather(*(one(w) for w in up))) + down

    async def _place(self, key: bytes | None, session: str | None, model: str, http: HttpRequest | None = None,
                     raw: bytes = b"", salt: str = "") -> tuple[Worker, str] | None:
        """The session's worker, else by the pools' blocks (--kv-events), else by text and load; among the
        workers serving `model`. Whatever is awaited comes first: loads are read where the choice is made,
        with nothing awaited before the request is counted in flight, so requests arriving together see one
        another."""
        up = self.workers.up(model)
        if not up:
            return None
        if session is not None:
            held = await self.directory.lookup(model, session)
            worker = self.workers.by_url.get(held) if held is not None else None
            if worker is not None and worker.up:
                return worker, "affinity"
            if worker is not None:                               # its worker left: the KV comes from the store
                return place(key, self.workers.up(model) or up, self.slack).worker, "failover"
        tokens = await self._render(http, raw, up) if self.sources and http is not None else None
        up = self.workers.up(model)
        if not up:
            return None
        if tokens is not None and (by_blocks := self._place_by_blocks(tokens, up, salt)) is not None:
            return by_blocks
        placed = place(key, up, self.slack)
        return placed.worker, placed.reason

    async def _forward(self, http: HttpRequest, raw: bytes, worker: Worker, reason: str, *, key: bytes | None,
                       session: str | None, model: str, counted: bool = True) -> Response:
        tried: set[Worker] = set()
        retried = False
        while True:
            try:
                upstream = await self._exchange(http, raw, worker)
            except (httpx.ConnectError, httpx.ConnectTimeout, WorkerStalled) as exc:
                # It never got the request, or cannot answer it: another may take it.
                self.workers.failed(worker, _describe(exc))
            except httpx.TransportError as exc:
                # The request may have reached the worker. Once more on a fresh connection (a keep-alive
                # connection it was closing, say); a second drop is the worker's answer, not a reason to send
                # the turn to another host as well.
                if not retried:
                    retried = True
                    continue
                self.metrics.upstream_errors.labels(worker.url).inc()
                return error(502, f"the worker {worker.url} dropped the request ({_describe(exc)})",
                             code="worker_dropped")
            else:
                if upstream.status_code != 503 or not self._untried(tried | {worker}, model):
                    break
                worker.in_flight -= 1                              # draining, or memd away: another may take it
                await upstream.aclose()
            self.metrics.upstream_errors.labels(worker.url).inc()
            tried.add(worker)
            left = self._untried(tried, model)
            if not left:
                return self._unplaced()
            worker, reason, retried = place(key, left, self.slack).worker, "failover", False
        if counted:
            self.metrics.requests.labels(worker.url, reason).inc()
        if session is not None and upstream.status_code < 300:
            self.directory.record_soon(model, session, worker.url)
        return Passthrough(upstream, worker)

    async def _exchange(self, http: HttpRequest, raw: bytes, worker: Worker) -> httpx.Response:
        """The worker's answer, headers read, body not yet; counted in flight there until Passthrough ends."""
        worker.in_flight += 1
        try:
            return await or_disconnect(http.receive, self._send_watched(http, raw, worker))
        except BaseException:
            worker.in_flight -= 1
            raise

    async def _send_watched(self, http: HttpRequest, raw: bytes, worker: Worker) -> httpx.Response:
        """`_send`, given up (WorkerStalled) once the worker has been down STALLED_FAILOVER_S without answering:
        a frozen worker, or one whose memd is away, would otherwise hold the request past the client's patience."""
        send = asyncio.ensure_future(self._send(http, raw, worker))
        loop, down_s = asyncio.get_running_loop(), 0.0        # the time it was down while this request waited
        try:
            while True:
                started = loop.time()
                done, _ = await asyncio.wait({send}, timeout=self.workers.interval_s)
                if done:
                    return send.result()
                if not worker.up:          # counted over every check, not only in one stretch: a worker that
                    down_s += loop.time() - started        # flaps between down and up holds the request as long
                if down_s >= STALLED_FAILOVER_S:
                    raise WorkerStalled(f"down {down_s:.0f} s ({worker.why_down}) while it held the request "
                                        "unanswered")
        finally:
            if not send.done():
                send.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await send

    def _untried(self, tried: set[Worker], model: str) -> list[Worker]:
        return [w for w in self.workers.up(model) if w not in tried]

    async def _send(self, http: HttpRequest, raw: bytes, worker: Worker) -> httpx.Response:
        headers = _end_to_end(http.headers.raw)
        request = self.client.build_request(http.method, worker.url + http.url.path, params=http.url.query or None,
                                            headers=headers, content=raw)
        return await self.client.send(request, stream=True)

    def _unplaced(self) -> Response:
        self.metrics.unplaced.inc()
        down = "; ".join(f"{w.url}: {w.why_down}" for w in self.workers.all)
        return error(503, f"no worker can take the request ({down})", code="no_worker")

    # ---- kvroute's own -----------------------------------------------------

    async def health(self, http: HttpRequest) -> Response:
        """200 while at least one worker is up (a balancer in front of several kvroutes checks this)."""
        workers = {w.url: "up" if w.up else f"down: {w.why_down}" for w in self.workers.all}
        ok = any(w.up for w in self.workers.all)
        return JSONResponse({"status": "ok" if ok else "no worker is up", "workers": workers},
                            status_code=200 if ok else 503)

    async def version(self, http: HttpRequest) -> Response:
        return JSONResponse({"version": kvpool_version()})

    async def prometheus(self, http: HttpRequest) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class Passthrough(Response):
    """The worker's answer, its bytes passed on as they arrive; however it ends, the worker's exchange is closed."""

    def __init__(self, upstream: httpx.Response, worker: Worker) -> None:
        self.upstream, self.worker = upstream, worker
        self.done = False
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = _end_to_end(upstream.headers.raw)
        self.raw_headers.append((WORKER_HEADER.encode(), worker.url.encode()))
        if "content-length" in upstream.headers:
            self.raw_headers.append((b"content-length", upstream.headers["content-length"].encode()))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            broke = await stream_body(receive, send, self.upstream.aiter_raw())
            if isinstance(broke, httpx.TransportError):
                # The worker broke the answer midway: so is the client's (no final chunk), never passed off whole.
                # Whether the worker is gone is for its health check to say.
                log.warning("a worker broke an answer midway", worker=self.worker.url, error=_describe(broke))
            elif broke is not None:
                raise broke
        finally:
            await self._release()

    async def _release(self) -> None:
        if not self.done:
            self.done = True
            self.worker.in_flight -= 1
            await self.upstream.aclose()



def _end_to_end(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers a proxy passes on: not hop-by-hop ones, nor those the Connection header names."""
    named = {token.strip().lower() for k, v in raw if k.lower() == b"connection" for token in v.split(b",")}
    return [(k, v) for k, v in raw if k.decode("latin-1").lower() not in HOP_BY_HOP and k.lower() not in named]


def _passed_on(http: HttpRequest, *names: bytes) -> list[tuple[bytes, bytes]]:
    """The client's headers of these names (lower case) that a proxy passes on, for a call of kvroute's own."""
    return [(k, v) for k, v in _end_to_end(http.headers.raw) if k.lower() in names]


def _salt_of(http: HttpRequest, body: Any) -> str:
    """The salt the request's prompt is cached under in memd: its tenant's and its `cache_salt`, as the worker
    names it (shared.tenants)."""
    asked = body.get("cache_salt") if isinstance(body, dict) else None
    return http.state.tenant.salt(asked if isinstance(asked, str) and asked else None) or ""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _http_error(http: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error(exc.status_code, f"{http.method} {http.url.path}: {exc.detail}")
