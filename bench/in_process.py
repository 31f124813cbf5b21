"""The scheduler's model step in process, without its thread or gRPC: the policy (engine/scheduler.py) chooses
the rows over the runner's KV pages, batch_step.run_step computes them, the sampled tokens are appended. For the
benchmarks that time one step of the model."""

from services.scheduler.cache.pages import PagePool
from services.scheduler.cache.prefix_cache import PrefixCache
from services.scheduler.engine.scheduler import Scheduler, SlotPool
from services.scheduler.model.batch_step import run_step
from services.scheduler.model.runner import ModelRunner
from services.scheduler.request import Request
from services.scheduler.step import StepResult


class InProcessSteps:
    def __init__(self, runner: ModelRunner, slots: SlotPool | int, pages: PagePool | None = None,
                 prefill_budget: int = 1 << 20, prefix_cache: bool = False):
        """Several share the runner's request slots and KV pages by sharing `slots` and `pages`."""
        pages = pages or PagePool(runner.num_pages, runner.page_size)
        self.runner = runner
        self.policy = Scheduler(slots if isinstance(slots, SlotPool) else SlotPool(slots), pages,
                                PrefixCache(pages, enabled=prefix_cache), prefill_budget, chunked=True)

    def add(self, requests: list[Request]) -> None:
        for request in requests:
            self.policy.add(request)

    def step(self) -> StepResult:
        """One step: the policy's rows, run; each sampled token appended to its request."""
        batch = self.policy.schedule()
        result = run_step(self.runner, batch, self.runner.logits_chunk_rows)
        self.policy.computed(batch)
        for row, token in zip(batch.sampling, result.next_ids.tolist()):
            row.request.output_ids.append(token)
        return result
