"""What the scheduler owes memd besides its running and waiting requests, in one place.

Ended requests' releases, session resets, preemptions, forks of n > 1
requests, children still to fork, distrusted prefixes and revocations each
wait for the next Step in a list of their own (each goes into the Step at its
own place: `inferd.memd_ops`). Whether any work is pending, which requests it
holds (to fail them all when memd goes) and emptying it are written once,
here, not by hand wherever the scheduler asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.memd_ops import Distrust, End, Preempt, ResetSession
from inferd.requests import Request
from shared.ops import Extend


@dataclass(eq=False)
class Backlog:
    ending: list[End] = field(default_factory=list)            # Park/Free of ended requests, each with its final event
    resets: list[ResetSession] = field(default_factory=list)
    preempting: list[Preempt] = field(default_factory=list)
    forks: list[tuple[Request, Extend, list[Request]]] = field(default_factory=list)  # parent, its commit, children
    unforked: list[Request] = field(default_factory=list)      # children whose Fork found no page: forked next step
    distrusts: list[Distrust] = field(default_factory=list)
    revoked: set[int] = field(default_factory=set)             # seq ids memd revoked, not yet preempted

    def __bool__(self) -> bool:
        return bool(self.ending or self.resets or self.preempting or self.forks or self.unforked or self.distrusts
                    or self.revoked)

    def requests(self) -> list[Request]:
        """Every request the backlog holds (a request may be in more than one list)."""
        held = [end.request for end in self.ending] + [p.request for p in self.preempting]
        held += [child for _, _, group in self.forks for child in group] + self.unforked
        return held + [d.request for d in self.distrusts]

    def clear(self) -> None:
        for pending in (self.ending, self.resets, self.preempting, self.forks, self.unforked, self.distrusts):
            pending.clear()
        self.revoked.clear()
