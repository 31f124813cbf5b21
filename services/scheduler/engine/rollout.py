"""Rollout control (RL trainers): the state machine of pause, continue, abort_all, weight updates, weight_version
changes, cache flushes and memory release, applied by the engine thread between two steps (the commands,
control.py, come through its inbox with new requests and aborts).

- pause: no step runs until continue; new requests wait. Mode abort first aborts every request; in_place keeps
  the running ones with their KV; retract drops their KV and puts them back at the head of the waiting list, to
  be prefilled again (prompt and output so far) on continue: under whatever weights are in place by then. Mode
  wait (vLLM's) admits nothing while the running requests finish, and pauses (and answers) once they have.
- a weight update waits until it is safe: while running requests finish on the old weights nothing is admitted
  (abort_all_requests: they are aborted instead); while paused it applies at once, and the requests kept in place
  continue on the new weights. The prefix cache is flushed with every update and weight_version change: no KV of
  the old weights serves a new request (nor do the requests kept in place put theirs in the cache).
- before weights or their version change, every held request's pending output ships, labelled with the version
  that produced it (StepMessage.weight_version): no entry straddles a change, so the gateway knows which weights
  made each token.
- flush_cache is refused while requests hold KV or wait, but for those a pause retracted (miles' SGLang).
- weights_checker (model/weight_checks.py): snapshot, reset to random values (no request held), compare.
"""

import logging
from collections.abc import Callable

from flatwire_wire.control import ControlReply, PauseMode, WeightsRelease

from services.scheduler.engine.control import (
    ABORTING_PAUSES,
    WEIGHTS_RELEASED,
    AbortAll,
    CheckWeights,
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
from services.scheduler.engine.policy import Scheduler
from services.scheduler.model.occupation import MemoryOccupation
from services.scheduler.model.weight_checks import WeightChecker
from services.scheduler.model.weights import WeightsRefused
from services.scheduler.output.step_output import Outgoing
from services.scheduler.request import RequestStatus
from services.scheduler.step import StepRunner

log = logging.getLogger(__name__)

DEFAULT_WEIGHT_VERSION = "default"  # SGLang's, for the weights the server started with


class RolloutControl:
    """Engine thread only."""

    def __init__(self, scheduler: Scheduler, runner: StepRunner, occupation: MemoryOccupation | None,
                 ship: Callable[[Outgoing], None], changed: Callable[[], None] = lambda: None):
        """`occupation`: the model's memory, to release and resume (None: --engine synthetic has none); `ship`:
        publishes what an Outgoing holds and every held request's pending output, now; `changed`: called before a
        reply is given (the engine's stats then show the state the reply reports)."""
        self.scheduler = scheduler
        self.runner = runner
        self.occupation = occupation
        self.checker = WeightChecker(occupation.weights) if occupation is not None else None  # weights_checker
        self._ship = ship
        self._changed = changed
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.paused = False
        self.held_updates: list[UpdateWeights] = []  # waiting for the running requests to finish
        self.draining: list[Pause] = []  # wait-mode pauses, until the running requests finish

    @property
    def stepping(self) -> bool:
        """Steps run: generation is not paused, and the model's memory is in place (requests wait otherwise)."""
        return not self.paused and (self.occupation is None or self.occupation.refusal is None)

    @property
    def admitting(self) -> bool:
        """Waiting requests may start: no weight update nor wait-mode pause waits for the running ones to end."""
        return not self.held_updates and not self.draining

    @property
    def pausing(self) -> bool:
        """Paused, or a wait-mode pause draining the running requests (vLLM's is_paused either way)."""
        return self.paused or bool(self.draining)

    @property
    def holding(self) -> bool:
        """A weight update or a wait-mode pause waits for the running requests."""
        return bool(self.held_updates or self.draining)

    @property
    def due(self) -> bool:
        """A held weight update may apply, or a wait-mode pause complete, now (settle does it)."""
        idle = not self.scheduler.running
        return (bool(self.held_updates) and (self.paused or idle)) or (bool(self.draining) and idle)

    def apply(self, command: Control, out: Outgoing) -> None:
        """Apply a command; its future gets the reply (a weight update's once it is swapped in, a wait-mode pause's
        once the running requests have finished)."""
        if (reply := self._apply(command, out)) is not None:
            self._answer(command, reply)

    def _answer(self, command: Control, reply: ControlReply) -> None:
        self._changed()
        command.done.set_result(reply)

    def _apply(self, command: Control, out: Outgoing) -> ControlReply | None:
        scheduler = self.scheduler
        match command:
            case Pause(mode=PauseMode.WAIT) if scheduler.running and not self.paused:
                self.draining.append(command)
                log.info("pause (wait) held until the %d running requests end (none is admitted meanwhile)",
                         len(scheduler.running))
                return None
            case Pause(mode=mode):
                aborted = scheduler.end_all(out, "aborted: generation paused") if mode in ABORTING_PAUSES else 0
                if mode is PauseMode.RETRACT:
                    scheduler.retract_running()
                self.paused = True
                self._settle_drains("Generation paused.")  # a pause of another mode ends their wait
                return self._reply("Generation paused.", aborted_requests=aborted)
            case Continue():
                self.paused = False
                for pause in self.draining:
                    self._answer(pause, self._refused(
                        "Generation not paused: continued before the running requests finished."))
                self.draining.clear()
                return self._reply("Generation continued.")
            case AbortAll():
                return self._reply("Aborted every request.", aborted_requests=scheduler.end_all(out, "aborted: all"))
            case UpdateWeights():
                if self.occupation is not None and "weights" in self.occupation.released:
                    return self._refused(WEIGHTS_RELEASED)
                if command.abort_all_requests:
                    command.aborted_requests = scheduler.end_all(out, "aborted: weight update")
                self.held_updates.append(command)
                if scheduler.running and not self.paused:  # else it applies at once (settle)
                    log.info("weight update held until the %d running requests end (none is admitted meanwhile)",
                             len(scheduler.running))
                return None
            case SetWeightVersion():
                aborted = scheduler.end_all(out, "aborted: weight version update") if command.abort_all_requests else 0
                self._set_version(command.version, out)
                return self._reply(f"Weight version updated to {command.version}.", aborted_requests=aborted)
            case FlushCache(reset_running_requests=None):
                # As SGLang, refused while requests run or wait (their KV may be cached yet), but for requests a pause
                # retracted (miles' SGLang: pause in retract mode, then flush): they hold no KV, and prefill again.
                holding = [request for request in scheduler.requests
                           if not (self.paused and request.status is RequestStatus.RETRACTED)]
                if holding:
                    return self._refused(f"Cache not flushed: {len(holding)} requests are running or waiting"
                                         + (" (those a pause retracted do not count)." if self.paused else "."))
                scheduler.kv.flush()
                return self._reply("Cache flushed.")
            case FlushCache(reset_running_requests=bool(reset_running)):
                return self._reset_prefix_cache(reset_running)
            case CheckWeights():
                return self._check_weights(command)
            case ReleaseMemory(tags=tags, weights=weights):
                return self._release(tags, weights)
            case ResumeMemory(tags=tags):
                return self._resume(tags)
        raise TypeError(f"unknown control command {command!r}")

    def _check_weights(self, command: CheckWeights) -> ControlReply:
        if self.occupation is None or self.checker is None:
            return self._refused("Weights not checked: --engine synthetic has no weights.")
        if "weights" in self.occupation.released:
            return self._refused("Weights not checked: they are released; resume_memory_occupation first.")
        if self.occupation.weights.ranks is not None:
            return self._refused("Weights not checked: weights_checker sees rank 0's share alone, and --tp-size "
                                 "cuts the model over several ranks.")
        checker = self.checker
        try:
            match command.action:
                case "snapshot":
                    return self._reply(checker.snapshot())
                case "compare":
                    return self._reply(checker.compare(command.skip))
                case "reset_tensors":
                    if self.scheduler.requests:
                        return self._refused(f"Weights not reset: {len(self.scheduler.requests)} requests are "
                                             "running or waiting; pause_generation (abort) first.")
                    message = checker.reset_tensors()
                    self.scheduler.kv.flush()  # no KV of the old weights serves a request
                    self.occupation.randomized()
                    return self._reply(message)
        except WeightsRefused as exc:
            return self._refused(str(exc))
        raise ValueError(f"unknown weights_checker action {command.action!r}")  # the RPC checked it

    def _reset_prefix_cache(self, reset_running: bool) -> ControlReply:
        """vLLM's reset_prefix_cache: the running requests hold KV in use, so it is refused while they run unless
        they are retracted first (they are prefilled again when they next run); waiting requests hold none."""
        scheduler = self.scheduler
        if scheduler.running and not reset_running:
            return self._refused(f"Prefix cache not reset: {len(scheduler.running)} requests are running "
                                 "(reset_running_requests retracts them first).")
        retracted = len(scheduler.running)
        scheduler.retract_running()
        scheduler.kv.flush()
        return self._reply("Prefix cache reset." + (f" {retracted} running requests retracted." if retracted else ""))

    def _release(self, tags: list[str], weights: WeightsRelease) -> ControlReply:
        if self.occupation is None:
            return self._refused("Memory not released: --engine synthetic holds no model memory.")
        scheduler = self.scheduler
        # Running requests hold KV in that memory; retracted ones hold none and wait for a continue (SGLang's partial
        # rollout: pause retract, release, update, resume, continue), as do the waiting ones while paused.
        if scheduler.running or (scheduler.requests and not self.paused):
            return self._refused(f"Memory not released: {len(scheduler.requests)} requests are running or waiting; "
                                 "pause_generation (abort or retract) first.")
        if "kv_cache" in tags:
            scheduler.kv.flush()  # its pages are about to hold nothing
        reply = self._reply(self.occupation.release(tags, weights))
        self.runner.memory_moved()
        return reply

    def _resume(self, tags: list[str]) -> ControlReply:
        if self.occupation is None:
            return self._refused("Nothing to resume: --engine synthetic holds no model memory.")
        try:
            return self._reply(self.occupation.resume(tags))
        except WeightsRefused as exc:  # the checkpoint the weights came from no longer reads
            return self._refused(f"Weights not resumed: {exc}")
        finally:
            self.runner.memory_moved()

    def settle(self, out: Outgoing) -> None:
        """What waited for the running requests and may go on now: wait-mode pauses, held weight updates."""
        if self.draining and not self.scheduler.running:
            self.paused = True
            self._settle_drains("Generation paused: the running requests finished.")
        if self.held_updates and (self.paused or not self.scheduler.running):
            self._apply_held_updates(out)

    def _settle_drains(self, message: str) -> None:
        for pause in self.draining:
            self._answer(pause, self._reply(message))
        self.draining.clear()

    def _apply_held_updates(self, out: Outgoing) -> None:
        """Swap in the held weight updates (no request runs on the old weights, or paused)."""
        self._ship(out)
        self.scheduler.kv.flush()  # KV of the old weights serves no new request
        for update in self.held_updates:
            update.staged.install()
            self.runner.memory_moved()
            if self.occupation is not None:
                self.occupation.updated(update.staged)
            if update.weight_version is not None:
                self.weight_version = update.weight_version
            log.info("weights updated: %s; weight_version %s", update.staged.description, self.weight_version)
            self._answer(update, self._reply(
                "Succeeded to update model weights.", num_paused_requests=len(self.scheduler.running),
                aborted_requests=update.aborted_requests))
        self.held_updates.clear()

    def refuse_held(self) -> None:
        """The engine stops: the held updates and wait-mode pauses will never apply."""
        for command in [*self.held_updates, *self.draining]:
            if not command.done.done():
                command.done.set_result(stopped_reply())
        self.held_updates.clear()
        self.draining.clear()

    def _set_version(self, version: str, out: Outgoing) -> None:
        if version != self.weight_version:
            self._ship(out)
            self.scheduler.kv.flush()
            self.weight_version = version

    def _reply(self, message: str, **fields) -> ControlReply:
        return ControlReply(success=True, message=message, weight_version=self.weight_version, **fields)

    def _refused(self, message: str) -> ControlReply:
        return ControlReply(success=False, message=message, weight_version=self.weight_version)
