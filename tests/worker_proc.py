"""A real worker process for tests: attaches to memd and obeys JSON lines on stdin.

Each command gets one JSON line on stdout. Tests use it wherever two
processes must really share the pool (a process cannot test IPC with itself)
or a worker must really die (kill -9, SIGSTOP).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from dataclasses import asdict

import torch

from shared import ops
from shared.client import MemdClient, MemdError
from shared.logs import configure

OPS = {"open": ops.Open, "extend": ops.Extend, "park": ops.Park, "resume": ops.Resume, "free": ops.Free,
       "fork": ops.Fork}


REVOKED: asyncio.Queue[list] = asyncio.Queue()


def pattern(seed: int, size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)


def digest(page: torch.Tensor) -> str:
    return hashlib.sha256(page.cpu().numpy().tobytes()).hexdigest()


async def handle(client: MemdClient | None, cmd: dict) -> tuple[MemdClient | None, dict]:
    kind = cmd.pop("cmd")
    if kind == "attach":
        client = await MemdClient.attach(cmd.pop("address"), **cmd)
        client.on_revoke = lambda seq_id, reason: REVOKED.put_nowait([seq_id, reason])
        return client, {"worker_id": client.worker_id, "num_blocks": client.geometry.num_blocks,
                        "block_bytes": client.geometry.block_bytes, "backend": client.attachment.backend}
    assert client is not None, "attach first"
    if kind == "lease_lost":        # waits until memd ends the lease stream
        await asyncio.wait_for(client.lease_lost.wait(), cmd.get("timeout", 30))
        return client, {"lost": True}
    if kind == "revoked":           # waits for the next revocation memd sends
        seq_id, reason = await asyncio.wait_for(REVOKED.get(), cmd.get("timeout", 30))
        return client, {"seq_id": seq_id, "reason": reason}
    if kind == "step":
        try:
            results = await client.step(*[OPS[op.pop("kind")](**op) for op in cmd["ops"]])
        except MemdError as err:
            return client, {"error": {"code": err.code.name, "message": err.message, "op_index": err.op_index}}
        return client, {"results": [asdict(r) for r in results]}
    pages = client.pool.pages
    if kind == "write":
        page = pattern(cmd["seed"], pages.shape[1]).to(pages.device)
        pages[cmd["block"]].copy_(page)
        return client, {"digest": digest(page)}
    if kind == "write_bytes":     # a few bytes at an offset, as a partial K/V write would
        data = torch.tensor(cmd["data"], dtype=torch.uint8, device=pages.device)
        pages[cmd["block"], cmd["offset"]:cmd["offset"] + len(data)] = data
        return client, {}
    if kind == "read":
        page = pages[cmd["block"]]
        return client, {"digest": digest(page), "zero": not bool(page.any()), "head": page[:8].tolist()}
    raise ValueError(f"unknown command {kind}")


async def main() -> None:
    configure("warning", "json")       # logs to stderr: stdout carries the replies
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    client = None
    while line := await reader.readline():
        cmd = json.loads(line)
        try:
            client, reply = await handle(client, cmd)
        except Exception as exc:      # report, keep serving: the test decides what is fatal
            reply = {"exception": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    if client is not None:
        await client.close()


if __name__ == "__main__":
    asyncio.run(main())
