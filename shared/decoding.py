"""Malformed requests get INVALID_ARGUMENT, like any other bad input, in both daemons.

grpc-python decodes a request before any handler runs; bytes that are not the
method's message end as UNKNOWN with a message shaped like a Python exception.
This interceptor has the handler take the raw bytes and decodes them itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError


class RequestDecoder(grpc.aio.ServerInterceptor):
    """Unary requests (with a unary or a streamed reply) that do not decode are refused with a one-line reason.

    Late in the chain (only serializer swaps follow it), so its continuation yields the registered handler:
    wrapped once per method, then reused, which keeps the per-call cost on the Step path to a dict lookup.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}      # registered methods only: a bounded set

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        if (wrapped := self._wrapped.get(details.method)) is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None:
            return None                   # no such method: nothing to keep
        self._wrapped[details.method] = self._wrap(handler, details.method)
        return self._wrapped[details.method]

    @staticmethod
    def _wrap(handler: grpc.RpcMethodHandler, path: str) -> grpc.RpcMethodHandler:
        if handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer
        method = path.rpartition("/")[2]

        async def decoded(raw: bytes, context: grpc.aio.ServicerContext) -> object:
            try:
                return decode(raw)
            except DecodeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{method}: the request is not a valid {method}Request message ({exc})")

        if handler.response_streaming:
            streaming = handler.unary_stream

            async def guarded_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
                request = await decoded(raw, context)
                async for reply in streaming(request, context):
                    yield reply

            return grpc.unary_stream_rpc_method_handler(guarded_stream, request_deserializer=None,
                                                        response_serializer=handler.response_serializer)
        unary = handler.unary_unary

        async def guarded(raw: bytes, context: grpc.aio.ServicerContext) -> object:
            return await unary(await decoded(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=None,
                                                   response_serializer=handler.response_serializer)
