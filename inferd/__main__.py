"""inferd: the inference worker's command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inferd.tiny import ARCH_CLASSES, make_tiny_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inferd", description="kvpool's inference worker.")
    sub = p.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny-model", help="write a small seeded random checkpoint (for tests and demos)")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--arch", choices=sorted(ARCH_CLASSES), default="llama")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--hidden", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--vocab", type=int, default=512)
    tiny.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "make-tiny-model":
        try:
            out = make_tiny_model(args.dir, arch=args.arch, seed=args.seed, hidden=args.hidden, layers=args.layers,
                                  heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, dtype=args.dtype)
        except (ValueError, OSError) as exc:
            print(f"inferd: {exc}", file=sys.stderr)
            return 1
        print(f"wrote a tiny {args.arch} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
