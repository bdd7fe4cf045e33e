"""inferd's gRPC service: Generate and Reset over the worker engine (`inferd.engine`)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
import structlog
from grpc import StatusCode

from inferd.completions import Completions
from inferd.engine import WorkerEngine
from inferd.metrics import InferdMetrics
from inferd.sampling import BadParams, SamplingParams
from inferd.scheduler import GenerationError, Request, Scheduler
from shared import address as addr
from shared.rpc import inferd_pb2 as pb
from shared.rpc import inferd_pb2_grpc as pb_grpc

log = structlog.get_logger("inferd")

DEFAULT_MAX_TOKENS = 64
REQUEST_ID_KEY = "x-request-id"


async def _refuse(context: grpc.aio.ServicerContext, err: GenerationError) -> None:
    """Fail the call with the error's status, marked as inferd's own: a draining or detached worker answers
    UNAVAILABLE, and its client must not report it as one nobody could reach."""
    await context.abort(err.code, err.message, trailing_metadata=addr.ANSWERED)


def checked_request_id(given: str | None) -> str:
    """The client's x-request-id (to find its request in our logs), else a new one; sent back either way."""
    if given is None:
        return uuid.uuid4().hex[:16]
    if not (0 < len(given) <= 128 and given.isascii() and given.isprintable() and " " not in given):
        raise GenerationError(StatusCode.INVALID_ARGUMENT, "x-request-id must be 1 to 128 visible ASCII characters")
    return given


class InferdService(pb_grpc.InferdServicer):
    def __init__(self, engine: WorkerEngine, metrics: InferdMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics

    def _scheduler(self) -> Scheduler:
        if self.engine.scheduler is None:
            raise GenerationError(StatusCode.UNAVAILABLE,
                                  "not attached to memd (it is down or restarting); retry shortly")
        return self.engine.scheduler

    def _request(self, msg: pb.GenerateRequest) -> Request:
        if msg.prompt and msg.prompt_ids:
            raise GenerationError(StatusCode.INVALID_ARGUMENT, "give a prompt or prompt_ids, not both")
        ids = list(msg.prompt_ids) or self.engine.tokenizer.encode(msg.prompt).ids
        vocab = self.engine.config.vocab_size
        if any(i >= vocab for i in ids):
            raise GenerationError(StatusCode.INVALID_ARGUMENT, f"prompt_ids must be below the vocabulary size {vocab}")
        params = SamplingParams(max_tokens=msg.max_tokens or DEFAULT_MAX_TOKENS, temperature=msg.temperature,
                                top_p=msg.top_p or 1.0, top_k=msg.top_k,
                                seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
                                ignore_eos=msg.ignore_eos, n=msg.n or 1)
        if msg.turn_id and not msg.session_id:
            raise GenerationError(StatusCode.INVALID_ARGUMENT, "turn_id names a turn of a session: give session_id too")
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
            await context.abort(StatusCode.INVALID_ARGUMENT, str(err))
        except GenerationError as err:
            await _refuse(context, err)
        reader = Completions(request, scheduler.cancel, self.metrics)
        try:
            await context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))
            while (event := await reader.next()) is not None:
                if event.finish_reason is not None:
                    yield pb.GenerateReply(token_ids=event.token_ids, text=event.text, index=event.index,
                                           finish_reason=event.finish_reason, usage=pb.Usage(**event.usage or {}))
                else:
                    yield pb.GenerateReply(token_ids=event.token_ids, text=event.text, index=event.index)
        except GenerationError as err:
            await _refuse(context, err)
        finally:
            reader.abandon()           # the client went away (cancel, deadline): the sequences park or free

    @staticmethod
    def _request_id(context: grpc.aio.ServicerContext) -> str:
        return checked_request_id(next((v for k, v in context.invocation_metadata() or () if k == REQUEST_ID_KEY),
                                       None))

    async def Reset(self, msg: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.ResetReply:
        if not msg.session_id:
            await context.abort(StatusCode.INVALID_ARGUMENT, "session_id is required")
        try:
            await self._scheduler().reset(msg.session_id)
        except GenerationError as err:
            await _refuse(context, err)
        return pb.ResetReply()
