"""memd's parts, assembled: the same assembly for the daemon and for an in-process memd.

The manager owns the bookkeeping; the step runner runs Steps and evictions
on the pages; fences and leases follow the workers; the servicer translates
gRPC. `assemble` builds them over memory that is already allocated.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from memd.fdpass import FdServer
from memd.fences import FenceWatch
from memd.journal import WriteAheadLog
from memd.leases import Leases
from memd.manager import KvManager
from memd.memory import PoolMemory
from memd.page_copier import PageCopier
from memd.scrub import Scrubber
from memd.service import MemdService
from memd.settings import Settings
from memd.step_runner import StepRunner
from memd.swap import SwapMemory
from shared.geometry import PoolGeometry


@dataclass(slots=True)
class Parts:
    manager: KvManager
    runner: StepRunner
    fences: FenceWatch
    leases: Leases
    service: MemdService
    scrubber: Scrubber


def new_manager(geometry: PoolGeometry, settings: Settings) -> KvManager:
    return KvManager(geometry, heat_decay=settings.heat_decay, heat_interval_s=settings.heat_interval_s,
                     swap_slots=settings.swap_slots(geometry), idle_ttl_s=settings.idle_ttl_s,
                     watermark_blocks=math.ceil(geometry.num_blocks * settings.free_watermark),
                     prefix_cache=settings.prefix_cache)


def assemble(manager: KvManager, settings: Settings, memory: PoolMemory, swap: SwapMemory | None,
         wal: WriteAheadLog | None = None, fd_server: FdServer | None = None) -> Parts:
    runner = StepRunner(manager, PageCopier(memory, swap, manager.geometry.block_bytes), wal)
    fences = FenceWatch(manager, runner.persist)
    leases = Leases(manager, runner, fences, settings.lease_timeout_s)
    scrubber = Scrubber(manager, memory, swap, runner.persist)
    service = MemdService(manager, runner, leases, fences, memory, fd_server, scrubber, generation=time.time_ns())
    return Parts(manager, runner, fences, leases, service, scrubber)
