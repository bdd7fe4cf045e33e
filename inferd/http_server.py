"""uvicorn serving the OpenAI-compatible API on inferd's own event loop (`inferd serve --http`).

The socket is bound before inferd says READY=1, so a taken port fails
start-up in one line; uvicorn leaves signals to inferd, which stops it
(finishing the exchanges in flight, for a few seconds at most) before gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator

import structlog
import uvicorn

from inferd.chat_template import ChatTemplate, ChatTemplateError
from inferd.metrics import InferdMetrics
from inferd.openai_api import OpenAIServer
from inferd.service import MemdLink

log = structlog.get_logger("inferd.http")
GRACE_S = 5.0           # how long a stop waits for exchanges in flight (streams) before closing them


class HttpStartError(RuntimeError):
    """The HTTP API cannot start as configured; the message says why in one line."""


def split_address(text: str) -> tuple[str, int]:
    """HOST:PORT, [IPv6]:PORT or :PORT (all interfaces)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise HttpStartError(f"--http {text!r}: expected HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


class _EmbeddedServer(uvicorn.Server):
    """inferd owns the process's signals: uvicorn must not take SIGTERM for itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpFrontDoor:
    def __init__(self, api: OpenAIServer, sock: socket.socket) -> None:
        self.api = api
        config = uvicorn.Config(api.app(), lifespan="off", log_config=None, access_log=False, loop="none",
                                timeout_graceful_shutdown=GRACE_S)
        self.server = _EmbeddedServer(config)
        self.sock = sock
        host, port = sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def listen(cls, args: argparse.Namespace, link: MemdLink, metrics: InferdMetrics | None) -> HttpFrontDoor:
        host, port = split_address(args.http)
        try:
            template = ChatTemplate.from_checkpoint(args.model, link.tokenizer, args.chat_template)
        except ChatTemplateError as exc:
            raise HttpStartError(str(exc)) from None
        if template is None:
            log.warning("the checkpoint has no chat template: /v1/chat/completions answers 400 "
                        "(give --chat-template FILE)", model=str(args.model))
        api = OpenAIServer(link, served_model_name=args.served_model_name or args.model.name,
                           api_key=args.api_key or None, template=template, metrics=metrics)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, port), family=family, backlog=1024)
        except OSError as exc:
            raise HttpStartError(f"cannot serve HTTP on {args.http}: {exc.strerror or exc}") from None
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
