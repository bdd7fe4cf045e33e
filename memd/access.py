"""Who may call memd, checked before any handler runs.

Every Memd call presents a token (shared.tokens). The worker token, readable
by memd's group, admits workers and read-only tools; the admin token, readable
by memd's user only, also admits the calls that change or reveal other
tenants' state: Snapshot, Evict, Drain, Scrub, Quotas, SetQuota. A refused call reaches no handler, so
it changes nothing. Health checks and reflection stay open: probes and
grpcurl need no secret, and they reveal none.

Inside the worker role, each attachment's lease secret (AttachReply.lease)
keeps a worker to its own sequences; that check lives in the manager.
"""

from __future__ import annotations

import hmac

import grpc
import structlog

from memd.interceptors import MEMD_SERVICE
from memd.token_files import Credentials
from shared.rpc import memd_pb2 as pb
from shared.tokens import TOKEN_ENV, TOKEN_FILE_ENV, TOKEN_KEY

log = structlog.get_logger("memd")

ADMIN_METHODS = frozenset({"Snapshot", "Evict", "Drain", "Scrub", "Quotas", "SetQuota"})
# How each method streams, (requests, replies): a refusal must be a handler of the same kind.
_KINDS = {m.name: (m.client_streaming, m.server_streaming)
          for m in pb.DESCRIPTOR.services_by_name["Memd"].methods}


def _deny(code: grpc.StatusCode, message: str, method: str) -> grpc.RpcMethodHandler:
    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[_KINDS.get(method, (False, False))](refuse)


class AccessControl(grpc.aio.ServerInterceptor):
    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials

    def role(self, token: str | bytes | None) -> str | None:
        if not isinstance(token, str):
            return None
        if hmac.compare_digest(token.encode(), self.credentials.admin.encode()):
            return "admin"
        if hmac.compare_digest(token.encode(), self.credentials.worker.encode()):
            return "worker"
        return None

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        service, _, method = details.method.lstrip("/").rpartition("/")
        if service != MEMD_SERVICE:
            return await continuation(details)
        token = next((v for k, v in details.invocation_metadata or () if k == TOKEN_KEY), None)
        role = self.role(token)
        c = self.credentials
        if role is None:
            reason = "no token" if token is None else "a wrong token"
            log.warning("call refused", method=method, reason=reason)
            hint = (f"members of memd's group read it from {c.worker_file}, or set ${TOKEN_ENV} / ${TOKEN_FILE_ENV}"
                    if token is None else "memd writes new tokens at every start: read the file again")
            return _deny(grpc.StatusCode.UNAUTHENTICATED, f"{method} with {reason}: {hint}", method)
        if method in ADMIN_METHODS and role != "admin":
            log.warning("call refused", method=method, reason="not an admin")
            return _deny(grpc.StatusCode.PERMISSION_DENIED,
                         f"{method} needs the admin token ({c.admin_file}, readable by memd's user only)", method)
        return await continuation(details)
