"""Hosts for a bench, started as their users start them: memd (publishing its KV events) and inferd serving HTTP
on each, and kvroute in front of them when there are several.

Each start gets sockets, and so memd state directories, of its own: a fresh
memd recovers nothing of the one before it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from shared.launch import free_port, free_port_pair, spawn_ready

BLOCK_SIZE = 16         # tokens per page of every memd started here


@contextmanager
def serving(work: Path, model_dir: Path, *, hosts: int, pool: str, kvroute: bool, route_by_events: bool = True,
            memd_flags: Sequence[str] = (), inferd_flags: Sequence[str] = (),
            kvroute_flags: Sequence[str] = ()) -> Iterator[str]:
    """The base URL (http://HOST:PORT) of kvroute in front of `hosts` hosts (`kvroute`), or of the one host's
    inferd; each memd with a pool of `pool`. `route_by_events`: kvroute reads every memd's KV events (its
    --kv-events), else it routes by the prompt's text. The daemons' logs go to work/daemons.log."""
    name = f"run{len(list(work.glob('memd-run*-0.sock*')))}"
    procs: list[subprocess.Popen[bytes]] = []
    log = open(work / "daemons.log", "a")     # noqa: SIM115 (closed below, after the daemons)
    try:
        urls, events = [], []
        for host in range(hosts):
            memd_addr, http, events_port = f"unix:{work / f'memd-{name}-{host}.sock'}", free_port(), \
                free_port_pair()
            procs.append(spawn_ready(["memd", "--device", "cpu", "--model", str(model_dir),
                                      "--block-size", str(BLOCK_SIZE), "--pool-bytes", pool, "--listen", memd_addr,
                                      "--kv-events", f"tcp://127.0.0.1:{events_port}", *memd_flags,
                                      "--log-format", "json"],
                                     work, stderr=log.fileno()))
            procs.append(spawn_ready(["inferd", "serve", "--model", str(model_dir), "--memd", memd_addr,
                                      "--listen", f"unix:{work / f'inferd-{name}-{host}.sock'}",
                                      "--http", f"127.0.0.1:{http}", "--served-model-name", "tiny", *inferd_flags,
                                      "--log-format", "json"], work, stderr=log.fileno()))
            urls.append(f"http://127.0.0.1:{http}")
            events += ["--kv-events", f"tcp://127.0.0.1:{events_port}={urls[-1]}"]
        if not kvroute:
            yield urls[0]
            return
        port = free_port()
        procs.append(spawn_ready(["kvroute", "--http", f"127.0.0.1:{port}",
                                  *[flag for url in urls for flag in ("--worker", url)], *kvroute_flags,
                                  *(events if route_by_events else []), "--log-format", "json"],
                                 work, stderr=log.fileno()))
        yield f"http://127.0.0.1:{port}"
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=30)
        log.close()
