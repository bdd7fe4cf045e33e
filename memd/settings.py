"""memd's settings: the numbers its policies run by (lease timeout, heat decay,
swap ratio, idle TTL, free watermark, prefix cache on or off), read from its
flags apart from its wiring, so that start-up can size the swap tier from them
before the modules memd serves with are imported (memd.startup)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.geometry import PoolGeometry


@dataclass(frozen=True, slots=True)
class Settings:
    """What shapes memd's behaviour once its memory is allocated."""

    lease_timeout_s: float = 10.0
    heat_decay: float = 0.9
    heat_interval_s: float = 10.0
    swap_ratio: float = 0.3              # 0: no swap tier
    idle_ttl_s: float = 300.0            # 0: never
    free_watermark: float = 0.02
    prefix_cache: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        return cls(args.lease_timeout, args.heat_decay, args.heat_interval,
                   0.0 if args.disable_swap else args.swap_ratio, args.idle_ttl, args.free_watermark,
                   not args.no_prefix_cache)

    def swap_slots(self, geometry: PoolGeometry) -> int:
        return int(geometry.num_blocks * self.swap_ratio)
