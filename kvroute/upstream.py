"""kvroute's HTTP transport to its workers: a connection a worker reset is a connection error, whatever reports it.

On uvloop, a connection reset right after it was made (a worker killed -9
while kvroute connects, its listening socket's backlog answering for it) is
closed before httpcore asks it whether it speaks TLS: uvloop's closed transport
has no socket then, and anyio's socket stream, reading its attributes, calls
`getpeername` on None. httpx passes that AttributeError on as it is, and a
turn became an HTTP 500 instead of going to another worker (the chaos runs met
it twice in 7,578 turns; a loop of connections reset as they are made meets
it a few times in a hundred to a few in ten thousand, by load). Nothing was
sent on such a connection: it is the
`httpx.ConnectError` kvroute already fails over on.
"""

from __future__ import annotations

import httpx


class UpstreamTransport(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except AttributeError as exc:
            if not _closed_socket_stream(exc):
                raise
            raise httpx.ConnectError("the connection was reset as it was made", request=request) from exc


def _closed_socket_stream(exc: AttributeError) -> bool:
    """Whether `exc` is anyio's reading of a socket stream whose transport closed (and no bug of ours)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "anyio" in tb.tb_frame.f_code.co_filename and "getpeername" in str(exc)
