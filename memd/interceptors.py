"""What every call to memd passes through after access control: counting (and shared.decoding)."""

from __future__ import annotations

from collections import Counter

import grpc

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


class Serialized:
    """A reply already serialized (off the event loop): gRPC sends its bytes as they are."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class SerializedReplies(grpc.aio.ServerInterceptor):
    """Lets a handler return `Serialized`: gRPC serializes replies on the event loop, seconds for a big snapshot."""

    def __init__(self, methods: tuple[str, ...] = ("Snapshot",)) -> None:
        self.methods = {f"/{MEMD_SERVICE}/{name}" for name in methods}

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = await continuation(details)
        if handler is None or details.method not in self.methods or handler.response_serializer is None:
            return handler
        serialize = handler.response_serializer
        return handler._replace(
            response_serializer=lambda reply: reply.data if isinstance(reply, Serialized) else serialize(reply))
