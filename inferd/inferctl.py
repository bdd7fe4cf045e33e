"""inferctl: talk to an inferd.

    inferctl [--address ADDR] generate PROMPT [--session S] [--max-tokens N] [--temperature T] [--json]
    inferctl [--address ADDR] reset SESSION
    inferctl [--address ADDR] chat [--session S]

Exit codes: 0 done; 1 refused (bad input, unknown session); 2 inferd unreachable or a wrong command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import sys
import uuid
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict

from shared import address as addr
from shared.command_line import Parser, entry_point
from shared.flag_types import UINT32_MAX, number, timeout
from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc

MAX_SEED = 2**63 - 1         # inferd's torch generators take a signed 64-bit seed (inferd.sampling.MAX_SEED)
MAX_TEMPERATURE = 100.0      # SamplingParams.check refuses more


class BadInput(argparse.ArgumentTypeError):
    """Input inferctl cannot send. Raised by an argparse type, argparse reports it against the flag (exit 2);
    found later (a chat message on stdin), main reports it in one line (exit 1)."""


def _utf8(value: str) -> str:
    """`value` if protobuf can send it: a command line or stdin that is not UTF-8 decodes to lone surrogates,
    on which building the request raises UnicodeEncodeError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadInput(f"not valid UTF-8 (at character {err.start}): {value!r}") from None
    return value


def utf8_text(value: str) -> str:
    """A prompt or session id: any UTF-8 text (see _utf8)."""
    return _utf8(value)


def stop_string(value: str) -> str:
    """Non-empty UTF-8: inferd refuses an empty stop string (it would match before the first token)."""
    if not value:
        raise BadInput("a stop string must not be empty")
    return _utf8(value)


def address(value: str) -> str:
    """UTF-8 (gRPC encodes the target) without NUL (gRPC's C core would silently cut the target there)."""
    if "\0" in value:
        raise BadInput(f"contains a NUL character: {value!r}")
    return _utf8(value)


max_tokens = number(int, at_least=1, at_most=UINT32_MAX)     # 0 on the wire means inferd's default (64)
top_k = number(int, at_least=0, at_most=UINT32_MAX)          # 0: no limit
seed = number(int, at_least=0, at_most=MAX_SEED)             # a uint64, but inferd's generators are signed
temperature = number(float, at_least=0, at_most=MAX_TEMPERATURE)     # 0: greedy, as SamplingParams.check allows


def top_p(value: str) -> float:
    """In (0, 1], and not so small that the wire's float32 rounds it to 0, which inferd reads as 1.0."""
    p = float(value)
    if not 0.0 < p <= 1.0 or struct.unpack("f", struct.pack("f", p))[0] == 0.0:
        raise BadInput(f"must be a number in (0, 1]: {value}")
    return p



def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="inferctl", description="Generate text with a running inferd.", version=True)
    p.add_argument("--address", type=address,
                   help="inferd address (default: $INFERD_ADDRESS, else the per-user socket if it exists, "
                        "else the one inferd@NAME unit's /run/inferd/NAME/inferd.sock)")
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="one completion, streamed")
    gen.add_argument("prompt", type=utf8_text)
    _sampling_flags(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, usage")
    reset = sub.add_parser("reset", help="forget a session's KV")
    reset.add_argument("session", type=utf8_text)
    chat = sub.add_parser("chat", help="an interactive multi-turn session (one line per message)")
    _sampling_flags(chat)
    return p


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--session", type=utf8_text, help="session id (chat: default a new one)")
    p.add_argument("--max-tokens", type=max_tokens, default=64, help="at least 1 (default: 64)")
    p.add_argument("--temperature", type=temperature, default=0.0, help="in [0, 100]; 0: greedy (default)")
    p.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1] (default: 1)")
    p.add_argument("--top-k", type=top_k, default=0, help="0: no limit (default)")
    p.add_argument("--seed", type=seed, help=f"in [0, {MAX_SEED}]")
    p.add_argument("--stop", type=stop_string, action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens")
    p.add_argument("--timeout", type=timeout, help="deadline in seconds")


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


async def run(args: argparse.Namespace, target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
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
            for line in _lines(sys.stdin):
                if not line.strip():
                    continue
                try:
                    message = _utf8(line.rstrip("\n"))
                except BadInput as err:
                    raise BadInput(f"a message on standard input is {err}") from None
                result = await generate(stub, request_of(args, message, session), sys.stdout,
                                        args.timeout)
                print()              # the reply's line ends on stdout, where a script reads the replies
                u = result["usage"]
                print(f"  [{u['completion_tokens']} tokens, {u['cached_tokens']} of {u['prompt_tokens']} prompt "
                      f"tokens cached, first token {u['ttft_ms']:.1f} ms]", file=sys.stderr)
    return 0


def _lines(stdin: TextIO) -> TextIO:
    """stdin's lines, undecodable bytes kept as surrogates (that _utf8 then refuses in one line) rather than a
    UnicodeDecodeError from inside the loop."""
    reconfigure = getattr(stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")
    return stdin


@entry_point("inferctl")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        target = address(addr.connect_target(args.address, "inferd"))
    except BadInput as err:    # only $INFERD_ADDRESS gets here: --address was checked by its type
        parser.error(f"${addr.ENV['inferd']}: {err}")
    try:
        return asyncio.run(run(args, target))
    except BadInput as err:
        print(f"inferctl: {err}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.UNAVAILABLE and not addr.answered(err):
            print(f"inferctl: {addr.not_reachable('inferd', target, err.details())}", file=sys.stderr)
            return 2
        print(f"inferctl: {err.code().name.lower().replace('_', ' ')}: {err.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
