"""The gateway's engine: submits requests to schedulers, gathers their outputs.

One Engine per gateway process. It owns the scheduler pool (submit, abort, load
balancing, health) and one output stream per detokenizer, on which arrive the
StepOutputs of the requests this gateway owns. Each request's outputs are kept as
byte ranges of the step buffers (accumulator.py) and joined when read: per stream
chunk, and once when the request finishes.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from services.common.arrays import I32
from services.common.pb import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2
from services.common.pb.arrays_pb2 import FinishReason
from services.common.rpc import create_channel
from services.gateway.accumulator import Accumulator, StepBlock, track_of
from services.gateway.config import GatewayConfig
from services.gateway.result import LogprobTrack, RequestResult
from services.gateway.schedulers import SchedulerPool

log = logging.getLogger("flatwire.gateway")

FINISH_NAMES = {
    FinishReason.FINISH_REASON_LENGTH: "length",
    FinishReason.FINISH_REASON_STOP_TOKEN: "stop",
    FinishReason.FINISH_REASON_STOP_STRING: "stop",
    FinishReason.FINISH_REASON_ABORT: "abort",
}
GRPC_TO_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.ALREADY_EXISTS: "invalid_argument",
}


class RequestError(Exception):
    """A request the pipeline refused: status is "invalid_argument", "not_found" or "unavailable"."""

    def __init__(self, status: str, field: str | None, message: str):
        super().__init__(message)
        self.status = status
        self.field = field
        self.message = message


@dataclass
class GenerateInput:
    input_ids: list[int]
    sampling: scheduler_pb2.SamplingParams
    logprob: scheduler_pb2.LogprobParams
    detokenize: scheduler_pb2.DetokenizeParams


@dataclass
class Chunk:
    """What arrived for one request since the previous chunk."""

    token_ids: list[int]
    text: str
    rid: str = ""  # the request's id (meta_info.id while streaming)
    output: LogprobTrack | None = None  # rows of token_ids, when return_logprob
    prompt: LogprobTrack | None = None  # in the first chunk, when prompt logprobs were asked
    result: RequestResult | None = None  # the whole request, on the last chunk


@dataclass
class RequestState:
    rid: str
    inp: GenerateInput
    started_at: float
    outputs: Accumulator
    scheduler: str = ""
    prompt: LogprobTrack | None = None
    prompt_sent: bool = False
    result: RequestResult | None = None
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class Engine:
    def __init__(self, config: GatewayConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.owner = config.owner_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.schedulers = SchedulerPool(config, on_replica_lost=self._fail_requests_on)
        self.model_info: scheduler_pb2.ModelInfo | None = None
        self.model_name = config.served_model_name or ""
        self._requests: dict[str, RequestState] = {}
        self._connected_detokenizers: set[str] = set()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.schedulers.start()
        self.model_info = await self.schedulers.model_info()
        self.model_name = self.model_name or self.model_info.model
        for address in self.config.detokenizers:
            self._tasks.append(asyncio.create_task(self._listen(address)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.schedulers.stop()

    def healthy(self) -> bool:
        return self.schedulers.any_healthy() and len(self._connected_detokenizers) == len(self.config.detokenizers)

    # -- requests ---------------------------------------------------------------------------------------

    async def generate(self, inp: GenerateInput) -> AsyncIterator[Chunk]:
        rid = uuid.uuid4().hex
        state = RequestState(rid=rid, inp=inp, started_at=time.perf_counter(), outputs=Accumulator(inp.logprob))
        self._requests[rid] = state
        request = scheduler_pb2.TokenizedRequest(
            rid=rid, owner=self.owner, input_ids=inp.input_ids, sampling=inp.sampling, logprob=inp.logprob,
            detokenize=inp.detokenize)
        try:
            state.scheduler = await self._submit(request)
            while True:
                await state.wakeup.wait()
                state.wakeup.clear()
                chunk = self._take_chunk(state)
                if chunk.token_ids or chunk.prompt is not None or chunk.result is not None:
                    yield chunk
                if chunk.result is not None:
                    return
        finally:
            self._requests.pop(rid, None)
            if state.scheduler:
                self.schedulers.release(state.scheduler, rid)
                if state.result is None:
                    await self.schedulers.abort(state.scheduler, rid)

    async def _submit(self, request: scheduler_pb2.TokenizedRequest) -> str:
        try:
            return await self.schedulers.submit(request)
        except grpc.aio.AioRpcError as exc:
            status = GRPC_TO_STATUS.get(exc.code(), "unavailable")
            detail = exc.details() or str(exc.code())
            raise RequestError(status, detail.split(":", 1)[0] if status != "unavailable" else None, detail) from None

    def _take_chunk(self, state: RequestState) -> Chunk:
        token_ids, text, output = state.outputs.take() if state.outputs.unread else ([], "", None)
        chunk = Chunk(token_ids=token_ids, text=text, rid=state.rid, output=output, result=state.result)
        if state.prompt is not None and not state.prompt_sent:
            chunk.prompt, state.prompt_sent = state.prompt, True
        return chunk

    # -- outputs ----------------------------------------------------------------------------------------

    async def _listen(self, address: str) -> None:
        """Consume this gateway's outputs from one detokenizer, reconnecting on failure."""
        backoff = 0.1
        while True:
            channel = create_channel(address, self.config.max_message_mb)
            stub = detokenizer_pb2_grpc.DetokenizerStub(channel)
            try:
                call = stub.StreamOutputs(detokenizer_pb2.StreamOutputsRequest(owner=self.owner))
                await call.wait_for_connection()
                self._connected_detokenizers.add(address)
                backoff = 0.1
                async for step in call:
                    self._dispatch(step)
            except grpc.aio.AioRpcError as exc:
                log.warning("detokenizer %s stream ended: %s", address, exc.code())
            finally:
                self._connected_detokenizers.discard(address)
                await channel.close()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _dispatch(self, step: scheduler_pb2.StepOutput) -> None:
        touched: set[str] = set()
        if step.rids:
            block = StepBlock.of(step.output) if step.output.rows else None
            texts = step.texts or [""] * len(step.rids)
            for i, (rid, token_id, text) in enumerate(zip(step.rids, step.token_ids, texts)):
                if state := self._requests.get(rid):
                    state.outputs.add(token_id, text, block, i)
                    touched.add(rid)
        if step.prompt_rids:
            block = StepBlock.of(step.prompt)
            for i, rid in enumerate(step.prompt_rids):
                if state := self._requests.get(rid):
                    state.prompt = _prompt_track(state, block, step.prompt.null_prefix[i], i)
                    touched.add(rid)
        for finish in step.finished:
            state = self._requests.get(finish.rid)
            if state is not None and state.result is None:
                self._finish(state, finish)
                touched.add(finish.rid)
        for rid in touched:
            self._requests[rid].wakeup.set()

    def _finish(self, state: RequestState, finish: scheduler_pb2.Finish) -> None:
        output_ids, text, output = state.outputs.whole()
        result = RequestResult(
            rid=state.rid,
            prompt_tokens=len(state.inp.input_ids),
            output_ids=output_ids,
            text=text,
            finish_reason=FINISH_NAMES.get(finish.reason, "abort"),
            e2e_latency=time.perf_counter() - state.started_at,
            token_ids_logprob=list(state.inp.logprob.token_ids_logprob) or None,
            prompt=state.prompt,
            output=output,
        )
        if finish.reason == FinishReason.FINISH_REASON_STOP_TOKEN:
            result.matched_stop = finish.matched_token
        elif finish.reason == FinishReason.FINISH_REASON_STOP_STRING:
            result.matched_stop = finish.matched_stop
        elif finish.reason == FinishReason.FINISH_REASON_ABORT:
            result.error = finish.message or "aborted"
        state.result = result

    def _fail_requests_on(self, scheduler: str, reason: str) -> None:
        """A scheduler replica died: end its in-flight requests now, with an error."""
        for state in list(self._requests.values()):
            if state.scheduler == scheduler and state.result is None:
                self._finish(state, scheduler_pb2.Finish(
                    rid=state.rid, reason=FinishReason.FINISH_REASON_ABORT,
                    message=f"scheduler {scheduler} failed: {reason}"))
                state.wakeup.set()


def _prompt_track(state: RequestState, block: StepBlock, null_prefix: int, i: int) -> LogprobTrack:
    """Request i's prompt logprobs: rows for positions [start + null_prefix, L)."""
    start = max(state.inp.logprob.logprob_start_len, 0)
    ids = state.inp.input_ids
    logprob = state.inp.logprob
    track = track_of([block.ranges(i)], ids[start + null_prefix:], logprob.top_logprobs_num,
                     len(logprob.token_ids_logprob))
    track.null_prefix = null_prefix
    track.null_token_ids = np.asarray(ids[start:start + null_prefix], dtype=I32)
    return track
