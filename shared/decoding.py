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

    So are the requests of the streamed methods named in `iterated`, whose handlers take their requests from
    the request iterator (not `context.read()`, which would hand such a handler the raw bytes).

    Late in the chain (only serializer swaps follow it), so its continuation yields the registered handler:
    wrapped once per method, then reused, which keeps the per-call cost on the Step path to a dict lookup.
    """

    def __init__(self, iterated: frozenset[str] = frozenset()) -> None:
        self.iterated = iterated
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}      # registered methods only: a bounded set

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        if (wrapped := self._wrapped.get(details.method)) is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None:
            return None                   # no such method: nothing to keep
        self._wrapped[details.method] = self._wrap(handler, details.method)
        return self._wrapped[details.method]

    def _wrap(self, handler: grpc.RpcMethodHandler, path: str) -> grpc.RpcMethodHandler:
        method = path.rpartition("/")[2]
        if handler.request_deserializer is None or (handler.request_streaming and method not in self.iterated):
            return handler
        decode = handler.request_deserializer
        kind = getattr(getattr(decode, "__self__", None), "__name__", f"{method}Request")   # FromString's class

        async def decoded(raw: bytes, context: grpc.aio.ServicerContext) -> object:
            try:
                return decode(raw)
            except DecodeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{method}: the request is not a valid {kind} message ({exc})")

        if handler.request_streaming:
            iterated = handler.stream_stream

            async def guarded_streams(raws: AsyncIterator[bytes],
                                      context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
                async def requests() -> AsyncIterator[object]:
                    async for raw in raws:
                        yield await decoded(raw, context)

                async for reply in iterated(requests(), context):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(guarded_streams, request_deserializer=None,
                                                         response_serializer=handler.response_serializer)

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
