"""What inferd's OpenAI API and kvroute share about one HTTP exchange: OpenAI's error shape, the API key, a
client that hangs up before its answer is ready, and a body streamed until it ends or the client leaves."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 404:
            return "not_found_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def check_api_key(authorization: str, key: str | None) -> None:
    """The Authorization header must be `Bearer KEY` (compared in constant time); no key: anyone may call."""
    if key is None:
        return
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")


class ClientGone(Exception):
    """The HTTP client hung up before its answer was ready."""


async def or_disconnect(receive: Callable[[], Awaitable[Any]], waiter: Awaitable[T]) -> T:
    """`waiter`'s result, unless the client hangs up first (ClientGone; `waiter` is cancelled)."""
    task = asyncio.ensure_future(waiter)
    gone = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():            # we were cancelled (a shutdown): nobody will read what it returns
            task.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientGone


async def disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    """Returns when the client hangs up (the request's body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def stream_body(receive: Callable[[], Awaitable[Any]], send: Callable[[dict[str, Any]], Awaitable[None]],
                      chunks: AsyncIterable[bytes]) -> BaseException | None:
    """Send `chunks` as ASGI body messages as they come, then end the body; stop at once if the client hangs up.

    Returns what the chunks raised (None when they ended or the client left). One task per exchange and a
    plain `send` per chunk: a streamed token costs the server no more than its bytes.
    """
    async def pump() -> None:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    pumping = asyncio.ensure_future(pump())
    gone = asyncio.ensure_future(disconnected(receive))
    for task in (pumping, gone):              # read whatever they end with, even if this call is cancelled first
        task.add_done_callback(_retrieved)
    try:
        await asyncio.wait({pumping, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pumping.cancel()
        gone.cancel()
    return pumping.exception() if pumping.done() and not pumping.cancelled() else None


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
