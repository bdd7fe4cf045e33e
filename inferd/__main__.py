"""inferd: the inference worker's command line.

    inferd serve --model DIR --memd ADDR --listen ADDR [--max-num-seqs N]
    inferd build-kernel
    inferd make-tiny-model DIR [--arch llama|qwen2|mistral] [--seed N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import structlog
import uvloop

from inferd import paged_kernel
from inferd.checkpoint import CheckpointError
from inferd.http_server import HttpFrontDoor, HttpStartError
from inferd.model import ATTENTION
from inferd.sampling import MAX_SEED
from inferd.tiny import ARCH_CLASSES, DEMO_SHAPE, make_tiny_model
from shared import address as addr
from shared.command_line import Ignored, Parser, entry_point
from shared.config import Layers, add_config_flags
from shared.decoding import RequestDecoder
from shared.flag_types import count, number, port, seconds
from shared.logs import configure
from shared.metrics_http import MetricsPortError
from shared.notify import keep_watchdog, notify, watchdog_interval
from shared.unix_socket import SocketPathError, claim

if TYPE_CHECKING:
    from inferd.engine import WorkerEngine

log = structlog.get_logger("inferd")


TINY_MAX = 1 << 16        # make-tiny-model's sizes: past this a "tiny" model fills memory rather than a test


class StartupError(RuntimeError):
    """inferd cannot start, or go on, as configured; the message says why in one line."""


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The whole command line, and `serve`'s part of it (the settings a config file may hold)."""
    p = Parser(prog="inferd", description="kvpool's inference worker.", version=True)
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over memd's pool")
    serve.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory")
    serve.add_argument("--memd", help="memd address (default: $MEMD_ADDRESS, else the per-user socket)")
    serve.add_argument("--listen", help=f"unix:PATH or HOST:PORT (default: {addr.default_address('inferd')})")
    serve.add_argument("--max-num-seqs", type=count(), default=16, help="sequences in one batch (default: 16)")
    serve.add_argument("--max-batch-tokens", type=count(), default=2048,
                       help="tokens per forward pass (default: 2048)")
    serve.add_argument("--prefill-beside-decode", type=count(), default=512,
                       help="prompt tokens in a pass that also carries running requests' next tokens: their "
                            "wait for one token is at most one pass of this many (default: 512)")
    serve.add_argument("--block-size", type=count(), default=16, help="tokens per KV block (default: 16)")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    serve.add_argument("--threads", type=count(), help="torch CPU threads (default: torch's)")
    serve.add_argument("--attention", choices=ATTENTION, default="auto",
                       help="how decode steps read K/V: paged (inferd's CPU kernel reads the pool's pages; built "
                            "with the machine's C++ compiler on first use), flex (torch's flex attention reads "
                            "them on a GPU; each batch size compiles on first use), gather (a copy of each "
                            "sequence's pages, then torch's attention), auto (paged where the pool is in CPU "
                            "memory and the kernel builds, else gather; default)")
    serve.add_argument("--audit-kv", action="store_true",
                       help="before every pass, check that no one else wrote the K/V a running sequence reads "
                            "(a turn that finds it changed fails, naming the page); slower: for tests and "
                            "investigations")
    serve.add_argument("--verify-reuse", type=number(at_least=0, at_most=1), default=0.0, metavar="FRACTION",
                       help="recompute this fraction of the prefix-cache hits of requests without a session and "
                            "compare the K/V memd handed over; a mismatch is logged and counted, and those blocks "
                            "leave memd's prefix cache (default: 0, off)")
    serve.add_argument("--quota-wait", type=seconds, default=30.0, metavar="SECONDS",
                       help="how long a request may wait while its tenant is at its page max (memd --quotas) "
                            "before it fails with a 429 (default: 30)")
    serve.add_argument("--http", metavar="HOST:PORT",
                       help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                            "/v1/models, /health, /metrics, /tokenize, /detokenize) here (default: off)")
    keys = serve.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="the key HTTP clients must send (Authorization: Bearer KEY); "
                                        "$INFERD_API_KEY works too (default: none)")
    keys.add_argument("--api-keys", type=Path, metavar="FILE",
                      help="tenants, each with its keys, in TOML ([tenants.NAME] keys = [...]): each tenant's "
                           "sessions and cached prefixes are its own (docs/operations.md, Tenants)")
    serve.add_argument("--served-model-name", help="the model name HTTP clients use (default: the --model "
                                                   "directory's name)")
    serve.add_argument("--chat-template", type=Path, metavar="FILE",
                       help="a Jinja chat template instead of the checkpoint's (default: tokenizer_config.json's "
                            "chat_template, or chat_template.jinja)")
    serve.add_argument("--metrics-port", type=port, default=0,
                       help="serve Prometheus metrics over HTTP on this port; 0 = off (default: 0)")
    serve.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port (default: 127.0.0.1)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    add_config_flags(serve, "INFERD")
    sub.add_parser("build-kernel", help="build inferd's CPU kernels (paged attention, the layers' norms and RoPE) "
                                        "for this machine now, not at the first serve, and print where they are kept")
    tiny = sub.add_parser("make-tiny-model", help="write a small seeded random checkpoint (for tests and demos)",
                          description="Write a Hugging Face checkpoint directory (config.json, safetensors weights, "
                          "tokenizer.json, a chat template) with seeded random weights: nothing is downloaded. "
                          "The defaults are the demo's model (python -m inferd.demo).")
    tiny.add_argument("dir", type=Path, help="the directory to write (made if missing)")
    tiny.add_argument("--arch", choices=sorted(ARCH_CLASSES), default=DEMO_SHAPE["arch"],
                      help="the architecture config.json names (default: %(default)s)")
    tiny.add_argument("--seed", type=number(int, at_least=0, at_most=MAX_SEED), default=0,
                      help="the weights' random seed: the same seed, the same checkpoint (default: %(default)s)")
    tiny.add_argument("--hidden", type=count(TINY_MAX), default=DEMO_SHAPE["hidden"],
                      help="hidden size (default: %(default)s)")
    tiny.add_argument("--layers", type=count(TINY_MAX), default=DEMO_SHAPE["layers"],
                      help="decoder layers (default: %(default)s)")
    tiny.add_argument("--heads", type=count(TINY_MAX), default=DEMO_SHAPE["heads"],
                      help="attention heads; hidden must divide by it (default: %(default)s)")
    tiny.add_argument("--kv-heads", type=count(TINY_MAX), default=DEMO_SHAPE["kv_heads"],
                      help="K/V heads (grouped-query attention); heads must divide by it (default: %(default)s)")
    tiny.add_argument("--vocab", type=count(TINY_MAX), default=DEMO_SHAPE["vocab"],
                      help="vocabulary size of the byte-level BPE tokenizer it trains (default: %(default)s)")
    tiny.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                      help="the weights' dtype (default: %(default)s)")
    return p, serve


async def serve(args: argparse.Namespace) -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from inferd.engine import AttachRefused, WorkerEngine
    from inferd.heap_policy import keep_freed_memory
    from inferd.metrics import InferdMetrics
    from inferd.service import InferdService
    from shared.rpc import inferd_pb2
    from shared.rpc import inferd_pb2_grpc as pb_grpc

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    keep_freed_memory()                     # before any pass: each one's tensors are reused by the next
    target = addr.resolve(args.listen, "inferd")
    sock_path = addr.unix_path(target)
    if sock_path is not None:
        claim(sock_path, "inferd")          # before the model loads: a second inferd there is refused at once
    engine = WorkerEngine(args.model, args.memd, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                    max_batch_tokens=args.max_batch_tokens,
                    prefill_beside_decode=args.prefill_beside_decode, dtype=args.dtype, audit_kv=args.audit_kv,
                    verify_reuse=args.verify_reuse, attention=args.attention, quota_wait_s=args.quota_wait)
    metrics = None
    if args.metrics_port or args.http:
        metrics = InferdMetrics(engine, asyncio.get_running_loop(), args.served_model_name or args.model.name)
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_host)
    http = HttpFrontDoor.listen(args, engine, metrics) if args.http else None
    # No SO_REUSEPORT: a second inferd on a TCP port in use must fail to bind, not share the port.
    server = grpc.aio.server(interceptors=[RequestDecoder()], options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_InferdServicer_to_server(InferdService(engine, metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    inferd_service = inferd_pb2.DESCRIPTOR.services_by_name["Inferd"].full_name
    reflection.enable_server_reflection([inferd_service, health.SERVICE_NAME, reflection.SERVICE_NAME], server)

    async def serving(up: bool) -> None:
        """Health follows whether requests can be served: attached to memd and not draining."""
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", inferd_service):
            await health_servicer.set(name, status)
    engine.on_serving = serving
    try:
        port = server.add_insecure_port(target)
    except RuntimeError:
        raise StartupError(f"cannot listen on {target} (in use by another process?)") from None
    if sock_path is None and target.endswith(":0"):
        target = f"{target[:-2]}:{port}"
    try:
        await _serve(args, engine, server, health_servicer, http, target, sock_path)
    except AttachRefused as exc:
        raise StartupError(str(exc)) from None
    finally:
        if sock_path is not None:
            with contextlib.suppress(FileNotFoundError):
                sock_path.unlink()


async def _serve(args: argparse.Namespace, engine: WorkerEngine, server: grpc.aio.Server, health_servicer: Any,
                 http: HttpFrontDoor | None, target: str, sock_path: Path | None) -> None:
    """Attach to memd, then serve until SIGTERM; a refusal memd will repeat ends inferd (AttachRefused)."""
    linking = asyncio.create_task(engine.run(), name="worker-engine")
    attached = asyncio.create_task(engine.attached.wait())
    await asyncio.wait({linking, attached}, return_when=asyncio.FIRST_COMPLETED)
    if linking.done():
        attached.cancel()
        linking.result()                    # raises what ended it
    await server.start()
    stop = asyncio.Event()
    linking.add_done_callback(lambda _: stop.set())
    if http is not None:
        http.start(on_crash=stop.set)
    if sock_path is not None:
        os.chmod(sock_path, 0o660)               # clients in the service group may connect
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("inferd ready", listen=target, model=engine.namespace, arch=engine.config.arch, pid=os.getpid(),
             http=http.address if http is not None else "off")
    notify("READY=1", f"STATUS=serving {engine.namespace} on {target}")
    interval = watchdog_interval()
    watchdog = asyncio.create_task(keep_watchdog(interval)) if interval is not None else None
    await stop.wait()
    notify("STOPPING=1")
    if watchdog is not None:
        watchdog.cancel()
    engine.on_serving = None
    await health_servicer.enter_graceful_shutdown()
    await asyncio.gather(server.stop(grace=5.0), *([http.stop()] if http is not None else []))
    if linking.done() and not linking.cancelled():
        linking.result()                    # memd refused a re-attach for good: exit non-zero, with its message
    linking.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await linking


# Settings that do nothing in some company: inferd says so at start rather than leave the operator guessing.
IGNORED = (
    Ignored("metrics_host", "metrics are off without --metrics-port", without="metrics_port"),
    *(Ignored(flag, "it configures the HTTP API, which is off without --http", without="http")
      for flag in ("api_key", "api_keys", "served_model_name", "chat_template")),
)


@entry_point("inferd")
def main(argv: list[str] | None = None) -> int:
    parser, serve_parser = build_parser()
    layers = Layers(serve_parser, "INFERD")
    args = parser.parse_args(argv)
    if args.command == "build-kernel":
        try:
            print(paged_kernel.build())
        except paged_kernel.KernelUnavailable as exc:
            print(f"inferd: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "make-tiny-model":
        try:
            out = make_tiny_model(args.dir, arch=args.arch, seed=args.seed, hidden=args.hidden, layers=args.layers,
                                  heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, dtype=args.dtype)
        except (ValueError, OSError, RuntimeError) as exc:      # RuntimeError: torch out of memory
            print(f"inferd: {exc}", file=sys.stderr)
            return 1
        print(f"wrote a tiny {args.arch} checkpoint to {out}")
        return 0
    if (done := layers.settle(args, "inferd", IGNORED)) is not None:
        return done
    configure(args.log_level, args.log_format)
    try:
        uvloop.run(serve(args))
    except (CheckpointError, MetricsPortError, HttpStartError, SocketPathError, StartupError,
            paged_kernel.KernelUnavailable) as exc:
        print(f"inferd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
