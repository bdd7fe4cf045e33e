"""Sustained load with faults: 4 workers, multi-turn chats, cancels, resets, forced evictions, a worker killed.

Bounded for CI (`--soak-seconds`, default 12); run it longer by hand:

    .venv/bin/python -m pytest tests/test_soak.py --soak-seconds 600 --timeout 0 -s

Clients chat greedily with prompt ids, each turn on any live worker; a turn
that fails (its worker was killed) is sent again to another, as a client
would. Half the workers run with --audit-kv: a page written under a running
sequence fails that turn, naming the page, and the test with it; the other
half run decode passes ahead (which an audit turns off), judged by the replay. At the
end: nothing running, memd's invariants hold, no page is held but by a
sequence, and once every session is reset not one page or swap slot is
left. Then every chat is replayed, one turn at a time, on a fresh memd and
one worker with room to spare: each answer must be the same, but for a
near-tie (tests/answers.py), where a chat's comparison ends. A turn that
differs by more is listed with the reference's logit gap at the first
differing token.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from dataclasses import dataclass, field

import grpc
import pytest

from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc
from tests.answers import Reference

pytestmark = pytest.mark.timeout(900)      # --soak-seconds plus start-up and the replay; --timeout 0 for long runs

WORKERS = 4
CLIENTS = 8
# Every pass checks that the K/V it reads is what its sequence wrote: a page written under a running
# sequence fails that turn with the page named (INTERNAL), rather than showing up only at the replay.
# Half the workers run without it: an audited worker never runs a decode pass ahead (inferd's forward
# thread), so those two serve that path under the same chaos, and the replay judges their answers.
AUDITED = ("--audit-kv",)


def audited(i: int) -> tuple[str, ...]:
    return AUDITED if i % 2 == 0 else ()
RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


@dataclass
class Chat:
    session: str
    turns: list[tuple[list[int], int, list[int]]] = field(default_factory=list)   # (prompt ids, max_tokens, answer)


class Fleet:
    """The live workers; a killed one is replaced under a new name."""

    def __init__(self, workers: list) -> None:
        self.workers = list(workers)

    def pick(self, rng: random.Random):
        return rng.choice(self.workers)


async def generate(address: str, request: pb.GenerateRequest, *, cancel_after: int = 0) -> list[int]:
    """A whole answer; `cancel_after` > 0: walk away after that many replies."""
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.InferdStub(channel).Generate(request, timeout=120)
        replies = 0
        while (reply := await call.read()) is not grpc.aio.EOF:
            tokens += reply.token_ids
            replies += 1
            if cancel_after and replies >= cancel_after:
                call.cancel()
                return tokens
    return tokens


async def chat_turn(fleet: Fleet, rng: random.Random, request: pb.GenerateRequest, stats: Counter) -> list[int]:
    """One turn, sent again to another worker while it fails for a worker's death (or memd's reclaim lag)."""
    for attempt in range(40):
        worker = fleet.pick(rng)
        try:
            answer = await generate(worker.address, request)
        except grpc.aio.AioRpcError as err:
            if err.code() not in RETRIABLE:
                raise
            stats[f"retried: {err.code().name}"] += 1
            await asyncio.sleep(0.1 * min(attempt + 1, 10))     # backoff before the next worker
            continue
        stats["turns served"] += 1
        return answer
    raise AssertionError(f"turn of {request.session_id} failed 40 times")


async def client(n: int, fleet: Fleet, deadline: float, vocab: int, stats: Counter) -> list[Chat]:
    rng, loop, chats = random.Random(1000 + n), asyncio.get_running_loop(), []
    while loop.time() < deadline:
        chat = Chat(f"c{n}-{len(chats)}")
        for _ in range(rng.randint(1, 4)):
            if loop.time() >= deadline:
                break
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 60))]
            max_tokens = rng.randint(4, 40)
            answer = await chat_turn(fleet, rng, pb.GenerateRequest(      # its retries name the same turn
                prompt_ids=prompt, session_id=chat.session, max_tokens=max_tokens, ignore_eos=True,
                turn_id=str(len(chat.turns))), stats)
            assert len(answer) == max_tokens
            chat.turns.append((prompt, max_tokens, answer))
        chats.append(chat)
        if rng.random() < 0.25:                  # a user walks away mid-answer (no session: nothing to keep)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await generate(fleet.pick(rng).address, pb.GenerateRequest(
                    prompt_ids=[rng.randrange(3, vocab) for _ in range(30)], max_tokens=200, ignore_eos=True),
                    cancel_after=rng.randint(1, 5))
                stats["cancels"] += 1
        if rng.random() < 0.2 and chat.turns:    # a user clears the chat
            with contextlib.suppress(grpc.aio.AioRpcError):
                async with grpc.aio.insecure_channel(fleet.pick(rng).address) as channel:
                    await pb_grpc.InferdStub(channel).Reset(pb.ResetRequest(session_id=chat.session))
                    stats["resets"] += 1
                    chat.turns.append(([], 0, []))      # marks the reset: the replay resets too
    return chats


async def chaos(memd, fleet: Fleet, inferd_factory, model_dir, deadline: float, stats: Counter) -> None:
    """Forced evictions every second; one worker killed (kill -9) a third of the way in, a new one started."""
    loop, killed = asyncio.get_running_loop(), False
    start = loop.time()
    async with memd.admin() as admin:
        while loop.time() < deadline:
            await asyncio.sleep(1.0)            # the operator's pace, not a wait for an event
            with contextlib.suppress(Exception):
                if stats["evictions asked"] % 2:
                    reply = await admin.evict(idle_s=0.5, mode="drop")
                else:
                    reply = await admin.evict(blocks=24, mode="swap")
                stats["evictions asked"] += 1
                stats["sequences evicted"] += len(reply.swapped) + len(reply.dropped)
            if not killed and loop.time() - start > (deadline - start) / 3:
                killed = True
                victim = fleet.workers.pop(0)
                await victim.kill()
                stats["workers killed"] += 1
                fleet.workers.append(await inferd_factory(model_dir, memd.address, *AUDITED, name="replacement"))


async def replay(chats: list[Chat], worker, reference: Reference) -> tuple[Counter[str], list[str]]:
    """Every chat again, turn by turn, alone: the answers must match up to a near-tie.

    A chat is cut short at a near-tie: after it the two histories differ, and the chat's
    later turns ask other questions. Returns counts (turns compared, near-ties, turns not
    compared after one) and a line for each turn that differs by more than a tie.
    """
    counts: Counter[str] = Counter()
    wrong: list[str] = []
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = pb_grpc.InferdStub(channel)
        for chat in chats:
            history: list[int] = []
            for turn, (prompt, max_tokens, answer) in enumerate(chat.turns):
                if not prompt:
                    await stub.Reset(pb.ResetRequest(session_id=chat.session))
                    history = []
                    continue
                tokens = []
                async for reply in stub.Generate(pb.GenerateRequest(
                        prompt_ids=prompt, session_id=chat.session, max_tokens=max_tokens, ignore_eos=True)):
                    tokens += reply.token_ids
                counts["compared"] += 1
                history += prompt
                divergence = reference.divergence(history, answer, tokens)
                if divergence is not None:
                    if not divergence.near_tie:
                        wrong.append(f"{chat.session} turn {turn} (history {len(history)} tokens): {divergence}; "
                                     f"under load {answer}, alone {tokens}")
                    counts["near-ties" if divergence.near_tie else "wrong"] += 1
                    counts["skipped"] += sum(1 for later, _, _ in chat.turns[turn + 1:] if later)
                    break
                history += answer
    return counts, wrong


async def test_soak(memd_factory, inferd_factory, model_dir, model_judge, soak_seconds):
    memd = await memd_factory("--device", "cpu", "--pool-bytes", "640KiB", "--model", str(model_dir),
                              "--block-size", "16", "--swap-ratio", "0.25", "--lease-timeout", "30")
    fleet = Fleet([await inferd_factory(model_dir, memd.address, *audited(i), name=f"worker{i}")
                   for i in range(WORKERS)])
    async with memd.admin() as admin:
        vocab = 256                      # the tiny model's vocabulary is larger; these ids are all valid
        assert (await admin.stats()).total_blocks <= 80          # small: pressure, preemption, swapping
    stats: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + soak_seconds
    results = await asyncio.gather(chaos(memd, fleet, inferd_factory, model_dir, deadline, stats),
                                   *[client(n, fleet, deadline, vocab, stats) for n in range(CLIENTS)])
    chats = [chat for chats in results[1:] for chat in chats]

    async with memd.admin() as admin:
        async def idle() -> bool:
            return (await admin.stats()).sequences["running"] == 0
        while not await idle():
            await asyncio.sleep(0.1)     # the workers finish what the cancels left: another process, no event
        check = await admin.check()
        assert check.ok, check.violations
        snapshot = await admin.snapshot()
        held = {b for s in snapshot.sequences for b in s.block_ids}
        orphans = [row.block_id for row in snapshot.blocks if row.ref_count and row.block_id not in held]
        assert orphans == []
        counters = dict((await admin.stats()).counters)

        async with grpc.aio.insecure_channel(fleet.workers[0].address) as channel:
            stub = pb_grpc.InferdStub(channel)
            for chat in chats:
                with contextlib.suppress(grpc.aio.AioRpcError):       # NOT_FOUND: reset or never parked
                    await stub.Reset(pb.ResetRequest(session_id=chat.session))
        stats_end = await admin.stats()
        leaked = stats_end.used_blocks
        assert leaked == 0 and stats_end.swap_free_blocks == stats_end.swap_total_blocks
        assert sum(stats_end.sequences.values()) == 0 and (await admin.check()).ok

    reference_memd = await memd_factory("--device", "cpu", "--pool-bytes", "16MiB", "--model", str(model_dir),
                                        "--block-size", "16", "--disable-swap", name="reference")
    replayer = await inferd_factory(model_dir, reference_memd.address, name="replayer")
    replayed, wrong = await replay(chats, replayer, model_judge)
    print(f"\nsoak {soak_seconds:g} s: {stats['turns served']} turns served ({replayed['compared']} compared, "
          f"equal but for {replayed['near-ties']} near-ties and {replayed['wrong']} wrong; "
          f"{replayed['skipped']} later turns of those chats not compared), "
          f"{stats['cancels']} cancels, {stats['resets']} resets, {stats['workers killed']} worker killed, "
          f"{sum(v for k, v in stats.items() if k.startswith('retried'))} turns sent again "
          f"({', '.join(f'{k[9:]} {v}' for k, v in stats.items() if k.startswith('retried')) or 'none'}), "
          f"{stats['evictions asked']} forced evictions ({stats['sequences evicted']} sequences), memd: "
          f"{counters.get('preemptions', 0)} preemptions, {counters.get('swap_outs', 0)} swap-outs, "
          f"{counters.get('drops', 0)} drops, {counters.get('turns_retried', 0)} turns retried, "
          f"{counters.get('reclaims', 0)} reclaims; blocks leaked: {leaked}")
    assert wrong == [], "turns answered differently under load, not at a near-tie:\n" + "\n".join(wrong)
    assert stats["workers killed"] == 1 and replayed["compared"] + replayed["skipped"] == stats["turns served"]
