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
