"""What a committed Step leaves to do, and the order in which memd does it.

`KvManager.step` changes only bookkeeping and returns a `StepOutcome`;
`memd.step_runner` consumes it before the worker hears back, in this order:

1. the page `effects` (memd.page_copier), so no page is read before it is zeroed or filled;
2. `KvManager.effects_landed`: swapped-in full blocks join the prefix cache,
   sequences `filling` are whole again;
3. `KvManager.release_slots(read_slots)`: the swap slots the effects read go free;
4. the journal records all of it (memd.journal);
5. the `evictions` the Step asked for (a preempting Park, a revoked sequence
   parked): swapped out or dropped, and the results say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memd.page_effects import PageEffect
from memd.sequences import EvictionReason, Sequence, SwapOut
from shared.ops import OpResult


@dataclass(slots=True)
class SwappedIn:
    """Pages of `seq` copied back from swap or fetched, entry `indices[i]` of its table into `blocks[i]`:
    checked once the copies have landed; full blocks then serve prefix hits."""

    seq: Sequence
    indices: list[int]
    blocks: list[int]


@dataclass(slots=True)
class StepOutcome:
    """A committed Step's results and what they leave to do (the module says in which order)."""

    results: list[OpResult] = field(default_factory=list)
    effects: list[PageEffect] = field(default_factory=list)
    # Swap slots the effects read (swap-ins) or that a freed sequence held: free once the effects are done.
    read_slots: list[int] = field(default_factory=list)
    # Parked by this Step and to be evicted before the reply (a preemption, an operator's revocation).
    evictions: list[Eviction] = field(default_factory=list)
    swapped_in: list[SwappedIn] = field(default_factory=list)
    # Sequences whose pages the effects fill (swap-ins, a page's copy).
    filling: set[int] = field(default_factory=set)
    # Sessions this Step freed (a reset, an error): the cluster tier takes their records back.
    freed_sessions: list[str] = field(default_factory=list)
    # Swap-outs in flight of sequences this Step resumed or freed: called off once the Step stands.
    called_off: list[SwapOut] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Eviction:
    """A sequence a Step parked to be evicted before the worker hears back (a preemption, a revocation)."""

    seq: Sequence
    mode: str                   # "swap" or "drop"
    reason: EvictionReason | None     # FORCED for an operator's, None for a worker's own preemption
