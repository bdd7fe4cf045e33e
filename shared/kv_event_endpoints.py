"""Where a memd's KV events are read: the PUB endpoint it is given, and its replay socket beside it.

memd opens the replay socket (ROUTER) on the port after its `--kv-events`
port unless told otherwise, and a subscriber that is given only the PUB
endpoint (kvroute) looks for it there: one rule, for both ends.
"""

from __future__ import annotations


def tcp_host_port(endpoint: str) -> tuple[str, int] | None:
    """HOST and PORT of `tcp://HOST:PORT`; None for any other endpoint."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not host or not port.isdigit():
        return None
    return host, int(port)


def replay_beside(endpoint: str) -> str | None:
    """The replay endpoint beside `tcp://HOST:PORT`: the next port (None where there is no next port to take)."""
    found = tcp_host_port(endpoint)
    if found is None or not found[1]:
        return None
    host, port = found
    return f"tcp://{host}:{port + 1}"
