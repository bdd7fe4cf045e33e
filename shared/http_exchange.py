"""What inferd's OpenAI API and kvroute share about one HTTP exchange: OpenAI's error shape, the API key, and a
client that hangs up before its answer is ready."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
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
