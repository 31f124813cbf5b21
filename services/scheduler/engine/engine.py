"""Continuous batching: the engine thread and its step.

Each step (`Engine.step`) takes new requests, aborts and control commands from the inbox, ends the aborted
requests, applies the commands (rollout.py), lets the scheduling policy (policy.py) choose the step's rows within
the KV memory (every decoding request, prefill chunks, newly admitted requests), runs the model over them, hands
the results back to the policy (`Scheduler.update_from_output`) and publishes a StepMessage with what ships
(requests that stream every step; the others every --output-interval tokens and when they end: output/pending.py),
the prompt logprobs of prefills that ended, and what started and finished. Requests join and leave between steps.
The engine thread steps while there is work and blocks on the inbox while there is none; tests call `step` in
their own thread instead.

Torch runs in this thread only; gRPC handlers talk to it through the inbox.
"""

import concurrent.futures
import logging
import os
import queue
import signal
import threading
from collections.abc import Callable

from flatwire_wire.scheduler import AbortRequest, SchedulerStats
from flatwire_wire.steps import FinishReason, StepMessage

from services.scheduler.config import SchedulerConfig
from services.scheduler.engine.control import Control, LoadAdapter, UnloadAdapter, stopped_reply
from services.scheduler.engine.lora_registry import LoraRegistry, of_adapter
from services.scheduler.engine.policy import Scheduler, SlotPool
from services.scheduler.engine.rollout import RolloutControl
from services.scheduler.kv.manager import KVManager
from services.scheduler.kv.states import StateSlots
from services.scheduler.model.lora_adapter import AdapterRefused, LoraAdapter, read_adapter_dir
from services.scheduler.model.occupation import MemoryOccupation
from services.scheduler.output.step_output import Outgoing, step_message
from services.scheduler.request import Request
from services.scheduler.step import Batch, LaunchedStep, StepRunner

log = logging.getLogger(__name__)

GRAMMAR_READY = "grammar ready"  # an inbox item that only wakes the engine: a COMPILING request may get in line


class QueueFull(Exception):
    """Submit past the waiting list's bound (--max-waiting-requests): RESOURCE_EXHAUSTED."""


class MemoryReleased(Exception):
    """Submit while the model's memory is released (or its weights await an update): FAILED_PRECONDITION."""


class Engine:
    def __init__(self, runner: StepRunner, config: SchedulerConfig, publish: Callable[[StepMessage], None],
                 wait_for_room: Callable[[], None] = lambda: None, behind: Callable[[], bool] = lambda: False,
                 occupation: MemoryOccupation | None = None):
        """`behind`: whether a subscriber has not taken the last message (output that ships every step then
        waits, up to its lane: output/pending.py); `occupation`: the model's memory, to release and resume (None:
        --engine synthetic has none)."""
        self.runner = runner
        self.config = config
        self.publish = publish
        self.wait_for_room = wait_for_room  # back-pressure from the subscribers, between steps
        self.behind = behind
        self.kv = KVManager(runner.num_pages, runner.page_size, runner.kv_windows,
                            prefix_cache=not config.disable_radix_cache,
                            states=StateSlots(*runner.state_slots) if runner.state_slots else None)
        self.scheduler = Scheduler(self.kv, SlotPool(config.max_running_requests), config.prefill_budget,
                                   chunked=config.chunked_prefill_size > 0, max_context=runner.max_context,
                                   compile_timeout_s=config.grammar_compile_timeout_s,
                                   routed_experts=self._routed_experts,
                                   max_adapters=config.max_loras_per_batch if config.enable_lora else 0)
        self.adapters = self._adapters() if config.enable_lora else None
        self.rollout = RolloutControl(self.scheduler, runner, occupation, ship=self._ship, changed=self._update_stats)
        self._step = 0
        self._update_stats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()  # rids submitted and not yet finished
        self._live_lock = threading.Lock()
        # Requests held at once: the running ones, plus the waiting list's bound.
        self._live_limit = config.max_running_requests + config.waiting_limit
        self._in_flight: tuple[Batch, LaunchedStep] | None = None  # launched, not landed (the overlap schedule)
        self._stopping = False
        self.failure: BaseException | None = None  # what ended the engine thread, if not a stop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def _adapters(self) -> LoraRegistry:
        """The LoRA adapters, those of --lora-paths loaded (a refused one stops the start: AdapterRefused)."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError("--enable-lora: this engine has no model to adapt")
        adapters = LoraRegistry(self.config.loaded_loras, forget=self._forget_adapter)
        for name, path in self.config.lora_modules:
            reply = adapters.load(read_adapter_dir(name, path, lora.features, lora.max_rank, lora.dtype))
            if not reply.success:
                raise AdapterRefused(f"--lora-paths: {reply.message}")
        return adapters

    def _forget_adapter(self, adapter: LoraAdapter) -> None:
        """A retired adapter no request holds: its device slot, and the KV cached under it, go."""
        assert self.runner.lora is not None
        self.runner.lora.forget(adapter)
        self.kv.forget(lambda namespace: of_adapter(namespace, adapter))

    @property
    def weight_version(self) -> str:
        return self.rollout.weight_version

    # -- called from other threads --------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join()

    def submit(self, request: Request) -> bool:
        """Queue a validated request; False when its rid is already live; QueueFull past the bound; MemoryReleased
        while the model cannot run (one that slips in as its memory goes waits for its return)."""
        occupation = self.rollout.occupation
        if occupation is not None and (refusal := occupation.refusal) is not None:
            raise MemoryReleased(refusal)
        with self._live_lock:
            if request.rid in self._live:
                return False
            if len(self._live) >= self._live_limit:
                raise QueueFull(f"this scheduler is full: {len(self._live)} requests are running or waiting "
                                f"({self.config.max_running_requests} run at once, at most {self.config.waiting_limit} "
                                f"wait: max_waiting_requests); retry later")
            self._live.add(request.rid)
        self._inbox.put(request)
        if request.compiling is not None:  # its grammar compiles meanwhile: wake the engine when it is ready
            request.compiling.add_done_callback(lambda _: self._inbox.put(GRAMMAR_READY))
        return True

    def abort(self, abort: AbortRequest) -> bool:
        """Ask the engine to drop a request at its next step; False when the rid is unknown."""
        with self._live_lock:
            if abort.rid not in self._live:
                return False
        self._inbox.put(abort)
        return True

    def control(self, command: Control) -> concurrent.futures.Future:
        """Queue a rollout-control command; the future gets its ControlReply once the engine thread applied it,
        or a refusal when the engine stops first. The caller cannot cancel it: the engine alone settles it."""
        command.done.set_running_or_notify_cancel()
        if self._stopping or self.failure is not None:
            command.done.set_result(stopped_reply())
        else:
            self._inbox.put(command)
        return command.done

    # -- the step (the engine thread, or a test's) -----------------------------------------------

    def step(self, block: bool = False) -> None:
        """One step: what the inbox holds (`block`: waiting for something, or a compiling request's deadline,
        when it holds nothing), then the step itself (see `_iterate`)."""
        self._iterate(*self._drain_inbox(block))

    @property
    def has_work(self) -> bool:
        """A step to run, or a held weight update or wait-mode pause that may go on now."""
        rollout, scheduler = self.rollout, self.scheduler
        if rollout.due or self._in_flight is not None:  # a launched step lands in the next one
            return True
        return rollout.stepping and bool(scheduler.running or (scheduler.waiting and rollout.admitting))

    def _run(self) -> None:
        try:
            while not self._stopping:
                self.step(block=not self.has_work)
                if self.scheduler.running and self.rollout.stepping:
                    self.wait_for_room()
            self._fail_on_stop()
        except BaseException as exc:  # a bug: a scheduler without its engine must not look healthy
            log.critical("the engine thread failed; stopping the scheduler so that it is restarted", exc_info=True)
            self.failure = exc
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            self._refuse_pending_controls()

    def _iterate(self, new: list[Request], aborts: list[AbortRequest], controls: list[Control]) -> None:
        """Aborts, control commands, admission, one model step, finishes; then one StepMessage if anything
        happened. With --enable-overlap-schedule a step lands (its tokens appended, its finishes found) in the
        step after its launch, before the next one is scheduled and launched, and its message is built and
        published while the device computes that next step; an abort or a control command lands it first."""
        if self._stopping:
            return
        out = Outgoing(new)
        if self._in_flight is not None and (aborts or controls or self.rollout.holding):
            self._land(out)
        self.scheduler.compiled(out)
        for abort in aborts:
            if (request := self.scheduler.find(abort.rid)) is not None:  # None: it finished before the abort came
                reason = abort.reason or FinishReason.ABORT
                message = {FinishReason.ABORT: "aborted", FinishReason.ERROR: abort.message}.get(reason, "")
                out.end(request, self.scheduler.finish(request, reason, matched_stop=abort.matched_stop,
                                                       message=message))
        for control in controls:
            if isinstance(control, LoadAdapter | UnloadAdapter) and self.adapters is not None:
                self.adapters.apply(control)  # between two steps: no running request waits for it
            else:
                self.rollout.apply(control, out)
        self.rollout.settle(out)
        if self._in_flight is not None:
            self._land(out)
        # A held update waits for the running requests: none is admitted meanwhile.
        batch = self.scheduler.schedule(admit=self.rollout.admitting) if self.rollout.stepping else Batch([])
        if batch and self._launch(batch, out) and not self.config.enable_overlap_schedule:
            self._land(out)
        if self.adapters is not None:
            self.adapters.collect()
        self._publish(out)

    def _launch(self, batch: Batch, out: Outgoing) -> bool:
        """Whether the step launched (one that raised failed its requests)."""
        try:
            self._in_flight = (batch, self.runner.launch(batch))
            return True
        except Exception as exc:  # keep serving: fail this step's requests, not the process
            self._fail_step(batch, exc, out)
            return False

    def _land(self, out: Outgoing) -> None:
        """The launched step's results, handed to the policy (its finishes and what it has to ship into `out`)."""
        assert self._in_flight is not None
        (batch, launched), self._in_flight = self._in_flight, None
        try:
            result = launched.result()
        except Exception as exc:
            self._fail_step(batch, exc, out)
            return
        self._step += 1
        self.scheduler.update_from_output(batch, result, out, behind=self.behind())

    def _fail_step(self, batch: Batch, exc: Exception, out: Outgoing) -> None:
        """A step that raised fails its requests (named with the cause, logged once); the engine serves on."""
        log.error("a step of %d requests failed; they end with its error", len(batch.rows), exc_info=exc)
        self._step += 1
        self.scheduler.fail(batch, f"{type(exc).__name__}: {exc}", out)

    def _drain_inbox(self, block: bool) -> tuple[list[Request], list[AbortRequest], list[Control]]:
        new: list[Request] = []
        aborts: list[AbortRequest] = []
        controls: list[Control] = []
        item = None
        if block:  # until something comes, or a compiling request's deadline passes
            try:
                item = self._inbox.get(timeout=self.scheduler.compile_wait())
            except queue.Empty:
                return new, aborts, controls
        while True:
            if isinstance(item, Request):
                new.append(item)
                self.scheduler.add(item)
            elif isinstance(item, AbortRequest):
                aborts.append(item)
            elif isinstance(item, Control):
                controls.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return new, aborts, controls

    # -- publishing --------------------------------------------------------------------

    def _publish(self, out: Outgoing) -> None:
        # An ended request ships what it has left with its Finish (an aborted one too: the client gets
        # the tokens it had); the others when an entry's worth is pending.
        shipping = [r for r in out.ended if r.pending.count] + [r for r in out.due if r.pending.count]
        self._update_stats()  # before publishing: a subscriber never sees stats older than the step
        if out.new or shipping or out.finished or out.prompts:
            self._send(step_message(self._step, out.new, shipping, out.prompts, out.finished, self.weight_version))
            for request in out.prompts:
                request.prompt_logprobs_sent, request.prompt_logprobs = True, None

    def _ship(self, out: Outgoing) -> None:
        """Publish what `out` holds and every held request's pending output now, under the current version."""
        shipping = [r for r in [*out.ended, *self.scheduler.requests] if r.pending.count]  # retracted ones too
        if out.new or shipping or out.finished:
            self._send(step_message(self._step, out.new, shipping, [], out.finished, self.weight_version))
        out.new, out.finished, out.ended, out.due = [], [], [], []

    def _send(self, message: StepMessage) -> None:
        """Publish; the rids of the requests it finishes may be submitted again."""
        if message.finished:
            with self._live_lock:
                self._live.difference_update(finish.rid for finish in message.finished)
        self.publish(message)

    def _fail_on_stop(self) -> None:
        """Stopped (SIGTERM: a restart, a scale-down): every request it holds fails in one last step, with the
        output it has, so that its clients learn it now rather than after the gateway's hop timeout."""
        out = Outgoing()
        if self._in_flight is not None:
            self._land(out)
        failed = self.scheduler.end_all(out, "the scheduler was stopped", FinishReason.ERROR)
        self._publish(out)
        if failed:
            log.warning("stopping: %d requests failed", failed)

    def _refuse_pending_controls(self) -> None:
        """Answer the commands the engine will never apply (held updates, and those still in the inbox)."""
        self.rollout.refuse_held()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Control) and not item.done.done():
                item.done.set_result(stopped_reply())

    def _routed_experts(self, request: Request):
        """What its tokens whose KV it holds were routed to: every token but the last sampled."""
        routing = self.runner.expert_routing
        if routing is None:
            return None
        return routing.of(request.kv.tables[routing.group], request.kv.computed, request.routed_experts_start_len)

    def _update_stats(self) -> None:
        # Swapped whole so that GetStats (another thread) reads a consistent snapshot.
        scheduler, kv = self.scheduler, self.kv.stats()
        self.stats = SchedulerStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + len(scheduler.compiling),
            waiting_tokens=sum(r.length for r in scheduler.waiting) + sum(r.length for r in scheduler.compiling),
            kv_tokens_used=sum(r.kv.computed for r in scheduler.running),
            steps=self._step,
            finished=scheduler.finished_total,
            aborted=scheduler.aborted_total,
            kv_pages_total=kv.pages_total,
            kv_pages_used=kv.pages_held,
            kv_pages_cached=kv.pages_cached,
            page_size=kv.page_size,
            prefill_tokens=scheduler.prefill_tokens,
            cached_prompt_tokens=scheduler.cached_prompt_tokens,
            retractions=scheduler.retractions,
            paused=self.rollout.pausing,
            memory_released=sorted(occupation.released) if (occupation := self.rollout.occupation) else [],
        )
