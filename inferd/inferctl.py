"""inferctl: talk to an inferd.

    inferctl [--address ADDR] generate PROMPT [--session S] [--max-tokens N] [--temperature T] [--json]
    inferctl [--address ADDR] reset SESSION
    inferctl [--address ADDR] chat [--session S]

Exit codes: 0 done; 1 refused (bad input, unknown session); 2 inferd unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict

from shared import address as addr
from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inferctl", description="Generate text with a running inferd.")
    p.add_argument("--address", help="inferd address (default: $INFERD_ADDRESS, else the per-user socket)")
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="one completion, streamed")
    gen.add_argument("prompt")
    _sampling_flags(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, usage")
    reset = sub.add_parser("reset", help="forget a session's KV")
    reset.add_argument("session")
    chat = sub.add_parser("chat", help="an interactive multi-turn session (one line per message)")
    _sampling_flags(chat)
    return p


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--session", help="session id (chat: default a new one)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens")
    p.add_argument("--timeout", type=float, help="deadline in seconds")


def request_of(args: argparse.Namespace, prompt: str, session: str | None) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(prompt=prompt, session_id=session or "", max_tokens=args.max_tokens,
                             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, stop=args.stop,
                             ignore_eos=args.ignore_eos)
    if args.seed is not None:
        msg.seed = args.seed
    return msg


async def generate(stub: pb_grpc.InferdStub, msg: pb.GenerateRequest, out: TextIO | None,
                   timeout: float | None) -> dict[str, Any]:
    """Stream one completion, echoing text to `out`; returns text, token ids, finish reason and usage."""
    text, token_ids, last = [], [], pb.GenerateReply()
    async for reply in stub.Generate(msg, timeout=timeout):
        text.append(reply.text)
        token_ids += reply.token_ids
        if out is not None and reply.text:
            out.write(reply.text)
            out.flush()
        last = reply
    usage = MessageToDict(last.usage, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return {"text": "".join(text), "token_ids": token_ids, "finish_reason": last.finish_reason, "usage": usage}


async def run(args: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(addr.resolve(args.address, "inferd")) as channel:
        stub = pb_grpc.InferdStub(channel)
        if args.command == "generate":
            result = await generate(stub, request_of(args, args.prompt, args.session), None if args.json else
                                    sys.stdout, args.timeout)
            print(json.dumps(result) if args.json else "")
        elif args.command == "reset":
            await stub.Reset(pb.ResetRequest(session_id=args.session))
            print(f"session {args.session} reset")
        else:
            session = args.session or f"chat-{uuid.uuid4().hex[:8]}"
            print(f"session {session}; one message per line, end with Ctrl-D", file=sys.stderr)
            for line in sys.stdin:
                if not line.strip():
                    continue
                result = await generate(stub, request_of(args, line.rstrip("\n"), session), sys.stdout,
                                        args.timeout)
                u = result["usage"]
                print(f"\n  [{u['completion_tokens']} tokens, {u['cached_tokens']} of {u['prompt_tokens']} prompt "
                      f"tokens cached, first token {u['ttft_ms']:.1f} ms]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(run(args))
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            print(f"inferctl: inferd is not reachable at {addr.resolve(args.address, 'inferd')}: {err.details()}",
                  file=sys.stderr)
            return 2
        print(f"inferctl: {err.code().name.lower().replace('_', ' ')}: {err.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
