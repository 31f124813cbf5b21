"""Subscribers of a scheduler's step stream, for the tests and benchmarks: SchedulerClient submits requests as
one owner and collects that owner's outputs (as a detokenizer would); Tap records every request's output."""

import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
import numpy as np
from flatwire_wire.control import EMPTY
from flatwire_wire.logprobs import LogprobRows
from flatwire_wire.scheduler import SCHEDULER, SchedulerStats, TokenizedRequest
from flatwire_wire.steps import Finish, RequestStart, StepMessage

from services.common.rpc import message_options


@dataclass
class Collected:
    """Everything the stream said about one request."""

    start: RequestStart | None = None
    start_step: int = -1
    token_ids: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # per token: the step number of the message that carried it
    entries: list[tuple[int, int]] = field(default_factory=list)  # (position, count) of each entry
    output: list[LogprobRows] = field(default_factory=list)  # one per entry in messages with an output block
    prompt: LogprobRows | None = None
    prompt_null_prefix: int = 0
    finish: Finish | None = None
    finish_step: int = -1
    done: threading.Event = field(default_factory=threading.Event)

    def topk(self) -> tuple[np.ndarray, np.ndarray]:
        """Output top-k as [tokens, k] values and ids."""
        return (np.concatenate([o.topk_values for o in self.output]),
                np.concatenate([o.topk_ids for o in self.output]))


class SchedulerClient:
    def __init__(self, address: str):
        self.owner = f"test-{uuid.uuid4().hex[:8]}"
        self.channel = grpc.insecure_channel(address, options=message_options(256))
        self.calls = SCHEDULER.calls(self.channel)
        self.requests: dict[str, Collected] = {}
        self.messages: list[StepMessage] = []  # every step message seen
        self._lock = threading.Lock()
        self._stream = self.calls["StreamSteps"](EMPTY)
        self._stream.initial_metadata()  # the server has registered us
        self._thread = threading.Thread(target=self._consume, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stream.cancel()
        self._thread.join(timeout=5)
        self.channel.close()

    def submit(self, rid: str | None = None, stream_interval: int = 1, owner: str | None = None, **fields) -> str:
        """Submit as a streaming request (a token per step) unless stream_interval says otherwise; as this
        client's owner unless `owner` names another (its outputs are collected all the same)."""
        rid = rid or uuid.uuid4().hex
        with self._lock:
            self.requests.setdefault(rid, Collected())
        request = TokenizedRequest(rid=rid, owner=owner or self.owner, stream_interval=stream_interval, **fields)
        self.calls["Submit"](request, timeout=30)
        return rid

    def wait(self, rid: str, timeout: float = 120) -> Collected:
        collected = self.requests[rid]
        if not collected.done.wait(timeout):
            raise TimeoutError(f"{rid}: no finish after {timeout}s ({len(collected.token_ids)} tokens)")
        return collected

    def wait_tokens(self, rid: str, count: int, timeout: float = 60) -> None:
        """Block until `rid` has produced `count` tokens."""
        deadline = time.monotonic() + timeout
        while len(self.requests[rid].token_ids) < count:
            if self.requests[rid].done.is_set() or time.monotonic() > deadline:
                collected = self.requests[rid]
                raise TimeoutError(f"{rid}: {len(collected.token_ids)} of {count} tokens (finish: {collected.finish})")
            time.sleep(0.005)

    def stats(self) -> SchedulerStats:
        return self.calls["GetStats"](EMPTY, timeout=10)

    def _consume(self) -> None:
        try:
            for message in self._stream:
                self._record(message)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise

    def _record(self, message: StepMessage) -> None:
        with self._lock:
            self.messages.append(message)
            mine = self.requests
            for start in message.started:
                if start.owner == self.owner:
                    mine[start.rid].start = start
                    mine[start.rid].start_step = message.step
            for entry, (rid, position, count) in enumerate(zip(message.rids, message.positions, message.counts)):
                if rid in mine:
                    mine[rid].token_ids += message.entry_tokens(entry)
                    mine[rid].steps += [message.step] * count
                    mine[rid].entries.append((position, count))
                    if message.output is not None:
                        mine[rid].output.append(message.output.request(entry))
            if message.prompt is not None:
                for row, rid in enumerate(message.prompt_rids):
                    if rid in mine:
                        mine[rid].prompt = message.prompt.request(row)
                        mine[rid].prompt_null_prefix = message.prompt.null_prefix[row]
            for finish in message.finished:
                if finish.rid in mine:
                    mine[finish.rid].finish = finish
                    mine[finish.rid].finish_step = message.step
                    mine[finish.rid].done.set()


@dataclass
class Produced:
    """What the scheduler produced for one request, by position."""

    tokens: dict[int, int] = field(default_factory=dict)
    rows: dict[int, tuple[bytes, bytes, bytes]] = field(default_factory=dict)  # token_logprob, topk values, ids
    output_tokens: int | None = None  # from its Finish


class Tap:
    """A subscriber of the scheduler's step stream, recording every request's output, whoever owns it (the
    undisturbed reference of what the scheduler produced)."""

    def __init__(self, scheduler: str):
        self.requests: dict[str, Produced] = defaultdict(Produced)
        self.last_step = 0
        self._channel = grpc.insecure_channel(scheduler, options=[("grpc.max_receive_message_length", 1 << 30)])
        self._call = SCHEDULER.calls(self._channel)["StreamSteps"](EMPTY)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for step in self._call:
                self._record(step)
        except grpc.RpcError:
            pass  # cancelled, or the scheduler died

    def _record(self, step: StepMessage) -> None:
        self.last_step = max(self.last_step, step.step)
        for i, (rid, position) in enumerate(zip(step.rids, step.positions)):
            produced = self.requests[rid]
            entry = step.output.request(i) if step.output is not None else None
            for j, token in enumerate(step.entry_tokens(i)):
                produced.tokens[position + j] = token
                if entry is not None and entry.n:
                    produced.rows[position + j] = (entry.token_logprobs[j:j + 1].tobytes(),
                                                   entry.topk_values[j].tobytes(), entry.topk_ids[j].tobytes())
        for finish in step.finished:
            self.requests[finish.rid].output_tokens = finish.output_tokens

    def stats(self) -> SchedulerStats:
        return SCHEDULER.calls(self._channel)["GetStats"](EMPTY, timeout=10)

    def catch_up(self, timeout: float = 30) -> None:
        """With the scheduler idle, until the tap has read its whole replay (earlier requests, finished)."""
        deadline = time.monotonic() + timeout
        while (stats := self.stats()).running or stats.waiting or self.last_step < stats.steps:
            if time.monotonic() > deadline:
                raise TimeoutError(f"scheduler not idle, or the tap behind: {stats}")
            time.sleep(0.05)

    def running(self, min_tokens: int) -> int:
        """Requests with at least `min_tokens` tokens and no finish yet."""
        return sum(len(p.tokens) >= min_tokens and p.output_tokens is None for p in list(self.requests.values()))

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()
