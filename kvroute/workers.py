"""The inferd workers behind kvroute: whether each is up and how loaded, from its own /health and /metrics.

Every worker is checked each interval (all at once). A worker is up while its
/health answers 200 (inferd answers 503 while it drains or has lost memd);
a connection error on a request takes it out at once, and the next check
that passes brings it back. Its load is what it runs and queues by its
/metrics, or what this kvroute has in flight there, whichever is more (the
scrape is up to an interval old; our own count is current but ours alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass

import httpx
import structlog
from prometheus_client.parser import text_string_to_metric_families

log = structlog.get_logger("kvroute.workers")

CHECK_TIMEOUT_S = 2.0
LOAD_METRICS = ("kvpool_inferd_running_requests", "kvpool_inferd_waiting_requests")


@dataclass(eq=False)
class Worker:
    url: str                                   # http://HOST:PORT, no trailing slash
    up: bool = False
    why_down: str = "not checked yet"
    queued: int = 0                            # running + waiting at the last scrape
    in_flight: int = 0                         # this kvroute's requests there now
    model: str | None = None                   # the model it serves (its API's name), by its /health
    namespace: str = ""                        # its K/V's namespace in memd (memd's KV events' topics name it)

    def serves(self, model: str) -> bool:
        """Whether a request for `model` is this worker's ("": any; a worker not yet heard from: maybe)."""
        return not model or self.model is None or self.model == model

    @property
    def load(self) -> int:
        return max(self.queued, self.in_flight)


class Workers:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, interval_s: float) -> None:
        self.all = [Worker(url.rstrip("/")) for url in urls]
        self.by_url = {w.url: w for w in self.all}
        self.client, self.interval_s = client, interval_s

    def up(self, model: str = "") -> list[Worker]:
        """The workers up; those serving `model`, if any does (else all of them: one says it has no such model)."""
        up = [w for w in self.all if w.up]
        serving = [w for w in up if w.serves(model)]
        return serving or up

    def failed(self, worker: Worker, why: str) -> None:
        """A request could not reach `worker`: out until a check passes."""
        if worker.up:
            log.warning("a worker failed; its requests go to the others", worker=worker.url, error=why)
        worker.up, worker.why_down = False, why

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.all))

    async def run(self) -> None:
        """Each worker on a loop of its own: a slow one does not delay the others' checks."""
        await asyncio.gather(*(self._keep_checking(w) for w in self.all))

    async def _keep_checking(self, worker: Worker) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._check(worker)

    async def _check(self, worker: Worker) -> None:
        try:
            health = await self.client.get(f"{worker.url}/health", timeout=CHECK_TIMEOUT_S)
            metrics = await self.client.get(f"{worker.url}/metrics", timeout=CHECK_TIMEOUT_S)
        except Exception as exc:                       # whatever it is, the worker is not answering as it should
            self._mark(worker, False, f"unreachable ({type(exc).__name__}: {exc})" if str(exc) else
                       f"unreachable ({type(exc).__name__})")
            return
        if health.status_code != 200:
            self._mark(worker, False, f"/health answered {health.status_code}")
            return
        if metrics.status_code == 200:
            worker.queued = _queued(metrics.text)
        with contextlib.suppress(ValueError, KeyError, TypeError):
            said = health.json()
            worker.model, worker.namespace = str(said["model"]), str(said.get("kv_namespace", ""))
        self._mark(worker, True, "")

    def _mark(self, worker: Worker, up: bool, why: str) -> None:
        if up and not worker.up:
            log.info("a worker is up", worker=worker.url)
        elif not up and worker.up:
            log.warning("a worker is down; its requests go to the others", worker=worker.url, error=why)
        worker.up, worker.why_down = up, why


def _queued(text: str) -> int:
    """Running + waiting requests by the worker's /metrics; what cannot be read counts as none."""
    total = 0.0
    with contextlib.suppress(ValueError):
        for family in text_string_to_metric_families(text):
            if family.name in LOAD_METRICS:
                total += sum(s.value for s in family.samples if math.isfinite(s.value) and s.value > 0)
    return int(total)
