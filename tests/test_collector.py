"""memd keeps long-lived objects out of full collections, and holds automatic collections back while an operator
call's copy of its state lives."""

from __future__ import annotations

import asyncio
import gc
import math
import weakref

import pytest
from local_memd import CallContext

from memd import collector
from memd.collector import collections_paused
from shared.full_collections import FULL_EVERY, FullCollections, freeze_long_lived
from shared.ops import Open, Park
from shared.rpc import memd_pb2 as pb


@pytest.fixture(autouse=True)
def collector_on():
    assert gc.isenabled()
    yield
    gc.enable()


class Session:
    """Stands for a parked session: something that lives on, then is dropped (weakly referenceable)."""


@pytest.fixture
def counted():
    """A FullCollections of this test's own in gc.callbacks; the process's collector as it was afterwards."""
    policy = FullCollections()
    thresholds, others = gc.get_threshold(), [c for c in gc.callbacks if isinstance(c, FullCollections)]
    for other in others:                             # the process's own, if something installed it here
        gc.callbacks.remove(other)
    gc.callbacks.append(policy)
    yield policy
    gc.callbacks.remove(policy)
    gc.callbacks.extend(others)
    gc.set_threshold(*thresholds)
    gc.unfreeze()


def test_a_long_full_collection_freezes_its_survivors_which_are_still_freed_once_dropped(counted):
    counted.freeze_after_s = 0.0                     # every full collection counts as long
    kept = [Session() for _ in range(1000)]
    dropped = weakref.ref(kept[0])
    frozen_before = gc.get_freeze_count()
    gc.collect()
    assert (counted.count, counted.freezes) == (1, 1)
    assert gc.get_freeze_count() >= frozen_before + 1000
    assert counted.longest_s > 0 and counted.seconds >= counted.longest_s
    del kept                                         # reference counts free frozen objects as any other
    assert dropped() is None


def test_cycles_made_after_a_freeze_are_still_collected(counted):
    counted.freeze_after_s = 0.0
    gc.collect()
    cycle = Session()
    cycle.itself = cycle
    gone = weakref.ref(cycle)
    del cycle
    assert gone() is not None                        # only a collection frees a cycle
    gc.collect()
    assert gone() is None and counted.count == 2 and counted.collected >= 1


def test_a_short_full_collection_freezes_nothing_and_young_ones_are_not_counted(counted):
    counted.freeze_after_s = math.inf
    frozen_before = gc.get_freeze_count()
    gc.collect(0)
    gc.collect(1)
    assert counted.count == 0
    gc.collect()
    assert (counted.count, counted.freezes) == (1, 0)
    assert gc.get_freeze_count() == frozen_before


def test_memd_installs_its_collection_policy_once(counted):
    installed = freeze_long_lived()
    try:
        assert freeze_long_lived() is installed
        assert gc.callbacks.count(installed) == 1
        assert gc.get_threshold()[2] == FULL_EVERY
    finally:
        gc.callbacks.remove(installed)


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
