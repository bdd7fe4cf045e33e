"""Python's full garbage collections kept short in kvpool's daemons: what a long one leaves alive is frozen.

A full (oldest generation) collection walks every object the collector
tracks, holding the GIL: in memd its event loop stops while workers' Steps
wait, in inferd decode stops. What a daemon imports and builds at start-up
lives as long as it does (every module, torch's in inferd), and so do
parked sessions in memd (a sequence and its lists): with Python's defaults
a full collection walks every one of them, longer the more sessions are
held, and one comes every time a quarter more long-lived objects appear.

So a daemon freezes (`gc.freeze`) what start-up made, and from then on what
a long full collection leaves alive: what survived one is what lives on.
Frozen objects are not walked again, yet are still freed by their reference
counts as soon as nothing holds them (a freed session goes as before). Only
a frozen object that later becomes part of an unreachable cycle is never
freed. memd's state holds no cycles; the cycles a serving memd makes are
gRPC's lookup of each new call's handler, three small objects per call (a
worker's Steps ride one call, its stream; a memctl command is one), so a
freeze leaks those of the calls starting at that instant at most. And a
short full collection, one that found little alive, freezes nothing: long
ones come once per thousands of new sessions. Full collections also come
after 3 of the middle generation's, not 10, so each walks less (bench_memd
measures both: docs/benchmarks.md). `FullCollections` counts and times them
for the daemons' metrics.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["FREEZE_AFTER_S", "FULL_EVERY", "FullCollections", "freeze_long_lived", "full_collections",
           "metric_families"]

FREEZE_AFTER_S = 0.002      # a full collection at least this long freezes what it left alive
FULL_EVERY = 3              # the oldest generation's threshold: middle-generation collections per full one


@dataclass(slots=True, eq=False)
class FullCollections:
    """Python's full collections in this process: counted, timed, and what a long one left alive frozen.

    A `gc.callbacks` entry. It runs inside the collector, on whichever thread
    triggered it, so it only sets plain numbers (no lock: a lock the
    interrupted code holds would deadlock it); the daemons' metrics read them."""

    count: int = 0
    seconds: float = 0.0
    longest_s: float = 0.0
    freezes: int = 0
    collected: int = 0          # unreachable objects they found: cycles, which a frozen object in one would leak
    freeze_after_s: float = FREEZE_AFTER_S
    _started: float = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        took = now - self._started
        self.count += 1
        self.seconds += took
        self.longest_s = max(self.longest_s, took)
        self.collected += info["collected"]
        if took >= self.freeze_after_s:
            gc.freeze()
            self.freezes += 1


full_collections = FullCollections()


def freeze_long_lived() -> FullCollections:
    """What start-up made frozen now; from now on in this process a long full collection freezes its
    survivors, and full collections come every `FULL_EVERY` middle-generation ones. Only those are counted:
    the collection before this freeze (start-up's, tens of ms) pauses nothing that serves."""
    gc.collect()
    gc.freeze()
    gc.enable()                         # (a daemon may hold them back while it starts: memd does)
    if full_collections not in gc.callbacks:
        gc.callbacks.append(full_collections)
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_EVERY)
    return full_collections


def metric_families(prefix: str, where: str) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """This process's full collections as Prometheus metrics, named `{prefix}_gc_*`."""
    c = full_collections          # plain numbers the callback sets: read as they are, no lock to take
    yield CounterMetricFamily(f"{prefix}_gc_full_collections", f"Python's full garbage collections in {where} (each "
                              "pauses every thread of it)", value=c.count)
    yield CounterMetricFamily(f"{prefix}_gc_full_collection_seconds", "time spent in those collections",
                              value=c.seconds)
    yield GaugeMetricFamily(f"{prefix}_gc_longest_full_collection_seconds",
                            f"the longest of those collections since {where} started", value=c.longest_s)
    yield CounterMetricFamily(f"{prefix}_gc_freezes", "long full collections whose survivors were frozen "
                              "(out of later collections' walk)", value=c.freezes)
    yield CounterMetricFamily(f"{prefix}_gc_full_collected_objects", "unreachable objects (cycles) those "
                              "collections found", value=c.collected)
