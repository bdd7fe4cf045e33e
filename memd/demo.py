"""The embedded default, end to end: memd on CPU, two workers, one shared pool.

    python -m memd.demo

Starts memd with its default pool, attaches a worker that writes K/V bytes
for a chat turn straight into its pages and parks the session, attaches a
second worker that resumes the session and reads the same bytes (zero copy),
opens a prompt that shares the first one's prefix (served from the prefix
cache), frees everything, and prints `memctl stats` and `memctl check`.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from shared.client import MemdClient
from shared.launch import spawn_ready
from shared.ops import Extend, Free, Open, Park, Resume

BLOCK_SIZE = 16                      # tokens per block
PAGE = (2, 2, BLOCK_SIZE, 4, 32)     # a tiny model: layers, K/V, tokens, kv_heads, head_dim (fp32: 16 KiB)


def start_memd(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    address = f"unix:{workdir / 'memd.sock'}"
    return spawn_ready(["memd", "--device", "cpu", "--listen", address, "--log-format", "console"], workdir), address


def memctl(address: str, *args: str) -> None:
    print(f"\n$ memctl {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "memd.memctl", "--address", address, *args], check=True)


async def chat(address: str) -> None:
    prompt = list(range(1, 70))                        # 69 tokens: 4 full blocks and a partial one
    writer = await MemdClient.attach(address, model="demo", block_size=BLOCK_SIZE, name="worker-a")
    kv = writer.pool.view(torch.float32, PAGE)
    opened, = await writer.step(Open(prompt, reserve=1, session_id="alice"))
    # "Prefill": write K/V for every prompt token straight into the pool.
    for i, block in enumerate(opened.block_ids):
        kv[block].fill_(float(i + 1))
    await writer.step(Park(opened.seq_id, append=[70], commit_to=len(prompt)))
    print(f"worker-a: opened session alice, {len(prompt)} tokens in blocks {opened.block_ids}, parked it")
    await writer.close()

    reader = await MemdClient.attach(address, model="demo", block_size=BLOCK_SIZE, name="worker-b")
    kv = reader.pool.view(torch.float32, PAGE)
    resumed, = await reader.step(Resume(session_id="alice", reserve=8))
    same = all(bool((kv[b] == float(i + 1)).all()) for i, b in enumerate(opened.block_ids))
    print(f"worker-b: resumed alice with {resumed.num_committed} committed tokens, "
          f"{len(resumed.token_ids or [])} known; K/V bytes identical: {same}")
    await reader.step(Extend(resumed.seq_id, commit_to=len(resumed.token_ids or []), reserve=8))

    other, = await reader.step(Open(prompt[:64] + [900, 901], session_id="bob"))
    print(f"worker-b: opened session bob sharing alice's first {other.num_cached} tokens "
          f"(blocks {other.block_ids[:other.num_cached // BLOCK_SIZE]}: no recompute)")
    await reader.step(Free(resumed.seq_id), Free(other.seq_id))
    print("worker-b: freed both sessions")
    await reader.close()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvpool-demo-") as tmp:
        proc, address = start_memd(Path(tmp))
        try:
            asyncio.run(chat(address))
            memctl(address, "stats")
            memctl(address, "check")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
