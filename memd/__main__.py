"""memd: its flags. Start-up is memd.startup's, serving memd.daemon's.

Nothing here imports what only serving needs: memd.startup says why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memd.kv_events import DEFAULT_TOPIC
from memd.memory import PoolMemoryError
from memd.startup import StartupError, run
from memd.state_dir import StateError
from memd.token_files import AccessError
from shared import address as addr
from shared.command_line import Ignored, Parser, entry_point
from shared.config import Layers, add_config_flags
from shared.flag_types import byte_size, count, number, port, seconds, seconds_or_zero
from shared.geometry import GeometryError, PoolGeometry, plan_pool, read_model_shape
from shared.logs import configure
from shared.sizes import parse_size


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="memd", description="kvpool's KV block pool daemon.", version=True)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    p.add_argument("--pool-bytes", type=byte_size(), default=parse_size("256MiB"),
                   help="memory for KV pages, e.g. 64MiB, 20GiB (default: 256MiB)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--block-bytes", type=byte_size(), help="bytes of one page (default: 64KiB)")
    size.add_argument("--model", type=Path, help="Hugging Face model dir: derive the page from its config.json")
    p.add_argument("--block-size", type=count(), default=16, help="tokens per block with --model (default: 16)")
    p.add_argument("--dtype", help="KV dtype with --model (default: the config's torch_dtype)")
    p.add_argument("--listen", help=f"unix:PATH or HOST:PORT (default: {addr.default_address()})")
    p.add_argument("--lease-timeout", type=seconds, default=10.0,
                   help="seconds without heartbeats before a worker is reclaimed (default: 10)")
    p.add_argument("--heat-decay", type=number(above=0, at_most=1), default=0.9,
                   help="heat factor per interval, in (0, 1] (default: 0.9)")
    p.add_argument("--heat-interval", type=seconds, default=10.0, help="seconds per heat decay (default: 10)")
    p.add_argument("--swap-ratio", type=number(at_least=0), default=0.3,
                   help="host swap tier as a fraction of the pool, allocated and locked at start-up (default: 0.3)")
    p.add_argument("--disable-swap", action="store_true", help="no swap tier: evicted sequences are dropped")
    p.add_argument("--idle-ttl", type=seconds_or_zero, default=300.0,
                   help="drop parked and swapped sequences idle this many seconds; 0 = never (default: 300)")
    p.add_argument("--free-watermark", type=number(at_least=0, below=1), default=0.02,
                   help="keep this fraction of blocks free by evicting cold parked sequences (default: 0.02)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="never share blocks between sequences by content: every new sequence computes its whole "
                        "prompt (a session's parked history is still resumed); for measuring what the cache is worth")
    p.add_argument("--token-file", type=Path,
                   help="the worker token (group-readable): kept if it exists, else written; required with TCP "
                        "(default: a fresh one at every start, next to the socket: SOCKET.token)")
    p.add_argument("--admin-token-file", type=Path,
                   help="the admin token (owner-only), as --token-file (default: SOCKET.admin-token)")
    p.add_argument("--quotas", type=Path, metavar="FILE",
                   help="page quotas per tenant and model (TOML: [tenants.NAME] / [models.NAME] with "
                        "guaranteed_pages, max_pages); memctl quota changes them at run time")
    p.add_argument("--state-dir", type=Path,
                   help="where the pool file, swap file and journal live, so parked sessions outlive a memd crash "
                        "or restart; put it on tmpfs; 'none' = keep nothing (default: SOCKET.state beside a Unix "
                        "socket, none on TCP)")
    p.add_argument("--journal-fsync", default="never", choices=["never", "always"],
                   help="fsync the journal after every change: only worth it on a disk, not on tmpfs (default: never)")
    p.add_argument("--scrub-interval", type=seconds_or_zero, default=0.0,
                   help="check every parked, cached and swapped page against its checksum this often, in "
                        "seconds, as memctl scrub does; 0 = only when asked (default: 0)")
    p.add_argument("--scrub-rate", type=number(above=0), default=200.0,
                   help="MB/s a periodic scrub hashes at most (default: 200)")
    cluster = p.add_argument_group("cluster tier (Mooncake Store; needs kvpool[cluster])")
    cluster.add_argument("--cluster-master", metavar="HOST:PORT",
                         help="join the Mooncake store whose mooncake_master listens here: parked sessions are "
                              "published to it (default: off, this host only)")
    cluster.add_argument("--cluster-metadata", metavar="URL",
                         help="the store's HTTP metadata server, e.g. http://HOST:8080/metadata (required with "
                              "--cluster-master)")
    cluster.add_argument("--cluster-host", default="",
                         help="this host's name or address for the store's transfer engine (default: the host name)")
    cluster.add_argument("--cluster-segment", type=byte_size(), default=parse_size("256MiB"),
                         help="memory this memd contributes to the store (default: 256MiB)")
    cluster.add_argument("--cluster-replicas", type=count(), default=2,
                         help="copies of each object, on different hosts' segments (default: 2)")
    events = p.add_argument_group("KV events (vLLM's format, for prefix-aware routers)")
    events.add_argument("--kv-events", metavar="tcp://HOST:PORT",
                        help="publish the pool's prefix cache and swap tier as KV events on a ZMQ PUB socket here "
                             "(default: off)")
    events.add_argument("--kv-events-replay", metavar="tcp://HOST:PORT",
                        help="the replay socket (ROUTER) for subscribers that missed batches (default: the next "
                             "port after --kv-events)")
    events.add_argument("--kv-events-topic", default=DEFAULT_TOPIC,
                        help="the topic a model's batches are sent under; {host} is this host's name, {model} the "
                             "model's namespace (default: kv@{host}@{model}, as llm-d's indexer reads them)")
    p.add_argument("--metrics-port", type=port, default=0,
                   help="serve Prometheus metrics over HTTP on this port; 0 = off (default: 0)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port (default: 127.0.0.1)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    add_config_flags(p, "MEMD")
    return p


# Settings that do nothing in some company: memd says so at start rather than leave the operator guessing.
IGNORED = (
    Ignored("block_size", "it sizes the page from --model (with --block-bytes each worker says its own)",
            without="model"),
    Ignored("dtype", "it sizes the page from --model", without="model"),
    Ignored("swap_ratio", "--disable-swap leaves no swap tier", alongside="disable_swap"),
    Ignored("scrub_rate", "it paces the periodic scrub, which --scrub-interval turns on", without="scrub_interval"),
    Ignored("metrics_host", "metrics are off without --metrics-port", without="metrics_port"),
    *(Ignored(flag, "the cluster tier is off without --cluster-master", without="cluster_master")
      for flag in ("cluster_metadata", "cluster_host", "cluster_segment", "cluster_replicas")),
)


def plan(args: argparse.Namespace) -> PoolGeometry:
    if args.model is not None:
        shape = read_model_shape(args.model, args.dtype)
        return plan_pool(args.pool_bytes, shape=shape, block_size=args.block_size)
    return plan_pool(args.pool_bytes, block_bytes=args.block_bytes or parse_size("64KiB"))


@entry_point("memd")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    layers = Layers(parser, "MEMD")
    args = parser.parse_args(argv)
    if (done := layers.settle(args, "memd", IGNORED)) is not None:
        return done
    configure(args.log_level, args.log_format)
    try:
        run(args, plan(args))
    except (GeometryError, PoolMemoryError, StartupError, AccessError, StateError) as exc:
        print(f"memd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
