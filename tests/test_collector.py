"""memd holds Python's automatic garbage collections back while an operator call's copy of its state lives."""

from __future__ import annotations

import asyncio
import gc

import pytest
from local_memd import CallContext

from memd import collector
from memd.collector import collections_paused
from shared.ops import Open, Park
from shared.rpc import memd_pb2 as pb


@pytest.fixture(autouse=True)
def collector_on():
    assert gc.isenabled()
    yield
    gc.enable()


def test_the_collector_waits_for_every_holder_and_an_error_still_lets_it_go():
    with collections_paused():
        assert not gc.isenabled()
        with pytest.raises(RuntimeError), collections_paused():
            raise RuntimeError("the second call failed")
        assert not gc.isenabled()                    # the first still holds it
    assert gc.isenabled()


def test_a_collector_someone_else_turned_off_stays_off():
    gc.disable()
    with collections_paused():
        pass
    assert not gc.isenabled()


async def test_a_holder_that_never_leaves_holds_it_no_longer_than_the_deadline(monkeypatch):
    monkeypatch.setattr(collector, "MAX_PAUSE_S", 0.01)
    resumed = asyncio.Event()
    original = collector._resume

    def resume() -> None:
        original()
        resumed.set()

    monkeypatch.setattr(collector, "_resume", resume)
    with collections_paused():
        await asyncio.wait_for(resumed.wait(), 10)
        assert gc.isenabled()                        # the stuck call no longer holds it
    assert gc.isenabled()


async def test_a_snapshot_holds_it_while_it_streams_and_a_cancelled_one_lets_it_go(local_memd_factory):
    memd = await local_memd_factory("--pool-bytes", str(64 * 4096), "--block-bytes", "4096")
    client = await memd.attach(model="m", block_size=16, bytes_per_token=256)
    opened = await client.step(*[Open(list(range(i, i + 40)), reserve=1, session_id=f"s{i}") for i in range(8)])
    await client.step(*[Park(o.seq_id, commit_to=40) for o in opened])
    stream = memd.parts.service.Snapshot(pb.SnapshotRequest(), CallContext())
    first = await anext(stream)
    assert first.data and not gc.isenabled()
    await stream.aclose()                            # as gRPC ends a call its client cancelled
    assert gc.isenabled()
    async with memd.admin() as admin:
        assert len((await admin.snapshot()).sequences) == 8 and gc.isenabled()
        assert (await admin.check()).ok and gc.isenabled()
    await client.close()
