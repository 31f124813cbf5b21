"""The engine in process, stepped by a test (Engine.step: no thread, no gRPC), and the reference it is checked
against (transformers). Every in-process engine test drives it through `Run`."""

import functools
from pathlib import Path

import numpy as np
import torch
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest
from flatwire_wire.steps import Finish, StepMessage
from transformers import AutoModelForCausalLM

from harness.checkpoints import SMALL_VOCABULARY
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.kv.manager import longest_sequence
from services.scheduler.model.runner import ModelRunner
from services.scheduler.sampling.grammar import Grammars
from services.scheduler.step import StepRunner
from services.scheduler.submit import SubmitLimits, parse_request

K = 5
ATOL = 1e-4


@functools.lru_cache(maxsize=4)
def model_runner(model_dir: Path, slots: int, page_size: int, max_total_tokens: int, attention_backend: str,
                 cuda_graph_max_bs: int, state_checkpoints: int, kv_cache_dtype: str,
                 lora: tuple[frozenset[str], int, int] | None = None,
                 linear_attention_backend: str = "torch") -> ModelRunner:
    """A float32 CPU runner of the model, shared by the tests that ask for the same one: an engine's steps leave
    nothing in it that another engine reads (its pages and state slots are handed out anew, its sampling state is
    per request)."""
    return ModelRunner(model_dir, "cpu", "float32", 0, slots, page_size, max_total_tokens,
                       attention_backend=attention_backend, cuda_graph_max_bs=cuda_graph_max_bs,
                       state_checkpoints=state_checkpoints, kv_cache_dtype=kv_cache_dtype, lora=lora,
                       linear_attention_backend=linear_attention_backend)


class Run:
    """An Engine on a model (a checkpoint's path: its runner shared with other tests of the same options) or on a
    given runner (the synthetic stand-in), stepped by the test; what it published, per request."""

    def __init__(self, model: Path | StepRunner, slots: int = 8, behind=lambda: False, grammars: Grammars | None = None,
                 own_runner: bool = False, **options):
        """`behind`: the engine's question whether its subscribers are behind (coalescing streamed output);
        `grammars`: compile structured-output constraints; `own_runner`: the test changes its model's runner (its
        weights, its methods, its CUDA graphs), which no other test then shares; `options`: SchedulerConfig's
        fields."""
        options = {"page_size": 4, "max_total_tokens": 4096, **options}
        self.config = SchedulerConfig(max_running_requests=slots, **options)
        if isinstance(model, Path):
            graphs = self.config.cuda_graph_max_bs if self.config.enable_cuda_graph else 0
            build = model_runner.__wrapped__ if own_runner else model_runner
            model = build(model, slots, self.config.page_size, self.config.max_total_tokens,
                          self.config.attention_backend, graphs, self.config.state_checkpoints,
                          self.config.kv_cache_dtype, self.config.lora_layers, self.config.linear_attention_backend)
        self.runner = model
        self.grammars = grammars
        self.published: list[StepMessage] = []
        self.engine = Engine(model, self.config, publish=self.published.append, behind=behind)
        self.limits = SubmitLimits(model.vocab_size, model.max_context, 16, tuple(model.eos_token_ids), 50,
                                   stream_coalesce_tokens=self.config.stream_coalesce_tokens,
                                   max_total_tokens=longest_sequence(model.num_pages, model.page_size, model.kv_windows,
                                                                     self.config.prefill_budget))

    def send(self, rid: str, input_ids: list[int], logprob: LogprobParams | None = None, stream_interval: int = 0,
             lora_name: str = "", cache_namespace: str = "", **sampling) -> None:
        """Submit a request (on the LoRA adapter `lora_name`, in the prefix-cache namespace `cache_namespace`);
        `sampling`: SamplingParams' fields."""
        self.engine.submit(parse_request(TokenizedRequest(
            rid=rid, owner="test", input_ids=input_ids, stream_interval=stream_interval,
            sampling=SamplingParams(**sampling), logprob=logprob or LogprobParams(logprob_start_len=-1),
            lora_name=lora_name, cache_namespace=cache_namespace), self.limits, self.grammars, self.engine.adapters))

    def submit(self, rid: str, prompt: list[int], new_tokens: int, logprob_start_len: int = -1,
               stream_interval: int = 0, lora_name: str = "", cache_namespace: str = "") -> None:
        """A greedy request of exactly `new_tokens` tokens with top-K logprobs (prompt logprobs from
        `logprob_start_len`)."""
        self.send(rid, prompt, LogprobParams(return_logprob=True, top_logprobs_num=K,
                                             logprob_start_len=logprob_start_len),
                  stream_interval, lora_name, cache_namespace, max_new_tokens=new_tokens, temperature=0,
                  ignore_eos=True)

    def step(self, times: int = 1) -> None:
        for _ in range(times):
            self.engine.step()

    def run(self, most_steps: int = 500) -> None:
        """Step until the engine holds no request."""
        for _ in range(most_steps):
            self.engine.step()
            if not self.engine.scheduler.requests:
                return
        raise AssertionError(f"requests still held after {most_steps} steps")

    def run_out(self, most_steps: int = 100) -> None:
        """Step until no request runs (waiting ones may stay)."""
        for _ in range(most_steps):
            if not self.running():
                return
            self.engine.step()
        raise AssertionError(f"still running after {most_steps} steps: {self.running()}")

    def running(self) -> list[str]:
        return [request.rid for request in self.engine.scheduler.running]

    def finish(self, rid: str) -> Finish | None:
        return next((f for m in self.published for f in m.finished if f.rid == rid), None)

    def output(self, rid: str) -> list[int]:
        return [t for m in self.published for i, r in enumerate(m.rids) if r == rid for t in m.entry_tokens(i)]

    def shipped(self, rid: str) -> list[tuple[int, int, str]]:
        """(position, count, weight_version) of each entry of `rid` published so far."""
        return [(position, count, message.weight_version) for message in self.published
                for r, position, count in zip(message.rids, message.positions, message.counts) if r == rid]

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


def run_and_check(run: Run, model, cases: dict[str, list[int]], new_tokens: int) -> None:
    """Submit every case at once (greedy, `new_tokens` each), run them out, and check each against `model`."""
    for rid, ids in cases.items():
        run.submit(rid, ids, new_tokens)
    run.run()
    for rid, ids in cases.items():
        check(model, ids, new_tokens, run.result(rid))


def prompt(seed: int, length: int) -> list[int]:
    """Ordinary tokens of the small vocabulary (tests/conftest.py small_model_dir), drawn from `seed`."""
    return np.random.default_rng(seed).integers(0, SMALL_VOCABULARY, length).tolist()


def prompts(seed: int, lengths: list[int], vocab: int) -> dict[str, list[int]]:
    """Prompts "r0", "r1", ... of these lengths, of token ids in [3, vocab)."""
    rng = np.random.default_rng(seed)
    return {f"r{i}": rng.integers(3, vocab, n).tolist() for i, n in enumerate(lengths)}


def tiny_checkpoint(path: Path, make) -> tuple[Path, torch.nn.Module]:
    """The random model `make()` builds (seed 0), saved to `path`, and transformers' own float32 reading of it (the
    reference)."""
    torch.manual_seed(0)
    make().save_pretrained(path)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
