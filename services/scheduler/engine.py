"""Continuous batching: the engine thread and its scheduling policy.

Each iteration takes new requests and aborts from the inbox, frees aborted
requests' slots, admits waiting requests (first come, first served) while a KV
slot is free and the step's prefill budget allows (a prompt longer than the whole
budget is admitted alone, so nothing starves), runs one step over every running
request plus the admitted prompts, and publishes a StepOutput with what ships
(requests that stream every step; the others every --output-interval tokens and
when they end: pending.py) and what started and finished. Requests join and
leave between steps; a new request never waits for running ones to finish, only
for a free slot. The thread blocks while there is no work.

Torch runs in this thread only; gRPC handlers talk to it through the inbox.
"""

import logging
import os
import queue
import signal
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from services.common.pb import arrays_pb2, scheduler_pb2
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_cache import SlotPool
from services.scheduler.output import step_output
from services.scheduler.request import Request

log = logging.getLogger(__name__)

Reason = arrays_pb2.FinishReason


class QueueFull(Exception):
    """Submit past the waiting list's bound (--max-waiting-requests): RESOURCE_EXHAUSTED."""


class StepRunner(Protocol):
    """What the engine runs steps on: the model (model_runner.ModelRunner) or a stand-in (synthetic.py)."""

    max_context: int
    vocab_size: int
    eos_token_ids: list[int]
    device: torch.device
    dtype: torch.dtype

    @property
    def cache(self) -> SlotPool:  # read-only here, so that the model's SlotKVCache qualifies
        ...

    def step(self, decode: list[Request], prefill: list[Request]) -> dict[str, np.ndarray]:
        """Host arrays of one step over `decode` then `prefill` rows (keys: batch_step.run_step)."""
        ...


class Engine:
    def __init__(self, runner: StepRunner, config: SchedulerConfig,
                 publish: Callable[[scheduler_pb2.StepOutput], None],
                 wait_for_room: Callable[[], None] = lambda: None):
        self.runner = runner
        self.config = config
        self.publish = publish
        self.wait_for_room = wait_for_room  # back-pressure from the subscribers, between steps
        self.stats = scheduler_pb2.SchedulerStats(kv_slots_total=runner.cache.num_slots)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()  # rids submitted and not yet finished
        self._live_lock = threading.Lock()
        # Requests held at once: one per KV slot running, plus the waiting list's bound.
        self._live_limit = runner.cache.num_slots + config.waiting_limit
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._step = 0
        self._finished_total = 0
        self._aborted_total = 0
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
        """Queue a validated request; False when its rid is already live; QueueFull past the bound."""
        with self._live_lock:
            if request.rid in self._live:
                return False
            if len(self._live) >= self._live_limit:
                raise QueueFull(f"this scheduler is full: {len(self._live)} requests are running or waiting "
                                f"({self.runner.cache.num_slots} run at once, at most {self.config.waiting_limit} "
                                f"wait: max_waiting_requests); retry later")
            self._live.add(request.rid)
        self._inbox.put(request)
        return True

    def abort(self, rid: str, reason: arrays_pb2.FinishReason, matched_stop: str) -> bool:
        """Ask the engine to drop a request at its next step; False when the rid is unknown."""
        with self._live_lock:
            if rid not in self._live:
                return False
        self._inbox.put(scheduler_pb2.AbortRequest(rid=rid, reason=reason, matched_stop=matched_stop))
        return True

    # -- engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug: a scheduler without its engine must not look healthy
            log.critical("the engine thread failed; stopping the scheduler so that it is restarted", exc_info=True)
            self.failure = exc
            os.kill(os.getpid(), signal.SIGTERM)

    def _loop(self) -> None:
        while not self._stopping:
            new, aborts = self._drain_inbox(block=not (self._waiting or self._running))
            if not self._stopping:
                self._iterate(new, aborts)
                if self._running:
                    self.wait_for_room()

    def _iterate(self, new: list[Request], aborts: list[scheduler_pb2.AbortRequest]) -> None:
        """Aborts, admission, one model step, finishes; then one StepOutput if anything happened."""
        finished, ended = [], []
        for abort in aborts:
            if (request := self._request_of(abort)) is not None:  # None: it finished before the abort arrived
                ended.append(request)
                finished.append(self._finish(request, abort.reason or Reason.FINISH_REASON_ABORT,
                                             matched_stop=abort.matched_stop,
                                             message="aborted" if abort.reason in (0, Reason.FINISH_REASON_ABORT)
                                             else ""))
        decode = list(self._running)
        prefill = self._admit()
        rows, host = decode + prefill, {}
        if rows:
            try:
                host = self.runner.step(decode, prefill)
            except Exception as exc:  # keep serving: fail this step's requests, not the process
                log.exception("step failed")
                finished += [self._finish(r, Reason.FINISH_REASON_ERROR, message=f"scheduler step failed: {exc}")
                             for r in rows]
                rows, prefill = [], []
            else:
                done = self._advance(rows, host)
                finished += [finish for _, finish in done]
                ended += [request for request, _ in done]
        # An ended request ships what it has left with its Finish (an aborted one too: the client gets
        # the tokens it had); the others when an entry's worth is pending.
        shipping = [r for r in ended if r.pending.count] + [r for r in rows if r.slot >= 0 and r.pending.due]
        prompt_requests = [r for r in prefill if r.wants_prompt_logprobs]
        if rows:
            self._step += 1
        self._update_stats()  # before publishing: a subscriber never sees stats older than the step
        if new or shipping or finished or prompt_requests:
            self.publish(step_output(self._step, new, shipping, host, prompt_requests, finished))

    def _drain_inbox(self, block: bool) -> tuple[list[Request], list[scheduler_pb2.AbortRequest]]:
        new, aborts = [], []
        item = self._inbox.get() if block else None
        while True:
            if isinstance(item, Request):
                new.append(item)
                self._waiting.append(item)
            elif isinstance(item, scheduler_pb2.AbortRequest):
                aborts.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return new, aborts

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        budget = self.config.max_tokens_per_step
        while self._waiting and self.runner.cache.free_slots:
            request = self._waiting[0]
            if admitted and request.prompt_len > budget:
                break
            self._waiting.popleft()
            request.slot = self.runner.cache.allocate()
            budget -= request.prompt_len
            admitted.append(request)
        self._running += admitted
        return admitted

    def _advance(self, rows: list[Request], host: dict) -> list[tuple[Request, scheduler_pb2.Finish]]:
        """Append each row's new token (to its output and its pending entry); finish the requests that are done."""
        done = []
        for row, (request, token) in enumerate(zip(rows, host["next_ids"].tolist())):
            request.output_ids.append(token)
            request.pending.add(token, host, row)
            if token in request.stop_ids:
                done.append((request, self._finish(request, Reason.FINISH_REASON_STOP_TOKEN, matched_token=token)))
            elif len(request.output_ids) >= request.max_new_tokens or request.length >= self.runner.max_context:
                done.append((request, self._finish(request, Reason.FINISH_REASON_LENGTH)))
        return done

    def _request_of(self, abort: scheduler_pb2.AbortRequest) -> Request | None:
        """The running or waiting request an abort is for."""
        return next((r for r in [*self._running, *self._waiting] if r.rid == abort.rid), None)

    def _finish(self, request: Request, reason: arrays_pb2.FinishReason, matched_token: int = 0, matched_stop: str = "",
                message: str = "") -> scheduler_pb2.Finish:
        if request.slot >= 0:
            self.runner.cache.release(request.slot)
            request.slot = -1
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        with self._live_lock:
            self._live.discard(request.rid)
        if reason in (Reason.FINISH_REASON_ABORT, Reason.FINISH_REASON_ERROR):
            self._aborted_total += 1
        else:
            self._finished_total += 1
        return scheduler_pb2.Finish(rid=request.rid, reason=reason, matched_token=matched_token,
                                    matched_stop=matched_stop, message=message,
                                    output_tokens=len(request.output_ids))

    def _update_stats(self) -> None:
        # Swapped whole so that GetStats (another thread) reads a consistent snapshot.
        self.stats = scheduler_pb2.SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_slots_used=self.runner.cache.used_slots,
            kv_slots_total=self.runner.cache.num_slots,
            kv_tokens_used=sum(r.length for r in self._running),
            steps=self._step,
            finished=self._finished_total,
            aborted=self._aborted_total,
        )
