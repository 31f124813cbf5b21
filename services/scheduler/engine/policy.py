"""The scheduling policy (vLLM's Scheduler): which requests run each step, which wait, which are retracted, and
what a step's results change.

Each step's batch (step.py) is built in three passes, all bounded by the KV memory (kv/manager.py):
1. every running request that decodes gets one row, and a new page when its next token starts one; when pages run
   short (after the prefix cache gave back what no request holds), the newest running requests are retracted
   until the others fit: their full pages stay in the prefix cache, they wait first in line and resume by a
   prefill of prompt and output so far (most of it a cache hit unless evicted meanwhile);
2. running requests still prefilling get their next chunk, within the step's prefill budget
   (--chunked-prefill-size; with chunking off, --max-prefill-tokens and whole prompts);
3. waiting requests are admitted first come, first served while a request slot is free, the budget lasts and the
   pages their first chunk needs are there beside a reserve for the running requests to grow: each starts from
   the longest prefix of its sequence in the prefix cache, so only the rest is computed. A request whose next
   full page another request is computing right now waits a step, to find it cached. A request on a LoRA adapter
   that the running requests do not use waits while they use --max-loras-per-batch adapters (those behind it on
   the base model or on those adapters go first).
After the step, `update_from_output` records what it computed and appends each sampled token; requests that are
done finish. Requests join and leave between steps; every change of status goes through `_move`, which keeps the
lists, the KV memory, the request slots and the status in agreement.
"""

import logging
import math
import time
from collections import deque
from collections.abc import Callable

import numpy as np
from flatwire_wire.logprobs import LogprobRows
from flatwire_wire.steps import Finish, FinishReason

from services.scheduler.kv.manager import KVManager
from services.scheduler.output.pending import PendingStores
from services.scheduler.output.step_output import Outgoing
from services.scheduler.request import ALLOWED, Request, RequestStatus
from services.scheduler.step import Batch, BatchRow, StepResult

log = logging.getLogger(__name__)

# Tokens of room kept free, beyond what admitted chunks take, for each running request's next tokens (so that
# admission does not retract at the next step what it just let in); at most what the request may still generate.
# One page: bench.kv_capacity measured 64 running a tenth fewer requests to save a few retractions in a thousand.
DECODE_RESERVE_TOKENS = 16


class SlotPool:
    """The request slots (--max-running-requests): each running request's row of per-request sampling state."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)


def no_routed_experts(request: Request) -> np.ndarray | None:
    return None


class Scheduler:
    def __init__(self, kv: KVManager, slots: SlotPool, prefill_budget: int, chunked: bool,
                 max_context: int = 1 << 62, compile_timeout_s: float = math.inf,
                 routed_experts: Callable[[Request], np.ndarray | None] = no_routed_experts, max_adapters: int = 0):
        """`chunked`: a prompt longer than what is left of the budget is split across steps; `max_context`: a
        sequence this long ends (LENGTH); `compile_timeout_s`: a request COMPILING longer fails (its compile, if it
        has not started, is dropped); `routed_experts`: what the model recorded for a request's tokens, read when
        it finishes (before its KV memory goes); `max_adapters`: the LoRA adapters the running requests may use at
        once (--max-loras-per-batch; 0: no bound)."""
        self.kv = kv
        self.slots = slots
        self.prefill_budget = prefill_budget
        self.chunked = chunked
        self.max_context = max_context
        self.compile_timeout_s = compile_timeout_s
        self.routed_experts = routed_experts
        self.max_adapters = max_adapters
        self.pending_rows = PendingStores()  # the logprob rows of output not shipped yet
        self.waiting: deque[Request] = deque()  # WAITING and RETRACTED, in the order they are admitted
        self.compiling: list[Request] = []  # COMPILING: in line once their grammar is ready
        self.running: list[Request] = []  # RUNNING, in the order they were admitted
        self.retractions = 0  # requests retracted because pages ran short
        self.prefill_tokens = 0  # tokens whose KV a prefill computed (cache hits excluded)
        self.cached_prompt_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.finished_total = 0  # ended with a token or length
        self.aborted_total = 0  # aborted or failed

    @property
    def requests(self) -> list[Request]:
        """Every request held: running, then waiting, then compiling."""
        return [*self.running, *self.waiting, *self.compiling]

    def add(self, request: Request) -> None:
        """A new request, last in line (once its grammar is compiled, if it is COMPILING); it holds its LoRA
        adapter until it ends."""
        if request.adapter is not None:
            request.adapter.users += 1
            request.adapter.last_use = time.monotonic()
        if request.status is RequestStatus.COMPILING:
            request.compile_deadline = time.monotonic() + self.compile_timeout_s
            self.compiling.append(request)
        else:
            self.waiting.append(request)

    def compile_wait(self) -> float | None:
        """Seconds until the first compiling request's deadline (None: none compiles), for the engine's wait."""
        if not self.compiling:
            return None
        return max(0.0, min(r.compile_deadline for r in self.compiling) - time.monotonic())

    def compiled(self, out: Outgoing) -> None:
        """Compiling requests whose grammar is ready get in line; those whose compile failed (or timed out) end."""
        now = time.monotonic()
        for request in list(self.compiling):
            matcher = request.compiling
            if matcher is not None and not matcher.done() and now >= request.compile_deadline:
                matcher.cancel()  # a compile already running ends on its own; its result is dropped
                self._fail_compile(request, f"not compiled within {self.compile_timeout_s:g} s "
                                   "(--grammar-compile-timeout-s)", out)
            elif matcher is None or not matcher.done():
                continue
            elif (error := matcher.exception()) is not None:
                self._fail_compile(request, str(error), out)
            else:
                request.grammar, request.compiling = matcher.result(), None
                self._move(request, RequestStatus.WAITING)

    def _fail_compile(self, request: Request, why: str, out: Outgoing) -> None:
        out.end(request, self.finish(request, FinishReason.ERROR, message=f"its grammar did not compile: {why}"))

    def find(self, rid: str) -> Request | None:
        return next((r for r in self.requests if r.rid == rid), None)

    # -- before a step --

    def schedule(self, admit: bool = True) -> Batch:
        """The next step's rows (see the module docstring); `admit`: waiting requests may start."""
        rows = self._decode_rows()
        chunks: list[BatchRow] = []  # "alone" below: without another prefill in the step
        budget = self.prefill_budget
        for request in [r for r in self.running if not r.decoding]:
            if budget <= 0 or request.status is not RequestStatus.RUNNING:  # retracted just now
                break
            row = self._chunk(request, budget, alone=not chunks)
            while row is None and not rows and not chunks and self.running[-1] is not request:
                self._preempt(self.running[-1], "to prefill an older request")  # nothing else could progress
                row = self._chunk(request, budget, alone=True)
            if row is None:
                break
            chunks.append(row)
            budget -= row.end - row.start
        # Pages the running requests may need for their next DECODE_RESERVE_TOKENS: kept free by admission
        # (summed once, then per admitted request: admitting hundreds at once stays linear).
        reserve = sum(map(self._reserve, self.running)) if admit and self.waiting else 0
        adapters = {r.adapter.id for r in self.running if r.adapter is not None} if self.max_adapters else set()
        passed = 0  # requests in line that wait for an adapter's room: those behind them may go first
        while admit and len(self.waiting) > passed and self.slots.free and budget > 0:
            request = self.waiting[passed]
            adapter = request.adapter
            if adapter is not None and self.max_adapters and adapter.id not in adapters and \
                    len(adapters) >= self.max_adapters:
                passed += 1  # no room for another adapter in a step: it waits for one of theirs to end
                continue
            row = self._admit(request, budget, alone=not chunks, prefills=chunks, reserve=reserve)
            if row is None:
                break
            if adapter is not None:
                adapters.add(adapter.id)
            reserve += self._reserve(row.request)
            chunks.append(row)
            budget -= row.end - row.start
        self.prefill_tokens += sum(r.end - r.start for r in chunks)
        return Batch(rows + chunks)

    def _decode_rows(self) -> list[BatchRow]:
        """A row per decoding request, each with a slot for its next token: retracting the newest requests when
        pages run short."""
        decoding = [r for r in self.running if r.decoding]
        # Those whose next token starts a page (in each layer group: every token before it has its slot).
        starting = [(r, n) for r in decoding if (n := self.kv.pages_needed(r, r.length))]
        while (short := sum(n for _, n in starting) - self.kv.available) > 0:
            victim = self.running[-1]
            self._preempt(victim, f"short by {short} pages for the decoding requests")
            if victim in decoding:
                decoding.remove(victim)
                starting = [(r, n) for r, n in starting if r is not victim]
        for request in decoding:  # their new pages, and a checkpoint of a linear-attention state at a page's end
            self.kv.allocate(request, request.length)
        return [BatchRow(r, r.length - 1, r.length) for r in decoding]

    def _chunk(self, request: Request, budget: int, alone: bool) -> BatchRow | None:
        """The next chunk of a request's prefill within `budget` (all of it when chunking is off, `alone`: even
        past the budget), its pages allocated; None when it does not fit."""
        start = request.kv.computed
        remaining = request.length - start
        size = min(remaining, budget) if self.chunked else remaining
        if not self.chunked and size > budget and not alone:
            return None
        end = start + size
        if self.kv.pages_needed(request, end) > self.kv.available:
            return None
        self.kv.allocate(request, end)
        return BatchRow(request, start, end)

    def _admit(self, request: Request, budget: int, alone: bool, prefills: list[BatchRow],
               reserve: int) -> BatchRow | None:
        """Start a request in line from its longest cached prefix, if its first chunk fits and leaves
        the running requests' `reserve` of pages free; None when it has to wait."""
        self.kv.match(request)
        if self.kv.next_page_in(request, prefills):
            self.kv.free(request, commit=False)
            return None
        row = self._chunk(request, budget, alone)
        if row is None or reserve > self.kv.available:
            self.kv.free(request, commit=False)
            return None
        if not request.admitted:
            request.cached_tokens = min(request.kv.computed, request.prompt_len)
            self.cached_prompt_tokens += request.cached_tokens
            request.admitted = True
        self._move(request, RequestStatus.RUNNING)
        return row

    def _reserve(self, request: Request) -> int:
        """Pages a running request needs beyond its own for its next DECODE_RESERVE_TOKENS tokens."""
        return self.kv.pages_needed(request, min(request.length + DECODE_RESERVE_TOKENS,
                                                 request.prompt_len + request.sampling.max_new_tokens))

    def _preempt(self, request: Request, why: str) -> None:
        log.info("KV memory %s: retracting request %s (%d tokens)", why, request.rid, request.length)
        self.retract(request)
        self.retractions += 1

    # -- after a step --

    def update_from_output(self, batch: Batch, result: StepResult, out: Outgoing, behind: bool = False) -> None:
        """The step ran: each row's tokens have their KV (a prefill chunk's full pages go in the prefix cache), the
        prompt logprob rows it computed are gathered, and each sampled token is appended to its request's output
        and pending entry (its logprob row to the entry's rows, its nucleus with it). Into `out`: the requests that
        ended, those with an entry's worth of output due (`behind`: a subscriber has not taken the last message,
        output/pending.py), and those whose prompt logprob rows are whole."""
        for computed in batch.rows:
            self.kv.computed(computed.request, computed.end, commit=computed.end - computed.start > 1)
        out.prompts += _gather_prompt_rows(batch, result)
        with_rows, sources = [], []  # the pending entries that take a logprob row, and its row in the step's
        replayed = 0  # the step's nuclei are its rows' whose request asked for top-p replay, in row order
        for row, (sampled, token) in enumerate(zip(batch.sampling, result.next_ids.tolist())):
            request = sampled.request
            nucleus = None
            if request.return_top_p_token_ids:
                assert result.top_p is not None, "a step with a top-p replay request computes nuclei"
                nucleus, replayed = result.top_p.of_token(replayed), replayed + 1
            if request.sampling.max_new_tokens == 0:  # its prefill gave the prompt's logprobs; the token is not output
                out.end(request, self.finish(request, FinishReason.LENGTH))
                continue
            request.append_output(token)
            pending = request.pending
            pending.add(token)
            if nucleus is not None:
                pending.add_nucleus(nucleus)
            if request.return_logprob:
                with_rows.append(pending)
                sources.append(row)
            if token in request.stop_ids:
                out.end(request, self.finish(request, FinishReason.STOP_TOKEN, matched_token=token))
            elif len(request.output_ids) >= request.sampling.max_new_tokens or request.length >= self.max_context:
                out.end(request, self.finish(request, FinishReason.LENGTH))
            elif pending.due(behind) and request.status is RequestStatus.RUNNING:  # not retracted since it launched
                out.due.append(request)
        if with_rows:
            assert result.output is not None, "a step with a logprob request computes rows"
            self.pending_rows.put(with_rows, sources, result.output)

    def fail(self, batch: Batch, why: str, out: Outgoing) -> None:
        """A step that raised: its requests end with the error (step_failed: a fault of the server, not a scheduler
        gone); their pending output never ships. The KV memory a failed step wrote is no request's: the requests
        let go of it, and only what earlier steps computed is cached."""
        for row in batch.rows:
            if row.request.status is not RequestStatus.FINISHED:
                row.request.pending.release_lane()
                finish = self.finish(row.request, FinishReason.ERROR, message=f"scheduler step failed: {why}")
                finish.step_failed = True
                out.finished.append(finish)

    # -- status changes --

    def finish(self, request: Request, reason: FinishReason, matched_token: int = 0, matched_stop: str = "",
               message: str = "") -> Finish:
        """The request ends; its Finish (with the experts its tokens were routed to, if it asked)."""
        routed = self.routed_experts(request) if request.return_routed_experts else None  # before its pages go
        self._move(request, RequestStatus.FINISHED)
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            self.aborted_total += 1
        else:
            self.finished_total += 1
        return Finish(rid=request.rid, reason=reason, matched_token=matched_token, matched_stop=matched_stop,
                      message=message, output_tokens=len(request.output_ids), cached_tokens=request.cached_tokens,
                      routed_experts=routed.astype("<i4").tobytes() if routed is not None else b"",
                      routed_experts_shape=list(routed.shape) if routed is not None else [])

    def end_all(self, out: Outgoing, message: str, reason: FinishReason = FinishReason.ABORT) -> int:
        """End every running and waiting request (with the output it has); how many."""
        requests = self.requests
        for request in requests:
            out.end(request, self.finish(request, reason, message=message))
        return len(requests)

    def retract(self, request: Request) -> None:
        """A running request drops its KV (its full pages into the prefix cache first) and waits first in line."""
        self._move(request, RequestStatus.RETRACTED)

    def retract_running(self) -> None:
        """Every running request is retracted, each first in line in its order."""
        for request in reversed(self.running):
            self.retract(request)

    def _move(self, request: Request, status: RequestStatus) -> None:
        """The one place a request changes status."""
        if status not in ALLOWED[request.status]:
            raise ValueError(f"request {request.rid}: {request.status.value} cannot become {status.value}")
        if status is RequestStatus.FINISHED and request.adapter is not None:
            request.adapter.users -= 1
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.slots.release(request.slot)
            request.slot = -1
            self.kv.free(request)
        elif request.status is RequestStatus.COMPILING:
            self.compiling.remove(request)
        else:
            self.waiting.remove(request)
        if status is RequestStatus.WAITING:
            self.waiting.append(request)
        elif status is RequestStatus.RUNNING:
            request.slot = self.slots.allocate()
            self.running.append(request)
        elif status is RequestStatus.RETRACTED:
            self.waiting.appendleft(request)
        request.status = status


def _gather_prompt_rows(batch: Batch, result: StepResult) -> list[Request]:
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
                                                           request.top_logprobs_num, len(request.token_ids_logprob))
        if len(positions):
            request.prompt_logprobs.put(positions.start - request.prompt_logprob_start, next(rows))
        if row.end >= request.prompt_len:
            whole.append(request)
    return whole
