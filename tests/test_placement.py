"""kvroute's placement: prefix keys, rendezvous hashing and the load bound (no processes)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from kvroute.placement import PREFIX_CHARS, place, prefix_key


@dataclass(eq=False)
class FakeLoad:
    """A worker as placement sees it: a URL and a load (placement reads nothing else)."""

    url: str
    load: int = 0


def test_turns_of_one_conversation_and_sessions_sharing_a_system_prompt_share_a_key():
    system = {"role": "system", "content": "You are terse. " * 20}
    turn1 = {"messages": [system, {"role": "user", "content": "hi"}]}
    turn2 = {"messages": [system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                          {"role": "user", "content": "more"}]}
    other = {"messages": [system, {"role": "user", "content": "something else"}]}
    assert prefix_key(turn1) == prefix_key(turn2) == prefix_key(other)
    assert len(prefix_key(turn1)) == PREFIX_CHARS
    short = {"messages": [{"role": "user", "content": "hi"}]}
    assert prefix_key(short) != prefix_key({"messages": [{"role": "user", "content": "ho"}]})
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prefix_key(parts) == prefix_key(short)
    assert prefix_key({"prompt": "Once upon a time"}) == prefix_key({"prompt": ["Once upon a time"]})
    assert prefix_key({"prompt": [1, 2, 3]}) is not None
    for nothing in (None, [], {"model": "m"}, {"prompt": ""}, {"messages": []}):
        assert prefix_key(nothing) is None


@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=60, unique=True),
       st.integers(min_value=2, max_value=6), st.data())
def test_a_worker_leaving_moves_only_its_own_keys(keys, count, data):
    workers = [FakeLoad(f"http://10.0.0.{i}:8000") for i in range(count)]
    gone = data.draw(st.sampled_from(workers))
    before = {key: place(key, workers, slack=0).worker for key in keys}
    after = {key: place(key, [w for w in workers if w is not gone], slack=0).worker for key in keys}
    for key in keys:
        assert after[key] is before[key] or before[key] is gone
    assert all(place(key, workers, slack=0).reason == "prefix" for key in keys)


def test_the_prefix_worker_takes_a_request_within_the_load_bound_and_the_least_loaded_beyond_it():
    a, b = FakeLoad("http://a:1"), FakeLoad("http://b:1")
    key = next(k for k in (bytes([i]) for i in range(256)) if place(k, [a, b], 0).worker is a)
    a.load, b.load = 5, 1
    assert place(key, [a, b], slack=4) == place(key, [b, a], slack=4)
    assert place(key, [a, b], slack=4).worker is a and place(key, [a, b], slack=4).reason == "prefix"
    chosen = place(key, [a, b], slack=3)
    assert chosen.worker is b and chosen.reason == "load"
    assert place(None, [a, b], slack=100).worker is b                 # no key: the least loaded
