"""kvpool end to end on the CPU: memd, one inferd, a three-turn chat over the OpenAI API.

    python -m inferd.demo

Writes a tiny random Llama checkpoint (with a chat template), starts memd
(its pool sized from the checkpoint) and an inferd serving it over gRPC and
the OpenAI-compatible HTTP API, then chats with the official `openai` client:
turn 1 sends a long system prompt, and every turn resends the whole
conversation, as OpenAI clients do. kvpool reuses the KV of everything said
before from memd (the `X-Session-Id` header keeps the conversation's sequence
parked between turns), so only the new tokens are computed: compare the cached
tokens and the time to first token. The weights are random, so the replies
are word salad; the mechanics are real.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

from inferd import paged_kernel
from inferd.tiny import CORPUS, DEMO_SHAPE, make_tiny_model
from shared.launch import LaunchError, free_port, spawn_ready

SYSTEM = "You are a helpful assistant for a serving team.\n" + CORPUS * 2
TURNS = [
    "What does the memory manager do?",
    "And what happens when a worker crashes?",
    "Thank you! One more question: what is time to first token?",
]


def chat(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    messages = [{"role": "system", "content": SYSTEM}]
    for number, message in enumerate(TURNS, 1):
        print(f"\nturn {number} > {message!r}")
        print("  reply: ", end="", flush=True)
        messages.append({"role": "user", "content": message})
        started, first, reply, usage = time.monotonic(), 0.0, "", None
        stream = client.chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"X-Session-Id": "demo-chat"})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.monotonic() - started
                    reply += choice.delta.content
                    print(choice.delta.content, end="", flush=True)
        messages.append({"role": "assistant", "content": reply})
        if usage is None:
            raise openai.APIError("the stream ended without usage", None, body=None)
        cached = usage.prompt_tokens_details.cached_tokens
        print(f"\n  prompt {usage.prompt_tokens} tokens (the whole conversation), of which {cached} reused from "
              f"memd ({usage.prompt_tokens - cached} computed); first token after {first * 1000:.1f} ms")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvpool-demo-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny-llama", **DEMO_SHAPE, seed=0)
        print(f"tiny checkpoint: {model} (4 layers, hidden 256, 8 heads, random weights)")
        memd_addr, inferd_addr = f"unix:{work / 'memd.sock'}", f"unix:{work / 'inferd.sock'}"
        daemons: list[subprocess.Popen[bytes]] = []
        try:
            with open(work / "memd.log", "w") as memd_log, open(work / "inferd.log", "w") as inferd_log:
                daemons.append(spawn_ready(["memd", "--device", "cpu", "--model", str(model), "--block-size", "16",
                                            "--pool-bytes", "64MiB", "--listen", memd_addr, "--log-format", "json"],
                                           work, stderr=memd_log.fileno()))
                print(f"memd ready on {memd_addr}")
                http = f"127.0.0.1:{free_port()}"
                if (cxx := paged_kernel.compiler()) is not None and not paged_kernel.library_path(cxx).exists():
                    print("inferd builds its CPU kernels for this machine first (once, kept in "
                          f"{paged_kernel.cache_dir()}): 13-36 s on 2 cores", flush=True)
                daemons.append(spawn_ready(["inferd", "serve", "--model", str(model), "--memd", memd_addr,
                                            "--listen", inferd_addr, "--http", http, "--log-format", "json"],
                                           work, stderr=inferd_log.fileno()))
                print(f"inferd ready on {inferd_addr} (gRPC) and http://{http}/v1 (OpenAI API)")
                chat(f"http://{http}")
                for command in (["stats"], ["check"]):
                    print(f"\n$ memctl {' '.join(command)}", flush=True)
                    subprocess.run([sys.executable, "-m", "memd.memctl", "--address", memd_addr, *command],
                                   check=True)
        except (LaunchError, OSError, subprocess.CalledProcessError, openai.OpenAIError) as exc:
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
