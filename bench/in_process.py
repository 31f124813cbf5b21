"""The scheduler's model step in process, without its thread or gRPC: the policy (engine/scheduler.py) chooses
the rows over the runner's KV pages, the runner (the model, or the synthetic stand-in) computes them, the sampled
tokens are appended and a request that has all its tokens ends. For the benchmarks that time steps of the model,
or watch the policy."""

import time

import numpy as np
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest

from services.scheduler.cache.pages import PagePool
from services.scheduler.cache.prefix_cache import PrefixCache
from services.scheduler.engine.scheduler import Scheduler, SlotPool
from services.scheduler.request import Request, RequestStatus
from services.scheduler.step import StepResult, StepRunner
from services.scheduler.submit import SubmitLimits, parse_request


class InProcessSteps:
    def __init__(self, runner: StepRunner, slots: SlotPool | int, pages: PagePool | None = None,
                 prefill_budget: int = 1 << 20, prefix_cache: bool = False, chunked: bool = True):
        """Several share the runner's request slots and KV pages by sharing `slots` and `pages`."""
        pages = pages or PagePool(runner.num_pages, runner.page_size)
        self.runner = runner
        self.policy = Scheduler(slots if isinstance(slots, SlotPool) else SlotPool(slots), pages,
                                PrefixCache(pages, enabled=prefix_cache), prefill_budget, chunked=chunked)
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
        if failed := self.policy.compiled():
            raise failed[0][1]

    def place(self, request: Request) -> None:
        """Start a request as if its prompt had been prefilled (its KV pages hold zeros): for timing decode steps at
        a context length without computing the prefill."""
        pages = self.policy.pages
        request.page_table = pages.allocate(pages.pages_for(request.prompt_len))
        request.computed = request.prompt_len - 1
        self.policy.waiting.append(request)
        self.policy._move(request, RequestStatus.RUNNING)

    def step(self) -> StepResult:
        """One step: the policy's rows, run; each sampled token appended; requests with all their tokens end."""
        batch = self.policy.schedule()
        result = self.runner.step(batch)
        self.policy.computed(batch)
        for row, token in zip(batch.sampling, result.next_ids.tolist()):
            request = row.request
            request.append_output(token)
            if len(request.output_ids) >= request.max_new_tokens:
                self.policy.finish(request)
        return result

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
