"""inferd's gRPC service, and its tie to memd that survives memd going away.

`MemdLink` attaches to memd, maps the pool, builds the decoder over it and
runs the scheduler. When memd fails (the lease stream ends, a Step cannot
reach it) the requests that reached memd fail with UNAVAILABLE and a clear
message; queued ones that had not started wait. The link stops using the old
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
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import structlog
import torch

from inferd import paged_kernel
from inferd.checkpoint import load_tokenizer, load_weights, read_config
from inferd.decoder_weights import DecoderWeights
from inferd.fingerprint import model_fingerprint
from inferd.forward_thread import PassObserver
from inferd.metrics import InferdMetrics
from inferd.model import PagedDecoder
from inferd.sampling import BadParams, SamplingParams
from inferd.scheduler import GenerationError, Request, Scheduler
from shared import address as addr
from shared.client import MemdClient, MemdError
from shared.full_collections import freeze_long_lived
from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc

log = structlog.get_logger("inferd")

DEFAULT_MAX_TOKENS = 64
CARRY_S = 30.0      # how long requests that had not started wait for memd to come back
REQUEST_ID_KEY = "x-request-id"


async def _refuse(context: grpc.aio.ServicerContext, err: GenerationError) -> None:
    """Fail the call with the error's status, marked as inferd's own: a draining or detached worker answers
    UNAVAILABLE, and its client must not report it as one nobody could reach."""
    await context.abort(getattr(grpc.StatusCode, err.code), err.message, trailing_metadata=addr.ANSWERED)


def checked_request_id(given: str | None) -> str:
    """The client's x-request-id (to find its request in our logs), else a new one; sent back either way."""
    if given is None:
        return uuid.uuid4().hex[:16]
    if not (0 < len(given) <= 128 and given.isascii() and given.isprintable() and " " not in given):
        raise GenerationError("INVALID_ARGUMENT", "x-request-id must be 1 to 128 visible ASCII characters")
    return given


class AttachRefused(RuntimeError):
    """memd refused this worker in a way no retry changes (its block size does not fit memd's pages)."""


# memd's answers to Attach that say the request itself is wrong: retrying it every 5 s forever would hide the
# mistake from systemd. Anything else (memd down, restarting, its token being rewritten) passes.
PERMANENT_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT}


class MemdLink:
    def __init__(self, model_dir: Path, memd_address: str | None, *, block_size: int = 16, max_num_seqs: int = 16,
                 max_batch_tokens: int = 2048, prefill_beside_decode: int = 512, dtype: str | None = None,
                 audit_kv: bool = False,
                 verify_reuse: float = 0.0, attention: str = "auto") -> None:
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
        self.audit_kv, self.verify_reuse = audit_kv, verify_reuse
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
                              verify_reuse=self.verify_reuse)
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
        # which would walk them (~115 ms of decode stopped each time).
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
            self._carried = scheduler.carried + scheduler.fail_all(
                GenerationError("UNAVAILABLE", "memd went away; the worker is reconnecting"), keep_unstarted=True)
            self._carried_at = asyncio.get_running_loop().time()
            with contextlib.suppress(Exception):
                await client.close()
            # What this attachment built (scheduler, threads, the pool's mapping) may sit in reference cycles,
            # which a frozen object never leaves: unfrozen, the next attachment's collection frees them.
            gc.unfreeze()
        log.warning("lost memd; reconnecting")


    def _fail_carried(self) -> None:
        """memd stayed away too long: the queued requests kept for it fail after all."""
        error = GenerationError("UNAVAILABLE", f"memd has been unreachable for over {CARRY_S:g} s; retry later")
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


class InferdService(pb_grpc.InferdServicer):
    def __init__(self, link: MemdLink, metrics: InferdMetrics | None = None) -> None:
        self.link = link
        self.metrics = metrics

    def _scheduler(self) -> Scheduler:
        if self.link.scheduler is None:
            raise GenerationError("UNAVAILABLE", "not attached to memd (it is down or restarting); retry shortly")
        return self.link.scheduler

    def _request(self, msg: pb.GenerateRequest) -> Request:
        if msg.prompt and msg.prompt_ids:
            raise GenerationError("INVALID_ARGUMENT", "give a prompt or prompt_ids, not both")
        ids = list(msg.prompt_ids) or self.link.tokenizer.encode(msg.prompt).ids
        vocab = self.link.config.vocab_size
        if any(i >= vocab for i in ids):
            raise GenerationError("INVALID_ARGUMENT", f"prompt_ids must be below the vocabulary size {vocab}")
        params = SamplingParams(max_tokens=msg.max_tokens or DEFAULT_MAX_TOKENS, temperature=msg.temperature,
                                top_p=msg.top_p or 1.0, top_k=msg.top_k,
                                seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
                                ignore_eos=msg.ignore_eos, n=msg.n or 1)
        if msg.turn_id and not msg.session_id:
            raise GenerationError("INVALID_ARGUMENT", "turn_id names a turn of a session: give session_id too")
        return Request(ids, params, msg.session_id or None, turn_id=msg.turn_id or None)

    async def Generate(self, msg: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateReply]:
        try:
            request_id = self._request_id(context)
            scheduler = self._scheduler()
            request = self._request(msg)
            request.request_id = request_id
            scheduler.submit(request)
        except BadParams as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except GenerationError as err:
            await _refuse(context, err)
        remaining = request.params.n
        try:
            await context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))
            while remaining:
                event = await request.events.get()
                if self.metrics is not None and (event.error is not None or event.finish_reason is not None):
                    self.metrics.finished(event)
                if event.error is not None:
                    scheduler.cancel(request)       # n > 1: the other completions stop too
                    remaining = 0
                    log.info("request failed", request=request_id, session=request.session_id, seq=request.seq_id,
                             code=event.error.code, error=event.error.message)
                    await _refuse(context, event.error)
                if event.finish_reason is not None:
                    remaining -= 1
                    log.info("request finished", request=request_id, session=request.session_id, seq=request.seq_id,
                             index=event.index, finish_reason=event.finish_reason, **(event.usage or {}))
                    yield pb.GenerateReply(token_ids=event.token_ids, text=event.text, index=event.index,
                                           finish_reason=event.finish_reason, usage=pb.Usage(**event.usage or {}))
                else:
                    yield pb.GenerateReply(token_ids=event.token_ids, text=event.text, index=event.index)
        finally:
            if remaining:          # the client went away (cancel, deadline): the sequences park or free
                log.info("request cancelled by its client", request=request_id, session=request.session_id)
                scheduler.cancel(request)

    @staticmethod
    def _request_id(context: grpc.aio.ServicerContext) -> str:
        return checked_request_id(next((v for k, v in context.invocation_metadata() or () if k == REQUEST_ID_KEY),
                                       None))

    async def Reset(self, msg: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.ResetReply:
        if not msg.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is required")
        try:
            await self._scheduler().reset(msg.session_id)
        except GenerationError as err:
            await _refuse(context, err)
        return pb.ResetReply()
