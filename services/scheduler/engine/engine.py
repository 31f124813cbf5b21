"""Continuous batching: the engine thread.

Each iteration takes new requests, aborts and control commands from the inbox, ends the
aborted requests, lets the scheduling policy (scheduler.py) choose the step's rows (every
decoding request, prefill chunks, newly admitted requests) within the KV memory, runs one
step over them, and publishes a StepMessage with what ships (requests that stream every
step; the others every --output-interval tokens and when they end: output/pending.py),
the prompt logprobs of prefills that ended, and what started and finished.
Requests join and leave between steps. The thread blocks while there is no work.

Rollout control (RL trainers, control.py) goes through the same inbox, so that the engine
thread alone decides when it takes effect, always between two steps:
- pause: no step runs until continue; new requests wait. Mode abort first aborts every
  request; in_place keeps the running ones with their KV; retract drops their KV and puts them
  back at the head of the waiting list, to be prefilled again (prompt and output so far) on
  continue: under whatever weights are in place by then.
- a weight update waits until it is safe: while running requests finish on the old weights
  nothing is admitted (abort_all_requests: they are aborted instead); while paused it applies
  at once, and the requests kept in place continue on the new weights. The prefix cache is
  flushed with every update and weight_version change: no KV of the old weights serves a new
  request (nor do the requests kept in place put theirs in the cache).
- before weights or their version change, every running request's pending output ships,
  labelled with the version that produced it (StepMessage.weight_version): no entry straddles
  a change, so the gateway knows which weights made each token.

Torch runs in this thread only; gRPC handlers talk to it through the inbox.
"""

import concurrent.futures
import logging
import os
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from flatwire_wire.control import ControlReply, PauseMode
from flatwire_wire.logprobs import LogprobRows
from flatwire_wire.scheduler import AbortRequest, SchedulerStats
from flatwire_wire.steps import Finish, FinishReason, StepMessage

from services.scheduler.cache.pages import PagePool
from services.scheduler.cache.prefix_cache import PrefixCache
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine.control import (
    ABORTING_PAUSES,
    WEIGHTS_RELEASED,
    AbortAll,
    Continue,
    Control,
    FlushCache,
    Pause,
    ReleaseMemory,
    ResumeMemory,
    SetWeightVersion,
    UpdateWeights,
    stopped_reply,
)
from services.scheduler.engine.scheduler import Scheduler, SlotPool
from services.scheduler.model.occupation import MemoryOccupation
from services.scheduler.model.weights import WeightsRefused
from services.scheduler.output.pending import PendingStores
from services.scheduler.output.step_output import step_message
from services.scheduler.request import Request, RequestStatus
from services.scheduler.step import Batch, LaunchedStep, StepResult, StepRunner

log = logging.getLogger(__name__)

DEFAULT_WEIGHT_VERSION = "default"  # SGLang's, for the weights the server started with
GRAMMAR_READY = "grammar ready"  # an inbox item that only wakes the engine: a COMPILING request may get in line


class QueueFull(Exception):
    """Submit past the waiting list's bound (--max-waiting-requests): RESOURCE_EXHAUSTED."""


class MemoryReleased(Exception):
    """Submit while the model's memory is released (or its weights await an update): FAILED_PRECONDITION."""


@dataclass
class _Outgoing:
    """What the engine's next StepMessage carries besides the step's own output."""

    new: list[Request]  # to announce (started)
    finished: list[Finish] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)  # their pending output ships with their Finish
    due: list[Request] = field(default_factory=list)  # running, an entry's worth of output pending
    prompts: list[Request] = field(default_factory=list)  # their prompt logprob rows are whole: they ship

    def end(self, request: Request, finish: Finish) -> None:
        self.ended.append(request)
        self.finished.append(finish)


class Engine:
    def __init__(self, runner: StepRunner, config: SchedulerConfig, publish: Callable[[StepMessage], None],
                 wait_for_room: Callable[[], None] = lambda: None, behind: Callable[[], bool] = lambda: False,
                 occupation: MemoryOccupation | None = None):
        """`behind`: whether a subscriber has not taken the last message (output that ships every step then
        waits, up to its lane: output/pending.py); `occupation`: the model's memory, to release and resume (None:
        --engine synthetic has none)."""
        self.runner = runner
        self.occupation = occupation
        self.config = config
        self.publish = publish
        self.wait_for_room = wait_for_room  # back-pressure from the subscribers, between steps
        self.behind = behind
        self.pages = PagePool(runner.num_pages, runner.page_size)
        self.pending_rows = PendingStores()
        self.prefix_cache = PrefixCache(self.pages, enabled=not config.disable_radix_cache)
        self.scheduler = Scheduler(SlotPool(config.max_running_requests), self.pages, self.prefix_cache,
                                   config.prefill_budget, chunked=config.chunked_prefill_size > 0,
                                   compile_timeout_s=config.grammar_compile_timeout_s)
        self._step = 0
        self._finished_total = 0
        self._aborted_total = 0
        self._update_stats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()  # rids submitted and not yet finished
        self._live_lock = threading.Lock()
        # Requests held at once: the running ones, plus the waiting list's bound.
        self._live_limit = config.max_running_requests + config.waiting_limit
        self.weight_version = DEFAULT_WEIGHT_VERSION  # written by the engine thread only
        self._paused = False
        self._held_updates: list[UpdateWeights] = []  # waiting for the running requests to finish
        self._in_flight: tuple[Batch, LaunchedStep] | None = None  # launched, not landed (the overlap schedule)
        self._stopping = False
        self.failure: BaseException | None = None  # what ended the engine thread, if not a stop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

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
        if self.occupation is not None and (refusal := self.occupation.refusal) is not None:
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

    # -- engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
            self._fail_on_stop()
        except BaseException as exc:  # a bug: a scheduler without its engine must not look healthy
            log.critical("the engine thread failed; stopping the scheduler so that it is restarted", exc_info=True)
            self.failure = exc
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            self._refuse_pending_controls()

    def _refuse_pending_controls(self) -> None:
        """Answer the commands the engine will never apply (held updates, and those still in the inbox)."""
        pending: list[Control] = [*self._held_updates]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Control):
                pending.append(item)
        for command in pending:
            if not command.done.done():
                command.done.set_result(stopped_reply())
        self._held_updates.clear()

    def _loop(self) -> None:
        while not self._stopping:
            new, aborts, controls = self._drain_inbox(block=not self._has_work)
            if not self._stopping:
                self._iterate(new, aborts, controls)
                if self.scheduler.running and self._stepping:
                    self.wait_for_room()

    @property
    def _stepping(self) -> bool:
        """Steps run: generation is not paused, and the model's memory is in place (requests wait otherwise)."""
        return not self._paused and (self.occupation is None or self.occupation.refusal is None)

    @property
    def _has_work(self) -> bool:
        """A step to run, or a held weight update that may apply now."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        if self._held_updates and (self._paused or not running):
            return True
        if self._in_flight is not None:  # it lands in the next iteration
            return True
        return self._stepping and bool(running or (waiting and not self._held_updates))

    def _iterate(self, new: list[Request], aborts: list[AbortRequest], controls: list[Control]) -> None:
        """Aborts, control commands, admission, one model step, finishes; then one StepMessage if anything
        happened. With --enable-overlap-schedule a step lands (its tokens appended, its finishes found) in the
        iteration after its launch, before the next one is scheduled and launched, and its message is built and
        published while the device computes that next step; an abort or a control command lands it first."""
        out = _Outgoing(new)
        if self._in_flight is not None and (aborts or controls or self._held_updates):
            self._land(out)
        for uncompiled, error in self.scheduler.compiled():
            out.end(uncompiled, self._finish(uncompiled, FinishReason.ERROR,
                                             message=f"its grammar did not compile: {error}"))
        for abort in aborts:
            if (request := self.scheduler.find(abort.rid)) is not None:  # None: it finished before the abort came
                reason = abort.reason or FinishReason.ABORT
                message = {FinishReason.ABORT: "aborted", FinishReason.ERROR: abort.message}.get(reason, "")
                out.end(request, self._finish(request, reason, matched_stop=abort.matched_stop, message=message))
        for control in controls:
            if (reply := self._control(control, out)) is not None:  # None: a weight update, answered once applied
                control.done.set_result(reply)
        self._apply_held_updates(out)
        if self._in_flight is not None:
            self._land(out)
        # A held update waits for the running requests: none is admitted meanwhile.
        batch = self.scheduler.schedule(admit=not self._held_updates) if self._stepping else Batch([])
        if batch:
            self._launch(batch, out)
            if not self.config.enable_overlap_schedule:
                self._land(out)
        self._publish(out)

    def _publish(self, out: _Outgoing) -> None:
        # An ended request ships what it has left with its Finish (an aborted one too: the client gets
        # the tokens it had); the others when an entry's worth is pending.
        shipping = [r for r in out.ended if r.pending.count] + [r for r in out.due if r.pending.count]
        self._update_stats()  # before publishing: a subscriber never sees stats older than the step
        if out.new or shipping or out.finished or out.prompts:
            self.publish(step_message(self._step, out.new, shipping, out.prompts, out.finished,
                                      self.weight_version))
            for request in out.prompts:
                request.prompt_logprobs_sent, request.prompt_logprobs = True, None

    def _fail_on_stop(self) -> None:
        """Stopped (SIGTERM: a restart, a scale-down): every request it holds fails in one last step, with the
        output it has, so that its clients learn it now rather than after the gateway's hop timeout."""
        out = _Outgoing([])
        if self._in_flight is not None:
            self._land(out)
        failed = self._end_all(out, "the scheduler was stopped", FinishReason.ERROR)
        self._publish(out)
        if failed:
            log.warning("stopping: %d requests failed", failed)

    def _launch(self, batch: Batch, out: _Outgoing) -> None:
        try:
            self._in_flight = (batch, self.runner.launch(batch))
        except Exception as exc:  # keep serving: fail this step's requests, not the process
            self._fail_step(batch, exc, out)

    def _land(self, out: _Outgoing) -> None:
        """The launched step's results: its rows computed, its tokens appended, its finishes and what it has to
        ship into `out`."""
        assert self._in_flight is not None
        (batch, launched), self._in_flight = self._in_flight, None
        try:
            result = launched.result()
        except Exception as exc:
            self._fail_step(batch, exc, out)
            return
        self._step += 1
        self.scheduler.computed(batch)
        out.prompts += self._gather_prompt_rows(batch, result)
        self._advance(batch, result, out)

    def _fail_step(self, batch: Batch, exc: Exception, out: _Outgoing) -> None:
        log.error("step failed", exc_info=exc)
        self._step += 1
        for row in batch.rows:
            row.request.pending.release_lane()  # its Finish is an error: its pending output never ships
            out.finished.append(self._finish(row.request, FinishReason.ERROR, message=f"scheduler step failed: {exc}"))

    def _gather_prompt_rows(self, batch: Batch, result: StepResult) -> list[Request]:
        """Copy each row's prompt logprob rows into its request's; the requests whose prompt is whole now (the row
        reached its end), to ship them."""
        rows = iter(result.prompt)
        whole = []
        for row in batch.rows:
            request, positions = row.request, row.prompt_positions
            if not request.owes_prompt_logprobs:
                continue
            if request.prompt_logprobs is None:
                request.prompt_logprobs = LogprobRows.allocate(request.prompt_len - request.prompt_logprob_start,
                                                               request.top_logprobs_num,
                                                               len(request.token_ids_logprob))
            if len(positions):
                request.prompt_logprobs.put(positions.start - request.prompt_logprob_start, next(rows))
            if row.end >= request.prompt_len:
                whole.append(request)
        return whole

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

    # -- rollout control (engine thread) --------------------------------------------------------------

    def _control(self, control: Control, out: _Outgoing) -> ControlReply | None:
        match control:
            case Pause(mode=mode):
                aborted = self._end_all(out, "aborted: generation paused") if mode in ABORTING_PAUSES else 0
                if mode is PauseMode.RETRACT:
                    self.scheduler.retract_running()
                self._paused = True
                return self._reply("Generation paused.", aborted_requests=aborted)
            case Continue():
                self._paused = False
                return self._reply("Generation continued.")
            case AbortAll():
                return self._reply("Aborted every request.", aborted_requests=self._end_all(out, "aborted: all"))
            case UpdateWeights():
                if self.occupation is not None and "weights" in self.occupation.released:
                    return self._refused(WEIGHTS_RELEASED)
                if control.abort_all_requests:
                    control.aborted_requests = self._end_all(out, "aborted: weight update")
                self._held_updates.append(control)
                if self.scheduler.running and not self._paused:  # else it applies at once (_apply_held_updates)
                    log.info("weight update held until the %d running requests end (none is admitted meanwhile)",
                             len(self.scheduler.running))
                return None
            case SetWeightVersion():
                aborted = self._end_all(out, "aborted: weight version update") if control.abort_all_requests else 0
                self._set_version(control.version, out)
                return self._reply(f"Weight version updated to {control.version}.", aborted_requests=aborted)
            case FlushCache():
                if self.scheduler.requests:  # as SGLang: their KV may be cached yet
                    return self._refused(
                        f"Cache not flushed: {len(self.scheduler.requests)} requests are running or waiting.")
                self.prefix_cache.flush()
                return self._reply("Cache flushed.")
            case ReleaseMemory(tags=tags):
                if self.occupation is None:
                    return self._refused("Memory not released: --engine synthetic holds no model memory.")
                # Running requests hold KV in that memory; retracted ones hold none and wait for a continue (SGLang's
                # partial rollout: pause retract, release, update, resume, continue), as do the waiting ones while
                # paused.
                if self.scheduler.running or (self.scheduler.requests and not self._paused):
                    return self._refused(f"Memory not released: {len(self.scheduler.requests)} requests are "
                                         "running or waiting; pause_generation (abort or retract) first.")
                if "kv_cache" in tags:
                    self.prefix_cache.flush()  # its pages are about to hold nothing
                reply = self._reply(self.occupation.release(tags))
                self.runner.memory_moved()
                return reply
            case ResumeMemory(tags=tags):
                if self.occupation is None:
                    return self._refused("Nothing to resume: --engine synthetic holds no model memory.")
                try:
                    return self._reply(self.occupation.resume(tags))
                except WeightsRefused as exc:  # the checkpoint the weights came from no longer reads
                    return self._refused(f"Weights not resumed: {exc}")
                finally:
                    self.runner.memory_moved()
        raise TypeError(f"unknown control command {control!r}")

    def _reply(self, message: str, **fields) -> ControlReply:
        return ControlReply(success=True, message=message, weight_version=self.weight_version, **fields)

    def _refused(self, message: str) -> ControlReply:
        return ControlReply(success=False, message=message, weight_version=self.weight_version)

    def _end_all(self, out: _Outgoing, message: str, reason: FinishReason = FinishReason.ABORT) -> int:
        """End every running and waiting request (with the output it has); how many."""
        requests = self.scheduler.requests
        for request in requests:
            out.end(request, self._finish(request, reason, message=message))
        return len(requests)

    def _apply_held_updates(self, out: _Outgoing) -> None:
        """Swap in the held weight updates once no request runs on the old weights, or while paused."""
        if not self._held_updates or (self.scheduler.running and not self._paused):
            return
        self._ship(out)
        self.prefix_cache.flush()  # KV of the old weights serves no new request
        for update in self._held_updates:
            update.staged.install()
            self.runner.memory_moved()
            if self.occupation is not None:
                self.occupation.updated(update.staged)
            if update.weight_version is not None:
                self.weight_version = update.weight_version
            log.info("weights updated: %s; weight_version %s", update.staged.description, self.weight_version)
            update.done.set_result(self._reply(
                "Succeeded to update model weights.", num_paused_requests=len(self.scheduler.running),
                aborted_requests=update.aborted_requests))
        self._held_updates.clear()

    def _set_version(self, version: str, out: _Outgoing) -> None:
        if version != self.weight_version:
            self._ship(out)
            self.prefix_cache.flush()
            self.weight_version = version

    def _ship(self, out: _Outgoing) -> None:
        """Publish what `out` holds and every held request's pending output now, under the current version."""
        shipping = [r for r in [*out.ended, *self.scheduler.requests] if r.pending.count]  # retracted ones too
        if out.new or shipping or out.finished:
            self.publish(step_message(self._step, out.new, shipping, [], out.finished, self.weight_version))
        out.new, out.finished, out.ended, out.due = [], [], [], []

    def _advance(self, batch: Batch, result: StepResult, out: _Outgoing) -> None:
        """Append each sampled token (to its request's output and pending entry, its logprob row to the entry's
        rows); end the requests that are done, and mark those with an entry's worth pending due."""
        with_rows, sources = [], []  # the pending entries that take a logprob row, and its row in the step's
        max_context = self.runner.max_context
        behind = self.behind()
        for row, (sampled, token) in enumerate(zip(batch.sampling, result.next_ids.tolist())):
            request = sampled.request
            if request.max_new_tokens == 0:  # its prefill gave the prompt's logprobs; the token is not output
                out.end(request, self._finish(request, FinishReason.LENGTH))
                continue
            request.append_output(token)
            pending = request.pending
            pending.add(token)
            if request.return_logprob:
                with_rows.append(pending)
                sources.append(row)
            if token in request.stop_ids:
                out.end(request, self._finish(request, FinishReason.STOP_TOKEN, matched_token=token))
            elif len(request.output_ids) >= request.max_new_tokens or request.length >= max_context:
                out.end(request, self._finish(request, FinishReason.LENGTH))
            elif pending.due(behind) and request.status is RequestStatus.RUNNING:  # not retracted since it launched
                out.due.append(request)
        if with_rows:
            assert result.output is not None, "a step with a logprob request computes rows"
            self.pending_rows.put(with_rows, sources, result.output)

    def _finish(self, request: Request, reason: FinishReason, matched_token: int = 0, matched_stop: str = "",
                message: str = "") -> Finish:
        routed = self._routed_experts(request)  # before its pages go
        self.scheduler.finish(request)
        with self._live_lock:
            self._live.discard(request.rid)
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            self._aborted_total += 1
        else:
            self._finished_total += 1
        return Finish(rid=request.rid, reason=reason, matched_token=matched_token, matched_stop=matched_stop,
                      message=message, output_tokens=len(request.output_ids), cached_tokens=request.cached_tokens,
                      routed_experts=routed.astype("<i4").tobytes() if routed is not None else b"",
                      routed_experts_shape=list(routed.shape) if routed is not None else [])

    def _routed_experts(self, request: Request) -> np.ndarray | None:
        """What its tokens whose KV it holds were routed to, if it asked: every token but the last sampled."""
        routing = self.runner.expert_routing
        if not request.return_routed_experts or routing is None:
            return None
        return routing.of(request.page_table, request.computed, request.routed_experts_start_len)

    def _update_stats(self) -> None:
        # Swapped whole so that GetStats (another thread) reads a consistent snapshot.
        scheduler, pages = self.scheduler, self.pages
        held = pages.usable - pages.free - pages.evictable  # by requests (some also cached)
        self.stats = SchedulerStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + len(scheduler.compiling),
            kv_tokens_used=sum(r.computed for r in scheduler.running),
            steps=self._step,
            finished=self._finished_total,
            aborted=self._aborted_total,
            kv_pages_total=pages.usable,
            kv_pages_used=held,
            kv_pages_cached=self.prefix_cache.nodes,
            page_size=pages.page_size,
            prefill_tokens=scheduler.prefill_tokens,
            cached_prompt_tokens=scheduler.cached_prompt_tokens,
            retractions=scheduler.retractions,
        )
