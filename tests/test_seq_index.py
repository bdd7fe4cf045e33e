"""memd's index of its sequences: the eviction order it keeps is the order heat gives, whatever memd holds."""

from __future__ import annotations

import math
import os
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from memd.manager import KvManager
from memd.quotas import Quota, Quotas
from memd.sequences import EvictionReason, SeqState
from shared.geometry import PoolGeometry
from shared.ops import Free, Open, Park, Resume

BLOCK_SIZE = 4
GEOMETRY = PoolGeometry(num_blocks=256, block_bytes=4096, block_size=BLOCK_SIZE)


def parked_sessions(manager: KvManager, count: int, tenants: tuple[str, ...] = ("",)) -> tuple[int, list[int]]:
    worker = manager.attach("w", os.getpid(), "m", BLOCK_SIZE, 0).worker_id
    seq_ids = []
    for i in range(count):
        tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + 2 * BLOCK_SIZE))
        opened = manager.step(worker, [Open(tokens, session_id=f"s{i}", tenant=tenants[i % len(tenants)])])
        seq_id = opened.results[0].seq_id
        manager.step(worker, [Park(seq_id, commit_to=len(tokens))])
        seq_ids.append(seq_id)
    return worker, seq_ids


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 11), max_size=40), st.integers(1, 12))
def test_eviction_takes_the_coldest_parked_sequences_across_tenants_as_heat_orders_them(touches, wanted):
    manager = KvManager(GEOMETRY, hash_key=b"k" * 32)
    worker, seq_ids = parked_sessions(manager, 12, tenants=("a", "b", "c"))
    for i in touches:                                  # a session's next turn: resumed and parked again
        manager.step(worker, [Resume(session_id=f"s{i}")])
        manager.step(worker, [Park(seq_ids[i])])
    now = time.monotonic()
    done = manager.evictions.make_room(2 * wanted, reason=EvictionReason.PRESSURE, mode="drop")
    dropped = [manager.seqs[s] for s in done.dropped]
    kept = [manager.seqs[s] for s in seq_ids if s not in done.dropped]
    assert len(dropped) == wanted                  # two pages each: no more sessions than the pages asked for
    assert max(manager.heat(s, now) for s in dropped) <= min((manager.heat(s, now) for s in kept), default=math.inf)
    assert all(s.state is SeqState.DROPPED for s in dropped) and manager.violations() == []


def test_counts_and_pages_follow_every_change_without_walking_the_sequences():
    quotas = Quotas({("tenant", "a"): Quota(guaranteed=2, max=100)})
    manager = KvManager(GEOMETRY, hash_key=b"k" * 32, quotas=quotas)
    worker, seq_ids = parked_sessions(manager, 6, tenants=("a", "b"))
    assert manager.state_counts()["parked"] == 6
    holdings = {h.key: h for h in manager.holdings()}
    assert holdings[("tenant", "a")].pages == 6 and holdings[("tenant", "b")].pages == 6
    assert holdings[("model", "m")].pages == 12 and holdings[("tenant", "a")].sequences == {"parked": 3}
    manager.step(worker, [Free(seq_ids[0])])
    manager.evictions.force(seq_id=seq_ids[1], mode="drop")
    assert manager.state_counts() == {"running": 0, "parked": 4, "swapped": 0, "dropped": 1}
    holdings = {h.key: h for h in manager.holdings()}
    assert holdings[("tenant", "a")].pages == 4 and holdings[("tenant", "b")].pages == 4
    assert manager.violations() == []


def test_a_shared_prompt_counts_once_per_tenant_and_for_each_tenant_sharing_it():
    manager = KvManager(GEOMETRY, hash_key=b"k" * 32)
    worker = manager.attach("w", os.getpid(), "m", BLOCK_SIZE, 0).worker_id
    prompt = list(range(2 * BLOCK_SIZE))
    for i, tenant in enumerate(("a", "a", "b")):
        opened = manager.step(worker, [Open([*prompt, 90 + i], tenant=tenant, session_id=f"s{i}")]).results[0]
        manager.step(worker, [Park(opened.seq_id, commit_to=len(prompt) + 1)])
    holdings = {h.key: h.pages for h in manager.holdings()}
    # 2 shared prompt pages + 1 own page each: "a" holds 2 + 2, "b" 2 + 1, the model 2 + 3
    assert holdings == {("tenant", "a"): 4, ("tenant", "b"): 3, ("model", "m"): 5}
    assert manager.violations() == []


def test_memctl_check_names_a_holder_whose_counted_pages_are_not_what_its_sequences_hold():
    manager = KvManager(GEOMETRY, hash_key=b"k" * 32)
    parked_sessions(manager, 2, tenants=("a",))
    manager.index.refresh()
    manager.index.ledger.usage[("tenant", "a")] += 1              # as a bug in the bookkeeping would
    assert manager.violations() == ["tenant 'a' is counted at 5 pages, but its sequences hold 4"]


def test_a_restarts_worth_of_cached_blocks_is_announced_over_several_batches_each_parent_first(monkeypatch):
    """KV events after a restart that recovered many sessions: no one flush announces them all (it would hold
    memd's loop for seconds), and a subscriber still meets every parent before its children."""
    from memd import kv_events
    monkeypatch.setattr(kv_events, "FLUSH_BLOCKS", 5)
    manager = KvManager(GEOMETRY, hash_key=b"k" * 32)
    worker = manager.attach("w", os.getpid(), "m", BLOCK_SIZE, 0).worker_id
    shared = list(range(2 * BLOCK_SIZE))                         # a system prompt of two blocks, then each its own
    for i in range(6):
        tokens = [*shared, *range(100 * (i + 1), 100 * (i + 1) + 2 * BLOCK_SIZE)]
        opened = manager.step(worker, [Open(tokens, session_id=f"s{i}")]).results[0]
        manager.step(worker, [Park(opened.seq_id, commit_to=len(tokens))])
    events = kv_events.KvEvents(manager, "tcp://127.0.0.1:0")
    batches: list[list[dict]] = []
    monkeypatch.setattr(events, "_send", lambda _model, batch: batches.append(batch))
    try:
        while events.blocks or not events.cleared:
            events.flush()
    finally:
        events.context.destroy(linger=0)
    assert len(batches) > 2
    announced: set[int] = set()
    for batch in batches:
        for event in batch:
            if event["type"] == "BlockStored":
                assert event["parent_block_hash"] is None or event["parent_block_hash"] in announced
                announced.update(event["block_hashes"])
    assert announced == {kv_events.event_hash(digest) for digest in manager.pool.by_hash}
    assert len(announced) == 2 + 6 * 2


def test_a_holder_reaching_its_guarantee_mid_walk_leaves_the_others_counted_once():
    """Eviction passes a tenant's sequences over once it is at its guarantee, and goes on with the others:
    each of those counted once, however the walk went on."""
    quotas = Quotas({("tenant", "a"): Quota(guaranteed=4)})
    manager = KvManager(GEOMETRY, hash_key=b"k" * 32, quotas=quotas)
    worker, seq_ids = parked_sessions(manager, 5, tenants=("a", "b", "b", "a", "a"))   # 2 pages each
    for hotter, turns in ((1, 1), (2, 1), (3, 2), (4, 2)):      # a's first session the coldest, b's next
        for _ in range(turns):
            manager.step(worker, [Resume(session_id=f"s{hotter}")])
            manager.step(worker, [Park(seq_ids[hotter])])
    # a's first session (its 6 pages down to 4: its guarantee), then b's two; a's others stay
    assert manager.evictions.reclaimable() == 6
    done = manager.evictions.make_room(256, reason=EvictionReason.PRESSURE, mode="drop")
    assert sorted(done.dropped) == sorted([seq_ids[0], seq_ids[1], seq_ids[2]])
    assert manager.violations() == []
