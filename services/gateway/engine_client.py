"""The gateway's client of the engine: submits requests to schedulers, gathers their outputs.

One EngineClient per gateway process. It owns every generation in flight, the scheduler pool
(submit, abort, load balancing, health: schedulers.py) and the output streams from the
detokenizers (detokenizers.py), on which arrive the StepMessages of the requests this
gateway owns. Each request's outputs are copied
into buffers sized for its whole output (accumulator.py). A streaming request's
generator is woken by every message that brings it tokens; any other request's only
once, when it ends.

A request ends complete or fails: it fails (RequestError "unavailable", rendered as
HTTP 503 or gRPC UNAVAILABLE) when a hop reports an error, when part of its output
can no longer arrive, or when the pool finds its path broken for longer than
--hop-timeout-s. A failed request is aborted in its scheduler until that is
confirmed (see docs/reliability.md).
"""

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import numpy as np
from flatwire_wire.logprobs import I32, LogprobBlock, RequestLogprobs
from flatwire_wire.rpc import FIELD_METADATA
from flatwire_wire.scheduler import ModelInfo, TokenizedRequest
from flatwire_wire.steps import Finish, FinishReason, StepMessage

from services.gateway.accumulator import Accumulator, OutputLost
from services.gateway.config import GatewayConfig
from services.gateway.detokenizers import DetokenizerStreams
from services.gateway.protocol.intake import GenerateInput
from services.gateway.protocol.parse import rename_field
from services.gateway.read_delay import ReadDelay
from services.gateway.reply import Ending, Reply
from services.gateway.schedulers import SchedulerPool

log = logging.getLogger("flatwire.gateway")

GRPC_TO_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.ALREADY_EXISTS: "invalid_argument",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",  # every scheduler's waiting list is full
}
# A streaming generator that gets to its tokens this late (this gateway is behind: its event loop, or the messages
# waiting to be read) waits as long again, at most --stream-coalesce-ms, before it takes them.
COALESCE_AFTER_S = 0.005
# The automatic admission limit: this many generations per running slot of the schedulers in rotation
# (one running, seven waiting), and never below --max-batch-size (a batch must fit an idle gateway).
ADMISSION_FACTOR = 8
# The automatic admission holds this many of the largest request (--max-batch-size): one request never takes
# all of it, so a 4096-generation rollout batch leaves room for other clients.
FAIR_SHARE = 2


class RequestError(Exception):
    """A request the pipeline refused or failed: status is "invalid_argument", "not_found", "resource_exhausted"
    (admission control: HTTP 429, gRPC RESOURCE_EXHAUSTED), "unavailable" (a hop went away: 503, UNAVAILABLE) or
    "internal" (a step that ran it raised: 500, INTERNAL)."""

    def __init__(self, status: str, field: str | None, message: str):
        super().__init__(message)
        self.status = status
        self.field = field
        self.message = message


@dataclass
class GenerationState:
    rid: str
    inp: GenerateInput
    started_at: float
    outputs: Accumulator
    scheduler: str = ""
    ending: Ending | None = None  # how it ended, once it did
    ended_at: float = 0.0
    failure: str | None = None  # why the request failed (a server-side fault)
    failure_status: str = "unavailable"  # RequestError's status for it
    abort_requested: bool = False  # by EngineClient.abort: stopped in its scheduler as soon as it has one
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    woken_at: float = 0.0  # when wakeup was last set while the generator waited on it (less how late its message was)

    @property
    def ended(self) -> bool:
        return self.ending is not None or self.failure is not None


@dataclass
class Admission:
    """Room for `count` generations, reserved whole before any of them starts (EngineClient.admit)."""

    count: int
    started: int = 0


class EngineClient:
    def __init__(self, config: GatewayConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.owner = config.owner_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.detokenizers = DetokenizerStreams(config, self.owner, on_step=self._dispatch,
                                               on_step_failed=self._undelivered, on_cut=self._fail_requests_via,
                                               on_change=lambda: self.schedulers.recheck())
        self.schedulers = SchedulerPool(config, self.detokenizers, on_replica_lost=self._fail_requests_on)
        self.model_info: ModelInfo | None = None
        self.model_name = config.served_model_name or ""
        self._requests: dict[str, GenerationState] = {}
        self._read_delays: defaultdict[str, ReadDelay] = defaultdict(ReadDelay)  # per scheduler replica: its clock
        self._reserved = 0  # generations admitted (EngineClient.admit) that have not started yet
        # Refusals by admission control: requests past this gateway's limit, submits a scheduler refused.
        self.rejected = {"gateway": 0, "scheduler": 0}

    async def start(self) -> None:
        await self.schedulers.start()
        self.model_info = await self.schedulers.model_info()
        self.model_name = self.model_name or self.model_info.model

    async def stop(self) -> None:
        await self.schedulers.stop()  # first: its health rounds follow new detokenizers
        await self.detokenizers.stop()

    def healthy(self) -> bool:
        """Some scheduler is in rotation: its whole path to this gateway works."""
        return self.schedulers.any_healthy()

    def health_report(self) -> dict:
        return {"healthy": self.healthy(), "schedulers": self.schedulers.report(),
                "detokenizers": self.detokenizers.report()}

    # -- admission control -------------------------------------------------------------------------------

    @property
    def admission_limit(self) -> int:
        """Generations this gateway holds at once: --max-outstanding-requests, or ADMISSION_FACTOR x the
        running slots of the schedulers in rotation, at least FAIR_SHARE x --max-batch-size."""
        if self.config.max_outstanding_requests:
            return self.config.max_outstanding_requests
        return max(FAIR_SHARE * self.config.max_batch_size, ADMISSION_FACTOR * self.schedulers.capacity())

    @property
    def outstanding(self) -> int:
        """Generations held: running in the pipeline, or admitted and about to start."""
        return len(self._requests) + self._reserved

    def _check_room(self, count: int) -> None:
        limit, outstanding = self.admission_limit, self.outstanding
        if outstanding + count > limit:
            self.rejected["gateway"] += 1
            what = f"{count} generations" if count > 1 else "1 generation"
            raise RequestError("resource_exhausted", None,
                               f"this gateway is busy: {outstanding} generations are outstanding and {what} more "
                               f"would pass its limit of {limit} (max_outstanding_requests); retry later")

    @contextmanager
    def admit(self, count: int) -> Iterator[Admission]:
        """Admit a request's `count` generations whole, or refuse them all (RequestError "resource_exhausted").
        Pass the Admission to generate() for each; the room of those never started is given back on exit."""
        self._check_room(count)
        admission = Admission(count)
        self._reserved += count
        try:
            yield admission
        finally:
            self._reserved -= admission.count - admission.started

    # -- requests ---------------------------------------------------------------------------------------

    async def generate(self, inp: GenerateInput, admission: Admission | None = None) -> AsyncGenerator[Reply, None]:
        """One generation's replies: a stream's as its tokens arrive, any other's one, at its end (the last reply
        has its ending). Admitted by `admission` (a batch's, from admit()), or here on its own."""
        if admission is not None and admission.started < admission.count:
            admission.started += 1
            self._reserved -= 1
        else:
            self._check_room(1)
        rid = inp.rid or uuid.uuid4().hex
        if rid in self._requests:
            raise RequestError("invalid_argument", "rid", f"rid: {rid!r} is already running")
        outputs = Accumulator(inp.logprob, inp.sampling.max_new_tokens, inp.return_top_p_token_ids)
        state = GenerationState(rid=rid, inp=inp, started_at=time.perf_counter(), outputs=outputs)
        self._requests[rid] = state
        request = TokenizedRequest(
            rid=rid, owner=self.owner, input_ids=inp.input_ids, sampling=inp.sampling, logprob=inp.logprob,
            detokenize=inp.detokenize, stream_interval=self.config.stream_interval if inp.stream else 0,
            return_routed_experts=inp.return_routed_experts, routed_experts_start_len=inp.routed_experts_start_len,
            return_top_p_token_ids=inp.return_top_p_token_ids, lora_name=inp.lora_name,
            cache_namespace=inp.cache_namespace)
        coalesce_s = self.config.stream_coalesce_ms / 1000
        try:
            state.scheduler = await self._submit(request, inp)
            if state.abort_requested:  # aborted while it was being submitted
                self.schedulers.abort(state.scheduler, rid)
            while True:
                if not state.wakeup.is_set():
                    await state.wakeup.wait()
                    late = time.perf_counter() - state.woken_at
                    if late > COALESCE_AFTER_S and coalesce_s and state.inp.stream and not state.ended:
                        await asyncio.sleep(min(late, coalesce_s))  # the next messages' tokens join this reply
                state.wakeup.clear()
                if state.failure is not None:
                    raise RequestError(state.failure_status, None, state.failure)
                reply = self._reply(state)
                if reply.new.token_ids or reply.new.prompt is not None or reply.finished:
                    yield reply
                if reply.finished:
                    return
        finally:
            self._requests.pop(rid, None)
            if state.scheduler:
                self.schedulers.release(state.scheduler, rid)
                if state.ending is None:  # a client that left, or a failure: the scheduler must stop it
                    self.schedulers.abort(state.scheduler, rid)

    def abort(self, rid: str) -> bool:
        """SGLang's /abort_request with a rid: stop this gateway's request `rid` (its meta_info.id). It ends like
        a finished one, with finish_reason "abort" and the tokens generated until then. False when no such
        request runs here. (abort_all goes to every scheduler: SchedulerPool.control.)"""
        state = self._requests.get(rid)
        if state is None or state.ended or state.abort_requested:
            return False
        state.abort_requested = True
        if state.scheduler:
            self.schedulers.abort(state.scheduler, state.rid)
        return True

    async def _submit(self, request: TokenizedRequest, inp: GenerateInput) -> str:
        try:
            return await self.schedulers.submit(request, inp.routing_key)
        except grpc.aio.AioRpcError as exc:
            status = GRPC_TO_STATUS.get(exc.code(), "unavailable")
            detail = exc.details() or str(exc.code())
            if status == "resource_exhausted":
                self.rejected["scheduler"] += 1
            if status in ("unavailable", "resource_exhausted"):
                raise RequestError(status, None, detail) from None
            field = dict(exc.trailing_metadata() or ()).get(FIELD_METADATA)
            raise RequestError(status, *rename_field(field, detail, inp.fields)) from None

    def _reply(self, state: GenerationState) -> Reply:
        """What arrived since the previous reply, with the request so far (and how it ended, once it did)."""
        new, so_far = state.outputs.take()
        now = state.ended_at if state.ending is not None else time.perf_counter()
        return Reply(rid=state.rid, prompt_tokens=len(state.inp.input_ids), new=new,
                     completion_tokens=len(state.outputs.token_ids), weight_versions=state.outputs.versions(),
                     e2e_latency=now - state.started_at, ending=state.ending, so_far=so_far)

    # -- outputs (detokenizers.py calls these) ------------------------------------------------------------

    def _undelivered(self, step: StepMessage) -> None:
        """Taking a message's outputs raised (a bug): its requests' outputs are in doubt."""
        for rid in step.touched_rids():
            if state := self._requests.get(rid):
                self._fail(state, "the gateway failed to take its outputs")

    def _dispatch(self, step: StepMessage) -> None:
        """Work per message and per request in it; the arrays are copied with numpy, entry by entry."""
        woken: set[str] = set()
        rids, token_ids, output, version = list(step.rids), list(step.token_ids), step.output, step.weight_version
        top_p = step.top_p
        texts = list(step.texts) or [""] * len(rids)
        end = 0
        for i, (rid, position, count) in enumerate(zip(rids, step.positions, step.counts)):
            start, end = end, end + count
            state = self._requests.get(rid)
            if state is None or state.ended:
                continue
            try:
                if state.outputs.add(position, token_ids[start:end], texts[i], output, i, version, top_p) and \
                        state.inp.stream:
                    woken.add(rid)
            except OutputLost as exc:
                self._fail(state, str(exc))
        for i, rid in enumerate(step.prompt_rids):
            state = self._requests.get(rid)
            if state is not None and state.outputs.prompt is None and step.prompt is not None:  # else a replay
                state.outputs.prompt = _prompt_logprobs(state, step.prompt, i)
                if state.inp.stream:
                    woken.add(rid)
        for finish in step.finished:
            state = self._requests.get(finish.rid)
            if state is not None and not state.ended:
                self._finish(state, finish, step.weight_version)
                woken.add(finish.rid)
        if not woken:
            return
        # As if woken when the message came in on time: a late message counts as much as a late wakeup.
        woken_at = time.perf_counter() - self._read_late(step, woken)
        for rid in woken:
            state = self._requests[rid]
            if not state.wakeup.is_set():
                state.woken_at = woken_at
                state.wakeup.set()

    def _read_late(self, step: StepMessage, rids: set[str]) -> float:
        """Seconds `step` waited to be read here, against the least delay of its own scheduler's messages
        (replicas on other hosts have clocks of their own); `rids`: requests of the step that are held here."""
        scheduler = next((state.scheduler for rid in rids if (state := self._requests[rid]).scheduler), "")
        return self._read_delays[scheduler].behind(step.made_at_unix_us, time.time())

    def _finish(self, state: GenerationState, finish: Finish, weight_version: str) -> None:
        """`weight_version`: of the message that brought the finish, the version in force when the request ended."""
        if finish.reason == FinishReason.ERROR:
            return self._fail(state, finish.message, "internal" if finish.step_failed else "unavailable")
        held = len(state.outputs.token_ids)
        if finish.reason != FinishReason.ABORT:
            if held != finish.output_tokens:
                return self._fail(state, f"output incomplete: {held} of its {finish.output_tokens} tokens arrived")
            logprob = state.inp.logprob
            if logprob.return_logprob and logprob.logprob_start_len >= 0 and state.outputs.prompt is None:
                return self._fail(state, "its prompt logprobs never arrived")
        state.outputs.end(weight_version)
        state.ending, state.ended_at = Ending.of(finish), time.perf_counter()

    def _fail(self, state: GenerationState, why: str, status: str = "unavailable") -> None:
        """End the request with an error (a server-side fault); its generate() raises it."""
        if not state.ended:
            log.warning("request %s failed: %s", state.rid, why)
            _end_with_error(state, why, status)

    def _fail_many(self, states: list[GenerationState], why: str) -> None:
        """_fail for every one of `states` that still runs, with one log line for the fault, not one per request."""
        running = [state for state in states if not state.ended]
        for state in running:
            _end_with_error(state, why)
        if running:
            log.warning("%d requests failed (%s, ...): %s", len(running), running[0].rid, why)

    def fail_all(self, why: str) -> None:
        """Fail every request in flight (HTTP 503, gRPC UNAVAILABLE; each aborted in its scheduler): a gateway
        that stops before they end (its drain ran out of time) answers them rather than cutting them off."""
        self._fail_many(list(self._requests.values()), why)

    def _fail_requests_via(self, detokenizer: str) -> None:
        """A detokenizer's output stream lost messages: fail the requests whose outputs come through it."""
        self._fail_many([state for state in self._requests.values()
                         if state.scheduler and detokenizer in self.schedulers.followers(state.scheduler)],
                        f"the output stream from detokenizer {detokenizer} was cut: outputs in transit were lost")

    def _fail_requests_on(self, scheduler: str, why: str) -> None:
        """The path through a scheduler replica stayed broken: fail its in-flight requests."""
        self._fail_many([state for state in self._requests.values() if state.scheduler == scheduler], why)


def _end_with_error(state: GenerationState, why: str, status: str = "unavailable") -> None:
    state.failure, state.failure_status = why, status
    state.wakeup.set()


def _prompt_logprobs(state: GenerationState, block: LogprobBlock, i: int) -> RequestLogprobs:
    """Request i's prompt logprobs: rows for positions [start + null_prefix, L)."""
    ids = state.inp.input_ids
    start, null_prefix = max(state.inp.logprob.logprob_start_len, 0), block.null_prefix[i]
    logprobs = block.request_logprobs(i, np.asarray(ids[start + null_prefix:], dtype=I32))
    logprobs.null_token_ids = np.asarray(ids[start:start + null_prefix], dtype=I32)
    return logprobs
