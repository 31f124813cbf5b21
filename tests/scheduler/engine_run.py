"""The paged engine in process, stepped by a test, and the reference it is checked against (transformers)."""

import numpy as np
import torch
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest
from flatwire_wire.steps import StepMessage

from services.scheduler.config import SchedulerConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.model.runner import ModelRunner
from services.scheduler.submit import SubmitLimits, parse_request

K = 5
ATOL = 1e-4


class Run:
    """An Engine on the model, stepped by the test; what it published, per request."""

    def __init__(self, model_dir, slots: int = 8, behind=lambda: False, **options):
        """`behind`: the engine's question whether its subscribers are behind (coalescing streamed output)."""
        options = {"page_size": 4, "max_total_tokens": 4096, **options}
        self.config = SchedulerConfig(max_running_requests=slots, **options)
        graphs = self.config.cuda_graph_max_bs if self.config.enable_cuda_graph else 0
        self.runner = ModelRunner(model_dir, "cpu", "float32", 0, slots, self.config.page_size,
                                  self.config.max_total_tokens, attention_backend=self.config.attention_backend,
                                  cuda_graph_max_bs=graphs)
        self.published: list[StepMessage] = []
        self.engine = Engine(self.runner, self.config, publish=self.published.append, behind=behind)
        self.limits = SubmitLimits(self.runner.vocab_size, self.runner.max_context, 16,
                                   tuple(self.runner.eos_token_ids), 50,
                                   stream_coalesce_tokens=self.config.stream_coalesce_tokens,
                                   max_total_tokens=(self.runner.num_pages - 1) * self.runner.page_size)

    def submit(self, rid: str, prompt: list[int], new_tokens: int, logprob_start_len: int = -1,
               stream_interval: int = 0) -> None:
        self.engine.submit(parse_request(TokenizedRequest(
            rid=rid, owner="test", input_ids=prompt, stream_interval=stream_interval,
            sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True),
            logprob=LogprobParams(return_logprob=True, top_logprobs_num=K, logprob_start_len=logprob_start_len)),
            self.limits))

    def run(self, most_steps: int = 500) -> None:
        for _ in range(most_steps):
            self.engine._iterate(*self.engine._drain_inbox(block=False))
            if not self.engine.scheduler.requests:
                return
        raise AssertionError(f"requests still held after {most_steps} steps")

    def result(self, rid: str) -> dict:
        tokens, values, ids, chosen, prompt, finish = [], [], [], [], None, None
        for message in self.published:
            for i, r in enumerate(message.rids):
                if r == rid:
                    tokens += message.entry_tokens(i)
                    rows = message.output.request(i)
                    values.append(rows.topk_values)
                    ids.append(rows.topk_ids)
                    chosen.append(rows.token_logprobs)
            for i, r in enumerate(message.prompt_rids):
                if r == rid:
                    prompt = message.prompt.request(i)
            finish = next((f for f in message.finished if f.rid == rid), finish)
        return {"tokens": tokens, "topk_values": np.concatenate(values), "topk_ids": np.concatenate(ids),
                "token_logprobs": np.concatenate(chosen), "prompt": prompt, "finish": finish}


def reference(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens, and the log-softmax rows of the whole sequence [len - 1, vocab] (row p: position p + 1)."""
    with torch.no_grad():
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False)[0, len(prompt):].tolist()
        logprobs = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0, :-1].float(), dim=-1)
    return tokens, logprobs


def check(model, prompt: list[int], new_tokens: int, got: dict, logprob_start_len: int = -1) -> None:
    tokens, logprobs = reference(model, prompt, new_tokens)
    assert got["tokens"] == tokens
    output = logprobs[len(prompt) - 1:]
    np.testing.assert_allclose(got["token_logprobs"], output.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=ATOL,
                               rtol=0)
    np.testing.assert_allclose(got["topk_values"], output.topk(K).values, atol=ATOL, rtol=0)
    if logprob_start_len >= 0:
        first = max(logprob_start_len, 1)
        rows = logprobs[first - 1:len(prompt) - 1]
        np.testing.assert_allclose(got["prompt"].token_logprobs,
                                   rows.gather(1, torch.tensor(prompt[first:])[:, None])[:, 0], atol=ATOL, rtol=0)
        np.testing.assert_allclose(got["prompt"].topk_values, rows.topk(K).values, atol=ATOL, rtol=0)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 240_000, length).tolist()
