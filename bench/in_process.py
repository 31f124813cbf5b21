"""The scheduler's model step in process, without its thread, its messages or gRPC: the policy (engine/policy.py)
chooses the rows within the KV memory (kv/manager.py), the runner (the model, or the synthetic stand-in) computes
them, and the policy takes the results (update_from_output: tokens appended, requests that have all their tokens
end). For the benchmarks that time steps of the model, or watch the policy."""

import time

import numpy as np
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest

from services.scheduler.engine.policy import Scheduler, SlotPool
from services.scheduler.kv.manager import KVManager, KVState
from services.scheduler.output.step_output import Outgoing
from services.scheduler.request import Request, RequestStatus
from services.scheduler.step import Batch, StepResult, StepRunner
from services.scheduler.submit import SubmitLimits, parse_request


class InProcessSteps:
    def __init__(self, runner: StepRunner, slots: SlotPool | int, kv: KVManager | None = None,
                 prefill_budget: int = 1 << 20, prefix_cache: bool = False, chunked: bool = True):
        """Several share the runner's request slots and KV memory by sharing `slots` and `kv`."""
        kv = kv or KVManager(runner.num_pages, runner.page_size, runner.kv_windows, prefix_cache)
        self.runner = runner
        self.policy = Scheduler(kv, slots if isinstance(slots, SlotPool) else SlotPool(slots), prefill_budget,
                                chunked=chunked, max_context=runner.max_context)
        self.limits = SubmitLimits(runner.vocab_size, runner.max_context, 256, tuple(runner.eos_token_ids), 1,
                                   max_total_tokens=(runner.num_pages - 1) * runner.page_size)

    def request(self, rid: str, prompt: list[int], new_tokens: int, temperature: float = 0.0, seed: int | None = None,
                top_k: int = 0) -> Request:
        """A request as the scheduler's Submit validates it (eos ignored: it runs to new_tokens)."""
        return parse_request(TokenizedRequest(
            rid=rid, owner="bench", input_ids=prompt, sampling=SamplingParams(
                max_new_tokens=new_tokens, temperature=temperature, seed=seed, ignore_eos=True),
            logprob=LogprobParams(return_logprob=top_k > 0, top_logprobs_num=top_k, logprob_start_len=-1)), self.limits)

    def add(self, requests: list[Request]) -> None:
        """In line, their grammars (if any) compiled."""
        for request in requests:
            if request.compiling is not None:
                request.compiling.result()
            self.policy.add(request)
        out = Outgoing()
        self.policy.compiled(out)
        if out.finished:
            raise RuntimeError(out.finished[0].message)

    def place(self, request: Request) -> None:
        """Start a request as if its prompt had been prefilled (its KV pages hold zeros): for timing decode steps at
        a context length without computing the prefill."""
        request.kv = KVState()
        self.policy.kv.allocate(request, request.prompt_len)
        request.kv.computed = request.prompt_len - 1
        self.policy.waiting.append(request)
        self.policy._move(request, RequestStatus.RUNNING)

    def step(self) -> StepResult:
        """One step: the policy's rows, run; each sampled token appended; requests with all their tokens end."""
        batch = self.policy.schedule()
        result = self.runner.step(batch)
        self.take(batch, result)
        return result

    def take(self, batch: Batch, result: StepResult) -> None:
        """The policy takes a step's results; the output entries they make due are let go as the engine's message
        would take them (nothing publishes them here: held, a logprob request's rows outgrow their lane)."""
        out = Outgoing()
        self.policy.update_from_output(batch, result, out)
        for request in out.due:
            request.pending.shipped()

    def run(self) -> list[float]:
        """Step until every request ended; each step's seconds."""
        seconds = []
        while self.policy.requests:
            start = time.perf_counter()
            self.step()
            seconds.append(time.perf_counter() - start)
        return seconds


def random_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 200_000, length).tolist()
