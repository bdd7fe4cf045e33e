"""kvpool end to end on the CPU: memd, one inferd, a three-turn chat.

    python -m inferd.demo

Writes a tiny random Llama checkpoint, starts memd (its pool sized from the
checkpoint) and an inferd serving it, then chats: turn 1 sends a long system
prompt, turns 2 and 3 only a short message each. Every turn after the first
reuses the KV of the whole conversation from memd, so only the new tokens
are computed: compare the cached tokens and the time to first token. The
weights are random, so the replies are word salad; the mechanics are real.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc

from inferd.inferctl import generate
from inferd.tiny import CORPUS, make_tiny_model
from shared.launch import LaunchError, spawn_ready
from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc

TURNS = [
    "You are a helpful assistant for a serving team.\n" + CORPUS * 2 + "\nWhat does the memory manager do?",
    "And what happens when a worker crashes?",
    "Thank you! One more question: what is time to first token?",
]


async def chat(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferdStub(channel)
        for number, message in enumerate(TURNS, 1):
            shown = message if len(message) < 70 else message[:40] + " ... " + message[-25:]
            print(f"\nturn {number} > {shown!r}")
            print("  reply: ", end="", flush=True)
            result = await generate(stub, pb.GenerateRequest(prompt=message, session_id="demo-chat", max_tokens=24,
                                                             ignore_eos=True), sys.stdout, timeout=120)
            u = result["usage"]
            print(f"\n  prompt {u['prompt_tokens']} tokens, of which {u['cached_tokens']} reused from memd "
                  f"({u['prompt_tokens'] - u['cached_tokens']} computed); first token after {u['ttft_ms']:.1f} ms, "
                  f"then {u['tpot_ms']:.1f} ms per token")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvpool-demo-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny-llama", arch="llama", layers=4, hidden=256, heads=8, kv_heads=4,
                                vocab=4096, seed=0)
        print(f"tiny checkpoint: {model} (4 layers, hidden 256, 8 heads, random weights)")
        memd_addr, inferd_addr = f"unix:{work / 'memd.sock'}", f"unix:{work / 'inferd.sock'}"
        daemons: list[subprocess.Popen[bytes]] = []
        try:
            with open(work / "memd.log", "w") as memd_log, open(work / "inferd.log", "w") as inferd_log:
                daemons.append(spawn_ready(["memd", "--device", "cpu", "--model", str(model), "--block-size", "16",
                                            "--pool-bytes", "64MiB", "--listen", memd_addr, "--log-format", "json"],
                                           work, stderr=memd_log.fileno()))
                print(f"memd ready on {memd_addr}")
                daemons.append(spawn_ready(["inferd", "serve", "--model", str(model), "--memd", memd_addr,
                                            "--listen", inferd_addr, "--log-format", "json"],
                                           work, stderr=inferd_log.fileno()))
                print(f"inferd ready on {inferd_addr}")
                asyncio.run(chat(inferd_addr))
                for command in (["stats"], ["check"]):
                    print(f"\n$ memctl {' '.join(command)}", flush=True)
                    subprocess.run([sys.executable, "-m", "memd.memctl", "--address", memd_addr, *command],
                                   check=True)
        except (LaunchError, grpc.aio.AioRpcError, subprocess.CalledProcessError) as exc:
            print(f"demo failed: {exc}", file=sys.stderr)
            for name in ("memd.log", "inferd.log"):
                print(f"--- {name}\n" + "".join((work / name).read_text().splitlines(True)[-10:]), file=sys.stderr)
            return 1
        finally:
            for proc in reversed(daemons):
                proc.terminate()
                proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
