"""The HTTP endpoint both daemons serve Prometheus metrics on (`--metrics-port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsPortError(RuntimeError):
    """The metrics endpoint cannot listen: the daemon refuses to start, with this one line."""


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> None:
    """Serve `registry` at http://host:port/metrics from a thread of prometheus-client's."""
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise MetricsPortError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
