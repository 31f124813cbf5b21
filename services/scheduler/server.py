"""The scheduler's gRPC server: Submit, Abort, StreamSteps, GetModelInfo, GetStats, rollout control
(rollout_calls.py) and LoRA adapters (lora_calls.py).

Its handlers take and return the wire layer's twins (flatwire_wire.scheduler.SCHEDULER converts them). They run
on the asyncio loop; the model runs in the engine thread. Each step
message is handed back to the loop with call_soon_threadsafe, recorded in the step
journal and broadcast to every StreamSteps subscriber's queue. A new subscriber gets
the journal's replay first, in the same loop callback that registers it, so no step
falls between the two.
"""

import asyncio
import dataclasses
import logging
import sys
import time
import uuid
from pathlib import Path

import grpc
from flatwire_wire.control import (
    EMPTY,
    Empty,
)
from flatwire_wire.logprobs import LogprobsMode
from flatwire_wire.rpc import FIELD_METADATA, STATUS_CODES
from flatwire_wire.scheduler import (
    SCHEDULER,
    AbortRequest,
    ModelInfo,
    SchedulerStats,
    SubmitBatchReply,
    SubmitBatchRequest,
    SubmitResult,
    TokenizedRequest,
)
from flatwire_wire.steps import FinishReason, StepMessage

from services.common.auth import resolve_internal_secret
from services.common.config import parse_config
from services.common.logs import setup_logging
from services.common.memory import keep_big_blocks
from services.common.model_store import ModelNotFound, cache_root, model_name, resolve_model
from services.common.rpc import add_health, create_server, listen, mark_serving
from services.common.signals import exit_now, stop_requested
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine.engine import Engine, MemoryReleased, QueueFull
from services.scheduler.kv.manager import longest_sequence
from services.scheduler.lora_calls import LoraCalls
from services.scheduler.model.architecture import UnsupportedModel
from services.scheduler.model.attention import BackendUnavailable
from services.scheduler.model.lora_adapter import AdapterRefused
from services.scheduler.model.occupation import MemoryOccupation
from services.scheduler.model.runner import ModelRunner
from services.scheduler.model.synthetic import SyntheticRunner
from services.scheduler.model.weight_sync import WeightGroups
from services.scheduler.model.weights import ServedWeights
from services.scheduler.output.journal import StepJournal
from services.scheduler.parallel.group import rank_device
from services.scheduler.parallel.ranks import Ranks
from services.scheduler.rollout_calls import RolloutCalls
from services.scheduler.sampling.grammar import Grammars
from services.scheduler.step import StepRunner
from services.scheduler.submit import InvalidTokenizedRequest, SubmitLimits, parse_request

log = logging.getLogger("flatwire.scheduler")
SERVICE_NAME = SCHEDULER.name
BACKPRESSURE_POLL_S = 0.001
CUT = object()  # queued to a subscriber that fell too far behind: its stream ends with UNAVAILABLE


class SchedulerService(RolloutCalls, LoraCalls):
    """The Scheduler service (flatwire_wire.scheduler.SchedulerServicer): requests and their steps here, rollout
    control in RolloutCalls, LoRA adapters in LoraCalls."""

    def __init__(self, config: SchedulerConfig, model_name: str, runner: StepRunner,
                 weights: ServedWeights | None = None, grammars: Grammars | None = None):
        """`weights`: the model's, for updates in place (None: --engine synthetic has none); `grammars`: compiles
        structured-output constraints (None: they are refused)."""
        kv_tokens = longest_sequence(runner.num_pages, runner.page_size, runner.kv_windows, config.prefill_budget)
        self.limits = SubmitLimits(vocab_size=runner.vocab_size, max_context=runner.max_context,
                                   max_top_logprobs=config.max_top_logprobs, eos_token_ids=tuple(runner.eos_token_ids),
                                   output_interval=config.output_interval,
                                   stream_coalesce_tokens=config.stream_coalesce_tokens, max_total_tokens=kv_tokens,
                                   logprobs_mode=LogprobsMode.named(config.logprobs_mode),
                                   routed_experts=runner.expert_routing is not None)
        source = None if config.load_format == "dummy" else weights.model_dir if weights else None
        occupation = (MemoryOccupation(runner.kv, weights, runner.device, source, graphs=runner.graphs is not None)
                      if weights is not None and isinstance(runner, ModelRunner) else None)
        self.model_info = ModelInfo(
            model=model_name, vocab_size=runner.vocab_size, max_context=runner.max_context,
            eos_token_ids=runner.eos_token_ids, max_top_logprobs=config.max_top_logprobs,
            device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
            max_running_requests=config.max_running_requests, instance_id=uuid.uuid4().hex,
            max_total_tokens=kv_tokens, page_size=runner.page_size, prefix_cache=not config.disable_radix_cache,
            logprobs_mode=self.limits.logprobs_mode, kv_layers=runner.kv_layers,
            state_bytes_per_request=runner.state_bytes,
            state_checkpoints=runner.state_slots[1] if runner.state_slots else 0,
            return_routed_experts=self.limits.routed_experts, releases_memory=occupation is not None,
            load_format=config.load_format,
            max_loras_per_batch=config.max_loras_per_batch if config.enable_lora else 0, tp_size=config.tp_size)
        self.config = config
        self.grammars = grammars
        self.journal = StepJournal(config.replay_window_s, config.replay_window_mb * 1024 * 1024)
        self._loop = asyncio.get_running_loop()
        self._subscribers: set[asyncio.Queue] = set()  # of StepOutput, or None: end of stream, or CUT
        self._queues: tuple[asyncio.Queue, ...] = ()  # the same, for the engine thread to read
        self.engine = Engine(runner, config, publish=self._publish_threadsafe, wait_for_room=self._wait_for_room,
                             behind=self._behind, occupation=occupation)
        RolloutCalls.__init__(self, weights, WeightGroups(runner.device, config.weights_sync_timeout_s, weights.ranks)
                              if weights else None)

    def _wait_for_room(self) -> None:
        """Engine thread, between steps: while a subscriber has more than --max-subscriber-backlog messages
        queued, wait (its detokenizer, or a gateway behind it, is slower than the steps); one that stays behind
        for --stall-timeout-s is cut, and resubscribing replays what it missed."""
        deadline = time.monotonic() + self.config.stall_timeout_s
        while slow := [queue for queue in self._queues if queue.qsize() > self.config.max_subscriber_backlog]:
            if time.monotonic() > deadline:
                log.warning("%d step subscribers stayed %.0fs behind: ending their streams", len(slow),
                            self.config.stall_timeout_s)
                self._loop.call_soon_threadsafe(self._cut, slow)
                return
            time.sleep(BACKPRESSURE_POLL_S)

    def _behind(self) -> bool:
        """Engine thread: whether a subscriber has a step message queued (its stream has not taken the last one)."""
        return any(queue.qsize() for queue in self._queues)

    def _cut(self, queues: list[asyncio.Queue]) -> None:
        for queue in queues:
            if queue in self._subscribers:
                self._unsubscribe(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(CUT)

    def _subscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.add(queue)
        self._queues = tuple(self._subscribers)

    def _unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)
        self._queues = tuple(self._subscribers)

    def _publish_threadsafe(self, message: StepMessage) -> None:
        self._loop.call_soon_threadsafe(self._broadcast, message)

    def _broadcast(self, message: StepMessage | None) -> None:
        if message is not None:
            self.journal.record(message)
        for subscriber in self._subscribers:
            subscriber.put_nowait(message)

    def end_streams(self) -> None:
        """Finish every StepOutput stream with OK (shutdown), rather than cutting it."""
        self._broadcast(None)

    def _accept(self, request: TokenizedRequest) -> SubmitResult:
        """Queue `request`, or say why not: the status a Submit of it answers."""
        try:  # (a grammar is parsed here and compiled after the answer: Grammars.matcher_later)
            parsed = parse_request(request, self.limits, self.grammars, self.engine.adapters)
        except InvalidTokenizedRequest as exc:
            code = grpc.StatusCode.NOT_FOUND if exc.not_found else grpc.StatusCode.INVALID_ARGUMENT
            return SubmitResult(code.value[0], str(exc), exc.field)
        try:
            accepted = self.engine.submit(parsed)
        except QueueFull as exc:  # the gateway answers 429 (or tries another replica)
            return SubmitResult(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], str(exc))
        except MemoryReleased as exc:  # the gateway tries another replica, else answers 503
            return SubmitResult(grpc.StatusCode.FAILED_PRECONDITION.value[0], str(exc))
        if not accepted:
            return SubmitResult(grpc.StatusCode.ALREADY_EXISTS.value[0], f"rid: {request.rid!r} is already running",
                                "rid")
        return SubmitResult()

    async def submit(self, request: TokenizedRequest, context) -> Empty:
        result = self._accept(request)
        if result.code:
            await context.abort(STATUS_CODES[result.code], result.details,
                                trailing_metadata=((FIELD_METADATA, result.field),) if result.field else None)
        return EMPTY

    async def submit_batch(self, batch: SubmitBatchRequest, context) -> SubmitBatchReply:
        return SubmitBatchReply([self._accept(request) for request in batch.requests])

    async def abort(self, request: AbortRequest, context) -> Empty:
        if request.reason not in (FinishReason.UNSPECIFIED, FinishReason.ABORT, FinishReason.STOP_STRING,
                                  FinishReason.ERROR):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reason: must be ABORT, STOP_STRING or ERROR")
        if not self.engine.abort(request):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"rid: no running request {request.rid!r}")
        return EMPTY

    async def stream_steps(self, request: Empty, context) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for message in self.journal.replay():
            queue.put_nowait(message)
        self._subscribe(queue)
        try:
            # Tells the subscriber it is registered: every step from now on reaches it.
            await context.send_initial_metadata(())
            while (message := await queue.get()) is not None:
                if message is CUT:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "this subscriber fell behind for longer than "
                                        "--stall-timeout-s; resubscribe to be replayed what it missed")
                try:
                    await context.write(message)
                except Exception as exc:  # grpc's own ExecuteBatchError, which grpc does not export
                    # Its connection broke mid-write (a peer killed, a cut): the subscriber resubscribes and is
                    # replayed what it missed. Written here, rather than yielded, so that it is not grpc's traceback.
                    log.info("a step subscriber's stream broke while a step was written to it (%s)",
                             type(exc).__name__)
                    return
        finally:
            self._unsubscribe(queue)

    async def get_model_info(self, request: Empty, context) -> ModelInfo:
        adapters = self.engine.adapters
        return dataclasses.replace(self.model_info, weight_version=self.engine.weight_version,
                                   lora_adapters=adapters.loaded() if adapters is not None else [])

    async def get_stats(self, request: Empty, context) -> SchedulerStats:
        return self.engine.stats


def runner_arguments(config: SchedulerConfig, model_dir: Path) -> dict:
    """ModelRunner's arguments of the config (every tensor-parallel rank's the same, but for the device)."""
    return dict(model_dir=model_dir, device=rank_device(config.device, 0) if config.tp_size > 1 else config.device,
                dtype=config.dtype, context_length=config.context_length, max_running=config.max_running_requests,
                page_size=config.page_size, max_total_tokens=config.max_total_tokens,
                mem_fraction_static=config.mem_fraction_static, logits_chunk_rows=config.logits_chunk_rows,
                routed_experts=config.enable_return_routed_experts, attention_backend=config.attention_backend,
                cuda_graph_max_bs=config.cuda_graph_max_bs if config.enable_cuda_graph else 0,
                load_format=config.load_format, state_checkpoints=config.state_checkpoints,
                kv_cache_dtype=config.kv_cache_dtype, lora=config.lora_layers,
                linear_attention_backend=config.linear_attention_backend)


async def serve(config: SchedulerConfig) -> None:
    resolve_internal_secret(config, log)
    model_dir = resolve_model(config.model, config.cache_dir)
    runner: StepRunner
    ranks: Ranks | None = None
    if config.engine == "synthetic":
        runner = await asyncio.to_thread(SyntheticRunner, model_dir, config.context_length, config.max_top_logprobs,
                                         config.step_ms, config.page_size, config.max_total_tokens)
    else:
        arguments = runner_arguments(config, model_dir)
        if config.tp_size > 1:
            ranks = await asyncio.to_thread(Ranks.start, config.tp_size, arguments, config.log_level,
                                            config.weights_sync_timeout_s)
        runner = await asyncio.to_thread(ModelRunner, **arguments, ranks=ranks.group if ranks else None)
    if runner.device.type == "cpu":
        keep_big_blocks()  # each step's [batch, vocab] temporaries reuse the last step's memory
    # A Hub model by its id, any other by its directory's name, never its path (clients see it; the gateway's
    # --served-model-name wins).
    weights = (ServedWeights(runner.model, model_dir, runner.eos_token_ids, runner.sharding,
                             ranks.group if ranks else None) if isinstance(runner, ModelRunner) else None)
    grammars = Grammars(model_dir, runner.vocab_size, runner.eos_token_ids, cache_root(config.cache_dir))
    grammars.prepare()  # in the background: the first constrained request finds the vocabulary read
    service = SchedulerService(config, model_name(config.model, model_dir), runner, weights, grammars)
    server = create_server(config.max_message_mb, config.keepalive_s, internal_secret=config.internal_secret,
                           max_receive_mb=config.max_request_mb)
    SCHEDULER.add_to(server, service)
    health = add_health(server)  # no reflection: an internal API
    address = f"{config.host}:{config.port}"
    listen(server, address, config.tls.internal_server())
    service.engine.start()
    await server.start()
    await mark_serving(health, [SERVICE_NAME])
    log.info("scheduler serving on %s", address)

    await stop_requested()
    log.info("stopping")
    await asyncio.to_thread(service.engine.stop)  # its last steps are queued before the end of the streams
    if ranks is not None:
        await asyncio.to_thread(ranks.stop)
    service.end_streams()
    await server.stop(grace=1.0)
    if service.engine.failure is not None:
        raise SystemExit(1)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    try:
        config = parse_config(SchedulerConfig, argv, prog)
    except ValueError as exc:
        sys.exit(f"{prog or 'scheduler'}: {exc}")
    setup_logging(config.log_level, "scheduler")
    code: int | str | None = 0
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:  # Ctrl-C while the model was still loading
        log.info("interrupted")
    except SystemExit as exc:  # the engine failed
        code = exc.code
    except (ModelNotFound, UnsupportedModel, AdapterRefused, BackendUnavailable) as exc:  # a setup error, one line
        code = f"{prog or 'scheduler'}: {exc}"
    except Exception:  # a bug: said, then ended at once (a weight-group join may wait minutes for its trainer)
        log.exception("the scheduler failed")
        code = 1
    exit_now(code)


if __name__ == "__main__":
    main()
