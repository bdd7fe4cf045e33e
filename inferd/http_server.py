"""uvicorn serving the OpenAI-compatible API on inferd's own event loop (`inferd serve --http`).

inferd stops it (finishing the exchanges in flight, for a few seconds at
most) before gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
from collections.abc import Callable

import structlog

from inferd.chat_template import ChatTemplate, ChatTemplateError
from inferd.engine import WorkerEngine
from inferd.metrics import InferdMetrics
from inferd.openai_api import OpenAIServer
from shared.http_listener import EmbeddedServer, HttpListenError, address_of, bind_http
from shared.tenants import Tenants, TenantsError

log = structlog.get_logger("inferd.http")


class HttpStartError(RuntimeError):
    """The HTTP API cannot start as configured; the message says why in one line."""


class HttpFrontDoor:
    def __init__(self, api: OpenAIServer, sock: socket.socket) -> None:
        self.api = api
        self.server = EmbeddedServer(api.app())
        self.sock = sock
        self.address = address_of(sock)
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def listen(cls, args: argparse.Namespace, engine: WorkerEngine, metrics: InferdMetrics | None) -> HttpFrontDoor:
        try:
            template = ChatTemplate.from_checkpoint(args.model, engine.tokenizer, args.chat_template)
        except ChatTemplateError as exc:
            raise HttpStartError(str(exc)) from None
        if template is None:
            log.warning("the checkpoint has no chat template: /v1/chat/completions answers 400 "
                        "(give --chat-template FILE)", model=str(args.model))
        try:
            tenants = Tenants.load(args.api_keys) if args.api_keys else Tenants.single(args.api_key or None)
        except TenantsError as exc:
            raise HttpStartError(str(exc)) from None
        api = OpenAIServer(engine, served_model_name=args.served_model_name or args.model.name,
                           tenants=tenants, template=template, metrics=metrics)
        try:
            sock = bind_http(args.http)
        except HttpListenError as exc:
            raise HttpStartError(str(exc)) from None
        return cls(api, sock)

    def start(self, on_crash: Callable[[], None]) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.sock]), name="http")
        self._task.add_done_callback(lambda task: self._ended(task, on_crash))

    def _ended(self, task: asyncio.Task[None], on_crash: Callable[[], None]) -> None:
        if not task.cancelled() and task.exception() is not None and not self.server.should_exit:
            log.error("the HTTP API failed; inferd stops", error=repr(task.exception()))
            on_crash()

    async def stop(self) -> None:
        """Requests in flight are cancelled (their streams end within a step), then uvicorn closes."""
        self.api.close()
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):      # a crash was logged when it happened
                await self._task
        self.sock.close()
