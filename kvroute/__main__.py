"""kvroute: the command line.

    kvroute --http HOST:PORT --worker URL [--worker URL ...] [--api-key KEY]
            [--cluster-master HOST:PORT --cluster-metadata URL [--cluster-host NAME]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import structlog
import uvloop
import zmq.asyncio

from kvroute.directory import SessionDirectory
from kvroute.kv_index import EventSource, parse_source
from kvroute.metrics import RouteMetrics
from kvroute.proxy import Router
from kvroute.upstream import UpstreamTransport
from kvroute.workers import Workers
from shared.cluster_store import JOIN_RETRY_S, ClusterConfig, ClusterError, ClusterStore, StoreUnreachable
from shared.command_line import Parser, entry_point
from shared.flag_types import number
from shared.http_listener import EmbeddedServer, HttpListenError, address_of, bind_http
from shared.logs import configure
from shared.notify import keep_watchdog, notify, watchdog_interval
from shared.tenants import Tenants, TenantsError

log = structlog.get_logger("kvroute")
KEEPALIVE_S = 4.0        # under uvicorn's 5 s: kvroute never reuses a connection the worker is closing


def worker_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        raise argparse.ArgumentTypeError(f"expected a worker's base URL such as http://HOST:PORT, not {text!r}")
    return text.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvroute", description="kvpool's router: OpenAI requests to the worker that holds their KV.",
               version=True)
    p.add_argument("--http", required=True, metavar="HOST:PORT", help="where to serve the OpenAI-compatible API")
    p.add_argument("--worker", type=worker_url, action="append", required=True, metavar="URL",
                   help="an inferd HTTP endpoint (inferd serve --http), e.g. http://10.0.0.5:8000; once per worker")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-keys", type=Path, metavar="FILE",
                      help="tenants in TOML, as inferd's --api-keys (the workers take the same file): a tenant's "
                           "sessions are its own in the session directory too")
    keys.add_argument("--api-key", default=os.environ.get("KVROUTE_API_KEY"),
                   help="the key clients must send (Authorization: Bearer KEY), passed on to the workers as it is; "
                        "$KVROUTE_API_KEY works too (default: none)")
    p.add_argument("--session-ttl", type=number(float, above=0), default=3600.0, metavar="SECONDS",
                   help="how long a session stays bound to its worker after its last turn (default: 3600)")
    p.add_argument("--balance-slack", type=number(int, at_least=0), default=8, metavar="REQUESTS",
                   help="how many more requests than the least loaded worker the worker a prompt's prefix hashes "
                        "to may have and still take it (default: 8)")
    p.add_argument("--kv-events", action="append", default=[], metavar="tcp://HOST:PORT[=URL,...]",
                   help="a memd's KV events (memd --kv-events): a request without a session goes to the worker "
                        "whose pool holds most of its prompt's leading blocks (within --balance-slack), its prompt "
                        "tokenized by a worker's /render; the workers on that memd's pool are those named after =, "
                        "or else those on the same host. Once per memd (default: route by the prompt's text)")
    p.add_argument("--health-interval", type=number(float, above=0), default=1.0, metavar="SECONDS",
                   help="how often each worker's /health and /metrics are read (default: 1)")
    cluster = p.add_argument_group("session directory in the cluster store (Mooncake; needs kvpool[cluster])")
    cluster.add_argument("--cluster-master", metavar="HOST:PORT",
                         help="the store memd publishes to; without it the directory lives in this kvroute's "
                              "memory only (default: off)")
    cluster.add_argument("--cluster-metadata", metavar="URL", help="its HTTP metadata server (with --cluster-master)")
    cluster.add_argument("--cluster-host", default="", help="this host's name for the store's transfer engine "
                                                            "(default: the host name)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    return p


class StartupError(RuntimeError):
    """kvroute cannot start as configured; one line says why."""


def event_sources(args: argparse.Namespace) -> list[EventSource]:
    try:
        return [parse_source(text, args.worker) for text in args.kv_events]
    except ValueError as exc:
        raise StartupError(str(exc)) from None


async def serve(args: argparse.Namespace) -> None:
    try:
        tenants = Tenants.load(args.api_keys) if args.api_keys else Tenants.single(args.api_key or None)
    except TenantsError as exc:
        raise StartupError(str(exc)) from None
    try:
        sock = bind_http(args.http)
    except HttpListenError as exc:
        raise StartupError(str(exc)) from None
    store, joined = None, False
    if args.cluster_master:
        if not args.cluster_metadata:
            raise StartupError("--cluster-master needs --cluster-metadata (the store's HTTP metadata server URL)")
        # A client contributing no memory: the entries live on memd's segments, replicated.
        store = ClusterStore(ClusterConfig(args.cluster_master, args.cluster_metadata, args.cluster_host,
                                           segment_bytes=0), owner="kvroute")
        try:
            joined = await join_store(store)
        except ClusterError as exc:
            store.close()
            raise StartupError(str(exc)) from None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_S)
    async with contextlib.AsyncExitStack() as stack:
        if store is not None:
            stack.callback(store.close)
        client = await stack.enter_async_context(httpx.AsyncClient(
            timeout=httpx.Timeout(connect=3.0, read=None, write=30.0, pool=None),
            transport=UpstreamTransport(limits=limits)))
        for name in ("accept", "accept-encoding", "user-agent"):     # only what the client sent goes to a worker
            del client.headers[name]
        workers = Workers(args.worker, client, args.health_interval)
        directory = SessionDirectory(store if store is not None and joined else None, args.session_ttl)
        joining = asyncio.create_task(join_later(store, directory), name="store-join") \
            if store is not None and not joined else None
        sources = event_sources(args)
        router = Router(workers, directory, RouteMetrics(workers, directory, sources), client,
                        tenants=tenants, slack=args.balance_slack, sources=sources)
        context = zmq.asyncio.Context()
        stack.callback(context.destroy, 0)
        subscribed = [asyncio.create_task(source.run(context), name=f"kv-events {source.endpoint}")
                      for source in sources]
        await workers.check_all()
        checking = asyncio.create_task(workers.run(), name="worker-checks")
        server = EmbeddedServer(router.app(), own_headers=False)     # listening already: no connection refused
        serving = asyncio.create_task(server.serve(sockets=[sock]), name="http")
        stop = asyncio.Event()
        serving.add_done_callback(lambda _: stop.set())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("kvroute ready", http=address_of(sock), workers=[w.url for w in workers.all],
                 up=[w.url for w in workers.up()],
                 directory="cluster store" if directory.store is not None else
                 "memory, until the cluster store answers" if store is not None else "memory",
                 kv_events=[source.endpoint for source in sources] or "off",
                 pid=os.getpid())
        notify("READY=1", f"STATUS=routing to {len(workers.all)} workers on {address_of(sock)}")
        interval = watchdog_interval()
        watchdog = asyncio.create_task(keep_watchdog(interval)) if interval is not None else None
        await stop.wait()
        notify("STOPPING=1")
        for task in (watchdog, checking, joining, *subscribed):
            if task is not None:
                task.cancel()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await serving
        sock.close()
        await directory.drain()


async def join_store(store: ClusterStore) -> bool:
    """Join the store now; False if it does not answer (kvroute serves anyway, its directory in its own memory,
    and `join_later` keeps trying). ClusterError for a store that cannot be used as configured."""
    try:
        await store.start()
    except StoreUnreachable as exc:
        log.warning("the cluster store is unreachable: routing by this kvroute's own memory until it answers",
                    error=str(exc))
        return False
    return True


async def join_later(store: ClusterStore, directory: SessionDirectory) -> None:
    """Try the store again, with back-off, until it answers: then the directory is shared again. A kvroute
    restarted while the master is down (a crash, a deploy) routes meanwhile, rather than refusing to start."""
    delay, most = JOIN_RETRY_S
    while True:
        await asyncio.sleep(delay)                # back-off between tries: nothing signals that a store came up
        try:
            if await join_store(store):
                directory.store = store
                log.info("joined the cluster store: the session directory is shared again")
                return
        except ClusterError as exc:               # it answered, but cannot take this kvroute: stop trying
            log.error("the cluster store cannot be joined; the session directory stays in this kvroute's memory",
                      error=str(exc))
            return
        delay = min(2 * delay, most)


@entry_point("kvroute")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level, args.log_format)
    try:
        uvloop.run(serve(args))
    except StartupError as exc:
        print(f"kvroute: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
