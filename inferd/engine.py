"""The worker engine, and its tie to memd that survives memd going away.

`WorkerEngine` attaches to memd, maps the pool, builds the decoder over it and
runs the scheduler. When memd fails (the lease stream ends, a Step cannot
reach it) the requests that reached memd fail with UNAVAILABLE and a clear
message; queued ones that had not started wait. The engine stops using the old
pool (the forward pass in flight finishes first), then attaches again with
backoff and maps the new pool afresh: the worker serves again as soon as
memd is back, without a restart, and never touches an older pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import structlog
import torch
from grpc import StatusCode

from inferd import paged_kernel
from inferd.checkpoint import load_tokenizer, load_weights, read_config
from inferd.decoder_weights import DecoderWeights
from inferd.fingerprint import model_fingerprint
from inferd.forward_thread import PassObserver
from inferd.model import PagedDecoder
from inferd.scheduler import GenerationError, Request, Scheduler
from shared.client import MemdClient, MemdError
from shared.full_collections import freeze_long_lived

log = structlog.get_logger("inferd")

CARRY_S = 30.0      # how long requests that had not started wait for memd to come back


class AttachRefused(RuntimeError):
    """memd refused this worker in a way no retry changes (its block size does not fit memd's pages)."""


# memd's answers to Attach that say the request itself is wrong: retrying it every 5 s forever would hide the
# mistake from systemd. Anything else (memd down, restarting, its token being rewritten) passes.
PERMANENT_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT}


class WorkerEngine:
    """The worker: its attachment to memd, the model over memd's pool, the tokenizer, the scheduler, and
    whether it can serve (health); gRPC (`inferd.service`) and HTTP (`inferd.openai_api`) are its doors."""

    def __init__(self, model_dir: Path, memd_address: str | None, *, block_size: int = 16, max_num_seqs: int = 16,
                 max_batch_tokens: int = 2048, prefill_beside_decode: int = 512, dtype: str | None = None,
                 audit_kv: bool = False,
                 verify_reuse: float = 0.0, attention: str = "auto", quota_wait_s: float = 30.0) -> None:
        self.config = read_config(model_dir, dtype)
        self.attention = attention
        try:                                        # built now, before the first attachment waits on it
            paged_kernel.available(required=attention == "paged")
        except paged_kernel.KernelUnavailable as exc:
            raise paged_kernel.KernelUnavailable(f"--attention paged: {exc}") from None
        self.model_dir = model_dir
        # The checkpoint's tensors until the first attachment prepares them on memd's device; then only those.
        self._checkpoint: dict[str, torch.Tensor] | None = load_weights(model_dir, self.config.dtype)
        self._weights: DecoderWeights | None = None
        self.tokenizer = load_tokenizer(model_dir)
        self.namespace = model_fingerprint(model_dir, self.config, block_size)
        self.memd_address = memd_address
        self.block_size, self.max_num_seqs, self.max_batch_tokens = block_size, max_num_seqs, max_batch_tokens
        self.prefill_beside_decode = prefill_beside_decode
        self.audit_kv, self.verify_reuse, self.quota_wait_s = audit_kv, verify_reuse, quota_wait_s
        self.scheduler: Scheduler | None = None
        self.attached = asyncio.Event()
        self.preemptions = 0                      # of schedulers gone with an earlier attachment
        self.reuse_checks = self.reuse_mismatches = 0     # likewise (--verify-reuse)
        self.ahead_taken = self.ahead_dropped = 0         # likewise: passes the forward thread ran ahead
        self.on_pass: PassObserver | None = None          # each forward pass's kind and time (the metrics)
        # Health follows whether requests can be served: attached to memd and not draining.
        self.on_serving: Callable[[bool], Awaitable[None]] | None = None
        self._health: asyncio.Future[None] | None = None      # the health update a drain started
        # Requests that had not started when memd went away: they wait for the next attachment.
        self._carried: list[Request] = []
        self._carried_at = 0.0

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                client = await MemdClient.attach(self.memd_address, model=self.namespace, block_size=self.block_size,
                                                 bytes_per_token=self.config.bytes_per_token,
                                                 name=f"inferd:{os.getpid()}")
            except (MemdError, OSError, RuntimeError) as err:
                if isinstance(err, MemdError) and err.code in PERMANENT_REFUSALS:
                    raise AttachRefused(f"memd refused this worker: {err.message}") from None
                log.warning("memd unavailable; retrying", error=str(err), retry_in_s=backoff)
                if self._carried and asyncio.get_running_loop().time() - self._carried_at > CARRY_S:
                    self._fail_carried()
                await asyncio.sleep(backoff)      # backoff between attempts, not a wait for an event
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.2
            try:
                await self._serve(client)
            except Exception:          # a bug in serving must not leave the worker dead but attached
                log.exception("serving failed; reattaching")

    def _weights_on(self, device: torch.device) -> DecoderWeights:
        """The decoder's weights on `device`, prepared once; read again only if memd's pool moved device."""
        if self._weights is None or self._weights.device != device:
            checkpoint = self._checkpoint if self._checkpoint is not None \
                else load_weights(self.model_dir, self.config.dtype)
            self._weights = None                                  # the old ones go before the new ones come
            self._weights = DecoderWeights.prepare(self.config, checkpoint, device)
            self._checkpoint = None
        return self._weights

    async def _serve(self, client: MemdClient) -> None:
        assert client.pool is not None
        kv = client.pool.view(self.config.dtype, self.config.page_shape(self.block_size))
        try:
            model = PagedDecoder(self.config, self._weights_on(client.pool.pages.device), kv,
                                 device=client.pool.pages.device, attention=self.attention)
        except paged_kernel.KernelUnavailable as exc:      # --attention paged or flex, on a pool it cannot read
            raise AttachRefused(f"--attention {self.attention}: {exc}") from None
        scheduler = Scheduler(client, model, self.tokenizer, max_num_seqs=self.max_num_seqs,
                              max_batch_tokens=self.max_batch_tokens,
                              prefill_beside_decode=self.prefill_beside_decode, audit_kv=self.audit_kv,
                              verify_reuse=self.verify_reuse, quota_wait_s=self.quota_wait_s)
        scheduler.forward_thread.on_pass = self.on_pass
        if model.attention == "flex":                # on the thread that runs the passes, the loop free meanwhile
            started = time.perf_counter()
            try:
                sizes = await scheduler.forward_thread.run(model.compile_ahead, self.max_num_seqs, tokens=0)
            except Exception as exc:                  # would fail again at every attachment: inferd says why, ends
                await scheduler.close()
                with contextlib.suppress(Exception):
                    await client.close()
                raise AttachRefused(f"--attention flex: flex attention could not be compiled for this model and "
                                    f"pool ({type(exc).__name__}: {exc})") from None
            log.info("flex decode compiled", batch_sizes=sizes, seconds=round(time.perf_counter() - started, 1))
        started = time.perf_counter()
        try:                                          # before requests are taken: none waits for a trace
            traced = await scheduler.forward_thread.run(model.warm_up, tokens=0)
            log.info("passes traced", kinds=traced, seconds=round(time.perf_counter() - started, 2))
        except Exception as exc:                      # a pass that fails here fails its first request too
            log.warning("passes could not be traced ahead", error=str(exc))
        scheduler.adopt(self._carried)
        self._carried = []
        self.scheduler = scheduler
        # The model, its weights and torch live as long as this attachment: frozen out of full collections,
        # which would walk them all, decode stopped for the whole walk each time.
        freeze_long_lived()
        self.attached.set()
        client.on_drain = self._drained
        scheduler.drain(client.draining)            # a drain memd announced while the pool was being mapped
        if self.on_serving is not None:
            await self.on_serving(not client.draining)
        log.info("attached to memd", worker=client.worker_id, blocks=client.geometry.num_blocks,
                 block_size=self.block_size, model=self.namespace, attention=model.attention,
                 weight_layout=model.weight_layout, layer_ops="inferd" if model.fused else "torch")
        running = asyncio.create_task(scheduler.run())
        lost = asyncio.create_task(client.lease_lost.wait())
        try:
            await asyncio.wait({running, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.attached.clear()
            self.scheduler = None
            self.preemptions += scheduler.preemptions
            self.ahead_taken += scheduler.forward_thread.ahead_taken
            self.ahead_dropped += scheduler.forward_thread.ahead_dropped
            if scheduler.reuse_check is not None:
                self.reuse_checks += scheduler.reuse_check.checks
                self.reuse_mismatches += scheduler.reuse_check.mismatches
            if self.on_serving is not None:
                await self.on_serving(False)
            running.cancel()
            lost.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await running
            # The pass in flight still writes pages: finish it before memd can hand them out.
            await scheduler.close()
            gone = GenerationError(StatusCode.UNAVAILABLE, "memd went away; the worker is reconnecting")
            self._carried = scheduler.carried + scheduler.fail_all(gone, keep_unstarted=True)
            self._carried_at = asyncio.get_running_loop().time()
            with contextlib.suppress(Exception):
                await client.close()
            # What this attachment built (scheduler, threads, the pool's mapping) may sit in reference cycles,
            # which a frozen object never leaves: unfrozen, the next attachment's collection frees them.
            gc.unfreeze()
        log.warning("lost memd; reconnecting")


    def _fail_carried(self) -> None:
        """memd stayed away too long: the queued requests kept for it fail after all."""
        error = GenerationError(StatusCode.UNAVAILABLE,
                                f"memd has been unreachable for over {CARRY_S:g} s; retry later")
        for request in self._carried:
            request.fail(error)
        log.warning("gave up queued requests: memd is still away", requests=len(self._carried))
        self._carried = []

    def _drained(self, on: bool) -> None:
        scheduler = self.scheduler
        if scheduler is None:
            return
        scheduler.drain(on)
        log.info("draining" if on else "drain ended: admitting requests again")
        if self.on_serving is not None:
            self._health = asyncio.ensure_future(self.on_serving(not on))
