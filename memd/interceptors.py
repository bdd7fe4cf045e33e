"""What every call to memd passes through after access control: counting, and decoding.

grpc-python decodes a request before any handler runs; bytes that are not the
method's message end as UNKNOWN with a traceback-flavoured message. memd
decodes them itself instead, so a malformed request gets INVALID_ARGUMENT and
a one-line reason, like any other bad input.
"""

from __future__ import annotations

from collections import Counter

import grpc
from google.protobuf.message import DecodeError

from shared.rpc import memd_pb2 as pb

MEMD_SERVICE = pb.DESCRIPTOR.services_by_name["Memd"].full_name


class RpcCounter(grpc.aio.ServerInterceptor):
    """Counts Memd calls per method as they arrive: memctl top's RPC rate, kvpool_memd_rpcs_total.

    Placed after access control, it counts admitted calls only; names outside the
    service (a typo, a scan) are not counted, so the label set stays the service's methods.
    """

    def __init__(self, rpcs: Counter[str]) -> None:
        self.rpcs = rpcs
        self.methods = {f"/{MEMD_SERVICE}/{m.name}": m.name for m in pb.DESCRIPTOR.services_by_name["Memd"].methods}

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        if (method := self.methods.get(details.method)) is not None:
            self.rpcs[method] += 1
        return await continuation(details)


class RequestDecoder(grpc.aio.ServerInterceptor):
    """Malformed unary requests get INVALID_ARGUMENT (not UNKNOWN) before the handler sees them."""

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.response_streaming \
                or handler.request_deserializer is None:
            return handler
        decode, behaviour = handler.request_deserializer, handler.unary_unary
        method = details.method.rpartition("/")[2]

        async def guarded(raw: bytes, context: grpc.aio.ServicerContext) -> object:
            try:
                request = decode(raw)
            except DecodeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{method}: the request is not a valid {method}Request message ({exc})")
            return await behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=None,
                                                   response_serializer=handler.response_serializer)
