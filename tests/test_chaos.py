"""Chaos across hosts: anything killed at any time, every answer right, nothing lost, nothing leaked.

Two hosts (memd + two inferd workers each, memd in the cluster tier), one
mooncake_master, two kvroutes in front of all four workers. Chats through the
`openai` client against either kvroute, half with `X-Session-Id`; some turns
are cancelled midway (sent again), some sessions reset. Every few seconds
(seeded) one part is killed with SIGKILL, an inferd, a memd, a kvroute or the
master, and started again after 0-3 s (the master sometimes stays down
longer); now and then a worker is stopped (SIGSTOP) past its lease and let
go again. Clients retry as users do: a failed turn is sent again, the same
conversation, after a pause.

Judged: every answered turn is `transformers`' greedy answer to the tokens
sent (tie-aware, tests/answers.py); no turn was applied twice (memd's history
is the conversation sent, every time); after the run and a reset of every
session, on both hosts `memctl check` is clean, no page is used, every swap
slot is free, the store holds no session record, and both kvroutes' loads
are 0; every worker killed shows as a reclaim, every memd killed as a
recovery. The report also counts what kills of the other parts left: the
kvroutes' failovers from a lost worker, the clients' retries on the other
kvroute, the store errors memd and kvroute met while the master was away.

Bounded for CI (`--chaos-seconds`, default 10); the run by hand:

    .venv/bin/python -m pytest tests/test_chaos.py --chaos-seconds 600 --chaos-chats 64 --chaos-seed 1 \\
        --timeout 0 -s -n0
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from memd.cluster import session_key
from shared.launch import free_port
from tests.conftest import Daemon, start_daemon
from tests.store_master import MASTER, Store

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.timeout(3600),
              pytest.mark.skipif(importlib.util.find_spec("mooncake") is None or not MASTER.exists(),
                                 reason="needs kvpool[cluster] (Mooncake Store's client and master)")]

MODEL = "tiny"
TURN_TIMEOUT_S = 60.0           # the client's: a turn with no answer by then is an incident, sent again
WORKER_HEADER = "x-kvroute-worker"
HOSTS, WORKERS_PER_HOST, ROUTERS = ("a", "b"), 2, 2
LEASE_S = 2.0                   # memd's --lease-timeout: a worker stopped longer is reclaimed
KINDS = ("inferd", "memd", "kvroute", "master")


@dataclass
class Part:
    """One process of the fleet, and how to start it again on the same sockets and ports."""

    kind: str
    name: str
    start: Callable[[], Awaitable[Daemon | None]]
    stop: Callable[[], Awaitable[None]] | None = None       # how to kill it when it is no Daemon (the master)
    daemon: Daemon | None = None
    up: asyncio.Event = field(default_factory=asyncio.Event)
    logs: list[Daemon] = field(default_factory=list)     # every process it has been, for their log lines

    async def launch(self) -> None:
        self.daemon = await self.start()
        if self.daemon is not None:
            self.logs.append(self.daemon)
        self.up.set()

    async def kill(self) -> None:
        self.up.clear()
        if self.stop is not None:
            await self.stop()
        elif self.daemon is not None:
            await self.daemon.kill()


@dataclass
class Turn:
    prompt: list[int]
    answer: list[int]
    cached: int
    ttft_s: float
    chaos: bool                    # sent while the monkey was at work


@dataclass
class Incident:
    """A turn answered with HTTP 500, or that waited past the client's timeout: where it went, and when."""

    what: str
    kvroute: str
    worker: str | None             # where that kvroute sent it, if its answer said so
    sent: float                    # wall-clock seconds
    ended: float
    request_id: str = ""           # its X-Request-Id: the worker that had it logs it (inferd takes the client's)


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    turns: list[Turn] = field(default_factory=list)
    sessions: set[str] = field(default_factory=set)
    incidents: list[tuple[str | None, Incident]] = field(default_factory=list)    # (session, incident)
    chaos: bool = False


class Fleet:
    def __init__(self, tmp: Path, model_dir: Path, store: Store, daemons: list[Daemon]) -> None:
        self.tmp, self.model_dir, self.store, self.daemons = tmp, model_dir, store, daemons
        self.memds: dict[str, Part] = {}
        self.workers: list[Part] = []
        self.routers: list[Part] = []
        self.router_urls: list[str] = []
        self.worker_urls: list[str] = []

    async def _daemon(self, argv: list[str], name: str, listen: bool = True) -> Daemon:
        self.daemons.append(await start_daemon(self.tmp, argv, name=name, listen=listen))
        return self.daemons[-1]

    async def start(self) -> None:
        master = Part("master", "master", self._master, self.store.kill)
        await master.launch()
        self.master = master
        for host in HOSTS:
            flags = ["memd", "--device", "cpu", "--pool-bytes", "4MiB", "--model", str(self.model_dir),
                     "--block-size", "16", "--swap-ratio", "0.25", "--lease-timeout", str(LEASE_S),
                     *self.store.flags()]
            memd = Part("memd", f"memd-{host}", lambda flags=flags, host=host: self._daemon(flags, f"memd-{host}"))
            await memd.launch()
            self.memds[host] = memd
            for i in range(WORKERS_PER_HOST):
                port = free_port()
                self.worker_urls.append(f"http://127.0.0.1:{port}")
                argv = ["inferd", "serve", "--model", str(self.model_dir), "--memd", memd.daemon.address,
                        "--threads", "1", "--http", f"127.0.0.1:{port}", "--served-model-name", MODEL]
                name = f"inferd-{host}{i}"
                self.workers.append(Part("inferd", name, lambda argv=argv, name=name: self._daemon(argv, name)))
        await asyncio.gather(*(w.launch() for w in self.workers))
        for n in range(ROUTERS):
            port = free_port()
            self.router_urls.append(f"http://127.0.0.1:{port}")
            argv = ["kvroute", "--http", f"127.0.0.1:{port}", *[f for u in self.worker_urls for f in ("--worker", u)],
                    *self.store.router_flags()]
            name = f"kvroute-{n}"
            self.routers.append(Part("kvroute", name, lambda argv=argv, name=name: self._daemon(argv, name, False)))
        await asyncio.gather(*(r.launch() for r in self.routers))

    async def _master(self) -> None:
        await self.store.start()

    def parts(self) -> list[Part]:
        return [*self.workers, *self.memds.values(), *self.routers, self.master]

    async def all_up(self) -> None:
        for part in self.parts():
            await part.up.wait()


async def monkey(fleet: Fleet, rng: random.Random, stop: asyncio.Event, tally: Tally, every_s: float) -> None:
    """Every `every_s` seconds one part killed -9 and started again 0-3 s later; now and then a worker stopped
    past its lease instead, or the master left down for a while."""
    master_back: asyncio.Task[None] | None = None
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)          # the monkey's pace, not a wait for an event
        if stop.is_set():
            break
        if rng.random() < 0.15:
            victim = rng.choice(fleet.workers)
            if victim.daemon is not None and victim.up.is_set():
                pid = victim.daemon.proc.pid
                lease = await expect_reclaim(fleet, victim, tally)
                os.kill(pid, signal.SIGSTOP)
                tally.counts["stopped past its lease"] += 1
                await asyncio.sleep(LEASE_S * 1.5)                # stopped past its lease: memd's to reclaim
                await reclaimed(fleet, victim, lease)
                os.kill(pid, signal.SIGCONT)
            continue
        kind = rng.choice(KINDS)
        if kind == "master" and master_back is not None and not master_back.done():
            continue
        victim = fleet.master if kind == "master" else rng.choice(
            {"inferd": fleet.workers, "memd": list(fleet.memds.values()), "kvroute": fleet.routers}[kind])
        if kind == "inferd":
            await expect_reclaim(fleet, victim, tally)
        await victim.kill()
        tally.counts[f"killed: {kind}"] += 1
        # the master's long outage: 10-30 s, or 5-10 s in the suite's short run (whose end waits for it)
        long = (10, 30) if every_s >= 5 else (2 * every_s, 4 * every_s)
        down = rng.uniform(0, 3) if kind != "master" or rng.random() < 0.7 else rng.uniform(*long)
        if kind == "master":
            master_back = asyncio.ensure_future(_later(victim, down))
        else:
            await asyncio.sleep(down)
            await victim.launch()
    if master_back is not None:
        await master_back


async def expect_reclaim(fleet: Fleet, worker: Part, tally: Tally) -> int | None:
    """A worker about to be killed or stopped: if it holds a lease in its memd now, memd must reclaim it (one
    killed again before it attached, or while its memd is down, leaves nothing to reclaim). Returns memd's id of
    that lease, if any."""
    memd = fleet.memds[worker.name.removeprefix("inferd-")[0]]
    if worker.daemon is None or memd.daemon is None or not memd.up.is_set():
        return None
    with contextlib.suppress(Exception):
        async with memd.daemon.admin() as admin:
            attached = {w.pid: w.worker_id for w in (await admin.snapshot(blocks=False)).workers}
        if worker.daemon.proc.pid in attached:
            tally.counts["leases to reclaim"] += 1
            return attached[worker.daemon.proc.pid]
    return None


async def reclaimed(fleet: Fleet, worker: Part, lease: int | None) -> None:
    """Until the worker's memd has reclaimed `lease` (its log says so), or has exited: a worker stopped past its
    lease is let go on only then, or a busy memd whose sweep comes late would see it beat again first."""
    memd = fleet.memds[worker.name.removeprefix("inferd-")[0]].daemon
    if lease is None or memd is None:
        return
    with contextlib.suppress(TimeoutError, AssertionError):        # memd killed meanwhile: nothing more to wait for
        await memd.log.wait_for("worker reclaimed", timeout=60, worker=lease)


async def _later(part: Part, delay: float) -> None:
    await asyncio.sleep(delay)
    await part.launch()


class Retry(Exception):
    """A turn to send again: what failed, for the tally (and, for a 500 or a timeout, the incident)."""

    def __init__(self, why: str, incident: Incident | None = None) -> None:
        super().__init__(why)
        self.incident = incident


async def send_turn(url: str, prompt: list[int], session: str | None, max_tokens: int, *,
                    cancel_after: int = 0) -> tuple[list[int], int, int, float] | None:
    """One streamed greedy turn: (answer ids, prompt tokens, cached tokens, time to first token); None if
    cancelled after `cancel_after` chunks (the client walked away)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TURN_TIMEOUT_S)
    started, first, answer, usage = time.perf_counter(), None, [], None
    sent, worker, request_id = time.time(), None, f"chaos-{uuid.uuid4().hex[:12]}"
    try:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            extra_headers={"X-Request-Id": request_id, **({"X-Session-Id": session} if session else {})})
        worker = stream.response.headers.get(WORKER_HEADER)
        chunks = 0
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.logprobs is not None and choice.logprobs.tokens:
                    first = first if first is not None else time.perf_counter() - started
                    answer += [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
                    chunks += 1
            if cancel_after and chunks >= cancel_after:
                await stream.close()
                return None
    except openai.APIStatusError as err:            # a 500 is a bug somewhere: its words go in the report
        if err.status_code != 500:
            raise Retry(f"HTTP {err.status_code}") from None
        raise Retry(f"HTTP 500: {err.message[:160]}", Incident(
            f"HTTP 500: {err.message[:300]}", url, err.response.headers.get(WORKER_HEADER), sent, time.time(),
            request_id)) from None
    except openai.APITimeoutError:                # no byte for the client's whole timeout: which part held it?
        raise Retry("a timeout", Incident(f"no answer within {TURN_TIMEOUT_S:.0f} s", url, worker, sent,
                                          time.time(), request_id)) from None
    except (openai.APIConnectionError, httpx.HTTPError) as err:
        raise Retry(type(err).__name__) from None
    except openai.APIError:                      # an error the stream said after its 200: the turn failed midway
        raise Retry("an error in the stream") from None
    finally:
        await client.close()
    if usage is None or first is None or len(answer) != max_tokens:
        raise Retry("a stream that ended early")
    return answer, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, first


async def client(n: int, fleet: Fleet, rng: random.Random, deadline: float, tally: Tally, vocab: int,
                 turns_at_most: int) -> None:
    """One user: conversations one after another until the deadline, every other one in a session."""
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        number = tally.counts["conversations"]
        tally.counts["conversations"] += 1
        session = f"chat-{n}-{number}" if number % 2 == 0 else None
        if session:
            tally.sessions.add(session)
        await conversation(session, fleet, rng, deadline, tally, vocab, rng.randint(2, turns_at_most))


async def conversation(session: str | None, fleet: Fleet, rng: random.Random, deadline: float, tally: Tally,
                       vocab: int, turns: int) -> None:
    loop = asyncio.get_running_loop()
    history: list[int] = []
    for _ in range(turns):
        if loop.time() >= deadline:
            return
        prompt = history + [rng.randrange(vocab) for _ in range(rng.randint(8, 40))]
        max_tokens = rng.randint(4, 12)
        chaos, attempt = tally.chaos, 0
        while True:
            attempt += 1
            assert attempt <= 200, f"{session}: a turn failed 200 times"
            url = rng.choice(fleet.router_urls)
            cancel = rng.randint(1, 3) if rng.random() < 0.08 else 0
            try:
                got = await send_turn(url, prompt, session, max_tokens, cancel_after=cancel)
            except Retry as why:
                tally.counts["retried"] += 1
                tally.counts[f"retried: {why}"] += 1
                if why.incident is not None:
                    tally.incidents.append((session, why.incident))
                await asyncio.sleep(rng.uniform(0.2, 1.0))       # a user's client backs off before sending again
                continue
            if got is None:
                tally.counts["cancelled midway"] += 1
                continue                                          # sent again, as a user presses retry
            break
        answer, prompt_tokens, cached, ttft = got
        # memd's history was the conversation sent: a turn applied twice would show as more prompt tokens
        assert prompt_tokens == len(prompt), f"{session}: {prompt_tokens} prompt tokens for {len(prompt)} sent"
        assert cached <= len(prompt)
        tally.turns.append(Turn(prompt, answer, cached, ttft, chaos))
        tally.counts["turns served"] += 1
        history = prompt + answer
        if session and rng.random() < 0.08:                   # the user clears the chat
            with contextlib.suppress(httpx.HTTPError):
                async with httpx.AsyncClient(timeout=30) as http:
                    reply = await http.delete(f"{rng.choice(fleet.router_urls)}/v1/sessions/{session}")
                    if reply.status_code in (200, 404):
                        tally.counts["resets"] += 1
                        history = []


async def settled(fleet: Fleet, tally: Tally) -> dict[str, dict]:
    """Every session reset through a kvroute; then each host's stats and check, and each kvroute's load."""
    async with httpx.AsyncClient(timeout=30) as http:
        for session in sorted(tally.sessions):
            for attempt in range(150):    # a 503 while a worker that may hold it is down (kvroute did not ask it)
                reply = await http.delete(f"{fleet.router_urls[attempt % ROUTERS]}/v1/sessions/{session}")
                if reply.status_code in (200, 404):
                    break
                await asyncio.sleep(0.2)                          # a worker reattaching: the reset waits
            else:
                raise AssertionError(f"resetting {session}: {reply.status_code} {reply.text}")
    found = {}
    for host, memd in fleet.memds.items():
        async with memd.daemon.admin() as admin:
            stats, check = await admin.stats(), await admin.check()
        found[host] = {"used_blocks": stats.used_blocks, "swap_free": stats.swap_free_blocks,
                       "swap_total": stats.swap_total_blocks, "sequences": dict(stats.sequences),
                       "violations": list(check.violations), "counters": dict(stats.counters)}
    return found


async def router_loads(fleet: Fleet) -> list[float]:
    loads = []
    async with httpx.AsyncClient(timeout=10) as http:
        for url in fleet.router_urls:
            text = (await http.get(f"{url}/metrics")).text
            loads += [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("kvpool_route_worker_load{")]
    return loads


def tracebacks(daemon: Daemon) -> list[str]:
    """The exception line of each traceback a daemon printed outside its JSON log (a server's own handler)."""
    found, inside = [], False
    for line in daemon.log.raw:
        if line.startswith("Traceback (most recent call last)"):
            inside = True
        elif inside and line and not line.startswith((" ", "\t")):
            found.append(line[:200])
            inside = False
    return found


def mentions(daemon: Daemon, *phrases: str) -> int:
    """Log events of a daemon whose name holds one of `phrases`: the failovers and store errors it met."""
    return sum(any(phrase in str(e.get("event", "")) for phrase in phrases) for e in daemon.log.events)


def incident_report(fleet: Fleet, session: str | None, incident: Incident) -> dict:
    """An incident with what the parts it went through logged meanwhile (warnings and worse): the kvroute, the
    worker and its memd (every worker and memd when the worker is not known)."""
    routers = dict(zip(fleet.router_urls, fleet.routers, strict=True))
    workers = dict(zip(fleet.worker_urls, fleet.workers, strict=True))
    worker = workers.get(incident.worker or "")
    mentions = {part.name: [f"{e.get('timestamp', '')[11:23]} {e.get('level')}: {e.get('event')} "
                            + json.dumps({k: v for k, v in e.items() if k not in ("timestamp", "level", "event")})
                            for d in part.logs for e in d.log.events if e.get("request") == incident.request_id]
                for part in fleet.workers}
    if worker is None and (had := [name for name, lines in mentions.items() if lines]):
        worker = next(w for w in fleet.workers if w.name == had[0])       # its answer never came: its log says
    parts = [routers[incident.kvroute]] + ([worker, fleet.memds[worker.name.removeprefix("inferd-")[0]]]
                                           if worker is not None else [*fleet.workers, *fleet.memds.values()])
    logged: dict[str, list[str]] = {}
    for part in parts:
        lines = [f"{e.get('timestamp', '')[11:23]} {e.get('level')}: {e.get('event')}"
                 + (f" ({e['error']})" if e.get("error") else "")
                 for d in part.logs for e in d.log.events
                 if e.get("level") in ("warning", "error", "critical") and _within(e, incident)]
        lines += [f"traceback: {line}" for d in part.logs for line in tracebacks(d)]
        if lines:
            logged[part.name] = lines[:12]
    return {"what": incident.what, "session": session, "kvroute": routers[incident.kvroute].name,
            "request_id": incident.request_id, "logged_of_it": {k: v for k, v in mentions.items() if v},
            "worker": worker.name if worker is not None else incident.worker,
            "sent": datetime.fromtimestamp(incident.sent, UTC).strftime("%H:%M:%S.%f")[:-3],
            "waited_s": round(incident.ended - incident.sent, 1), "logged": logged}


def _within(event: dict, incident: Incident) -> bool:
    """Whether a log event came while the turn was out (from a second before it was sent)."""
    try:
        at = datetime.fromisoformat(str(event.get("timestamp"))).timestamp()
    except ValueError:
        return False
    return incident.sent - 1 <= at <= incident.ended + 1


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


async def test_chaos_across_hosts(tmp_path, model_dir, model_judge, daemons, chaos_seconds, chaos_chats,
                                  chaos_seed):
    store = Store()
    fleet = Fleet(tmp_path, model_dir, store, daemons)
    await fleet.start()
    rng, tally = random.Random(chaos_seed), Tally()
    vocab = 512
    loop = asyncio.get_running_loop()
    quiet_s = min(8.0, chaos_seconds / 4)
    deadline = loop.time() + quiet_s + chaos_seconds
    stop = asyncio.Event()
    chats = [asyncio.ensure_future(client(n, fleet, random.Random(chaos_seed * 1000 + n), deadline, tally, vocab,
                                          10 if chaos_chats >= 32 else 4))
             for n in range(chaos_chats)]
    try:
        await asyncio.sleep(quiet_s)                     # quiet first: TTFT without chaos, for the report
        tally.chaos = True
        every_s = 5.0 if chaos_seconds >= 60 else 2.5
        ape = asyncio.ensure_future(monkey(fleet, rng, stop, tally, every_s))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(asyncio.gather(*chats)), max(0.0, deadline - loop.time()))
        stop.set()
        await ape
        tally.chaos = False
        await fleet.all_up()
        await asyncio.gather(*chats)                     # turns in flight finish (and retry) with every part up
        hosts = await settled(fleet, tally)
        records = [session_key(s) for s in sorted(tally.sessions)]
        left, _ = await asyncio.to_thread(store.look, records)
    finally:
        stop.set()
        for task in chats:
            task.cancel()
        await store.kill()
    for host, found in hosts.items():
        assert found["violations"] == [], f"host {host}: {found['violations']}"
        assert found["used_blocks"] == 0, f"host {host} holds pages after every session was reset: {found}"
        assert found["swap_free"] == found["swap_total"], f"host {host} holds swap slots: {found}"
    assert not any(left), f"session records left in the store: {[r for r, x in zip(records, left, strict=True) if x]}"
    assert all(load == 0 for load in await router_loads(fleet))

    wrong = []
    for turn in tally.turns:
        expected = model_judge.greedy(turn.prompt, len(turn.answer))
        divergence = model_judge.divergence(turn.prompt, turn.answer, expected)
        if divergence is not None and not divergence.near_tie:     # a tie is batch-shape noise, not wrong K/V
            wrong.append(str(divergence))
        tally.counts["near-ties"] += divergence is not None and divergence.near_tie
    assert not wrong, f"{len(wrong)} of {len(tally.turns)} turns answered wrong: {wrong[:5]}"

    reclaims = sum(d.log.count("worker reclaimed") for w in fleet.memds.values() for d in w.logs)
    recoveries = sum(d.log.count("recovered the sequences of the memd before") for m in fleet.memds.values()
                     for d in m.logs)
    failovers = sum(mentions(d, "its requests go to the others", "broke an answer midway")
                    for r in fleet.routers for d in r.logs)
    store_errors = sum(mentions(d, "cluster store did not take a change", "a fetch from the cluster store failed",
                                "the session directory in the cluster store")
                       for p in (*fleet.memds.values(), *fleet.routers) for d in p.logs)
    logged = Counter(f"{part.kind}: {e.get('event')}" for part in fleet.parts() for d in part.logs
                     for e in d.log.events if e.get("level") in ("error", "critical"))
    logged.update(f"{part.kind}: {line}" for part in fleet.parts() for d in part.logs for line in tracebacks(d))
    counters = Counter()
    for found in hosts.values():
        counters.update(found["counters"])
    later = [t for t in tally.turns if len(t.prompt) > 48]
    report = {"seed": chaos_seed, "seconds": chaos_seconds, "chats": chaos_chats, **tally.counts,
              "sessions fetched from the store": counters["cluster_sessions_fetched"],
              "blocks fetched from the store": counters["cluster_hits"],
              "blocks the store lost (recomputed)": counters["cluster_misses"],
              "swapped-in pages not as swapped out": counters["integrity_failures_swap_in"],
              "later turns with their history cached": sum(t.cached >= len(t.prompt) // 2 for t in later),
              "later turns recomputed": sum(t.cached < len(t.prompt) // 2 for t in later),
              "reclaims": reclaims, "recoveries": recoveries, "kvroute failovers from a worker": failovers,
              "store errors met (memd, kvroute)": store_errors, "errors logged": dict(logged),
              "incidents (HTTP 500s, timeouts)": [incident_report(fleet, session, incident)
                                                  for session, incident in tally.incidents],
              "ttft_ms": {phase: {"p50": 1000 * pct([t.ttft_s for t in tally.turns if t.chaos == chaotic], 50),
                                  "p99": 1000 * pct([t.ttft_s for t in tally.turns if t.chaos == chaotic], 99)}
                          for phase, chaotic in (("quiet", False), ("chaos", True))}}
    print("chaos report: " + json.dumps(report))
    assert reclaims >= tally.counts["leases to reclaim"]            # every lease a kill ended, memd took back
    assert recoveries == tally.counts["killed: memd"]
    assert tally.counts["turns served"] > 0 and sum(v for k, v in tally.counts.items() if k.startswith("killed"))
