"""The engine on the device: the device's rates, decode and prefill tokens/s, the overlap schedule, and
transformers' generate."""

import time
from dataclasses import dataclass

import numpy as np
import torch
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest
from flatwire_wire.steps import encode_step

from bench.in_process import InProcessSteps, random_prompt
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.model.attention import ATTENTION_NAME
from services.scheduler.model.runner import ModelRunner
from services.scheduler.output.step_output import Outgoing
from services.scheduler.submit import SubmitLimits, parse_request

GIB = 1 << 30


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / repeats


@dataclass
class DeviceRates:
    copy_bytes_per_s: float  # read + write of a device-to-device copy
    matmul_flops: float  # dense bf16 (float32 off CUDA) n x n x n

    @classmethod
    def measure(cls, device: torch.device, copy_gib: float, matmul_n: int) -> "DeviceRates":
        return cls(2 * copy_gib * GIB / _copy_seconds(device, copy_gib),
                   2 * matmul_n ** 3 / _matmul_seconds(device, matmul_n))


def _copy_seconds(device: torch.device, gib: float) -> float:
    source = torch.empty(int(gib * GIB), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return timed(lambda: target.copy_(source), device, 10)


def _matmul_seconds(device: torch.device, n: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return timed(lambda: a @ b, device, 10)


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step reads of the weights: all of them but the input embedding rows it does not look up
    (unless the output head shares them)."""
    embedding = runner.model.get_input_embeddings().weight
    tied = embedding.data_ptr() == runner.lm_head.weight.data_ptr()
    seen: set[int] = set()
    total = 0
    for parameter in runner.model.parameters():
        if parameter.data_ptr() in seen or (parameter is embedding and not tied):
            continue
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    return total


@dataclass
class DecodeRow:
    shape: str
    batch: int
    k: int
    mode: str  # torch | triton | triton + graphs
    step_s: float
    floor_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s


def set_mode(runner: ModelRunner, mode: str, graphs) -> None:
    """The bench switches one loaded runner between attention paths (one copy of the weights on the device):
    graphs need the kernel."""
    runner.attention_backend = "torch" if mode == "torch" else "triton"
    runner.graphs = graphs if mode == "triton + graphs" else None


def decode_rows(runner: ModelRunner, shape: str, batches: list[int], context: int, steps: int,
                rates: DeviceRates) -> list[DecodeRow]:
    """B requests placed at `context` tokens (their prompt's KV as if prefilled: zeros), then `steps` decode
    steps timed, per mode and k, on the same prompts."""
    graphs = runner.graphs
    modes = ["torch", "triton"] + (["triton + graphs"] if graphs is not None else [])
    rows = []
    weights, per_token = weight_bytes(runner), runner.kv_token_bytes
    for batch in batches:
        for k in (0, 128):
            for mode in modes:
                set_mode(runner, mode, graphs)
                engine = InProcessSteps(runner, batch)
                for i in range(batch):
                    engine.place(engine.request(f"r{i}", random_prompt(i, context), steps + 8, top_k=k))
                seconds = timed(engine.step, runner.device, steps)
                # the weights once, and each row's KV at its mean context over the timed steps
                floor = (weights + batch * (context + steps // 2) * per_token) / rates.copy_bytes_per_s
                rows.append(DecodeRow(shape, batch, k, mode, seconds, floor))
    set_mode(runner, modes[-1], graphs)
    return rows


@dataclass
class PrefillRow:
    shape: str
    prompts: int
    prompt_tokens: int
    mode: str
    step_s: float
    flops: float  # of the step: 2 x non-embedding parameters x tokens, plus causal attention

    @property
    def tokens_per_s(self) -> float:
        return self.prompts * self.prompt_tokens / self.step_s


def prefill_rows(runner: ModelRunner, shape: str, prompts: int, prompt_tokens: int) -> list[PrefillRow]:
    config = runner.model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dense = weight_bytes(runner) // runner.model.get_input_embeddings().weight.element_size()
    attention = 2 * config.num_hidden_layers * config.num_attention_heads * head_dim * prompt_tokens ** 2  # causal
    flops = prompts * (2 * dense * prompt_tokens + attention)
    graphs = runner.graphs
    rows = []
    for mode in ("torch", "triton"):
        set_mode(runner, mode, graphs)

        def prefill() -> None:
            engine = InProcessSteps(runner, prompts, prefill_budget=prompts * prompt_tokens)
            engine.add([engine.request(f"p{i}", random_prompt(100 + i, prompt_tokens), 1) for i in range(prompts)])
            engine.step()

        rows.append(PrefillRow(shape, prompts, prompt_tokens, mode, timed(prefill, runner.device, 3), flops))
    set_mode(runner, "triton + graphs" if graphs is not None else "triton", graphs)
    return rows


@dataclass
class GenerateRow:
    shape: str
    batch: int
    decode_s: float  # per generated token of the batch (a step)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.decode_s


def transformers_rows(runner: ModelRunner, shape: str, batches: list[int], context: int,
                      new_tokens: int) -> list[GenerateRow]:
    """transformers' generate with a static cache on the runner's model (SDPA attention for the call): the
    decode rate from the difference of a 1-token and a (1 + new_tokens)-token call, so its prefill cancels."""
    model = runner.model
    rows = []
    model.set_attn_implementation("sdpa")
    try:
        for batch in batches:
            ids = torch.from_numpy(np.stack([random_prompt(i, context) for i in range(batch)])).to(runner.device)

            def generate(tokens: int, ids: torch.Tensor = ids) -> None:
                with torch.inference_mode():
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                   min_new_tokens=tokens, do_sample=False, cache_implementation="static",
                                   pad_token_id=0)

            first = timed(lambda: generate(1), runner.device, 1)
            whole = timed(lambda: generate(1 + new_tokens), runner.device, 1)
            rows.append(GenerateRow(shape, batch, (whole - first) / new_tokens))
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    return rows


@dataclass
class OverlapRow:
    shape: str
    batch: int
    k: int
    overlap: bool
    step_s: float  # per engine pass in steady decode: one step, its output message built and encoded


def overlap_rows(runner: ModelRunner, shape: str, batches: list[int], context: int, steps: int,
                 k: int = 128) -> list[OverlapRow]:
    """The engine's whole loop (engine/engine.py), stepped in line, its messages encoded to the wire as the
    server's loop would (here on the engine thread: the host work is, if anything, larger), with and without
    --enable-overlap-schedule."""
    rows = []
    for batch in batches:
        for overlap in (False, True):
            config = SchedulerConfig(max_running_requests=batch, page_size=runner.page_size,
                                     max_total_tokens=(runner.num_pages - 1) * runner.page_size,
                                     chunked_prefill_size=batch * context, enable_overlap_schedule=overlap)
            engine = Engine(runner, config, publish=encode_step)
            limits = SubmitLimits(runner.vocab_size, runner.max_context, 256, tuple(runner.eos_token_ids), 1,
                                  max_total_tokens=config.max_total_tokens)
            for i in range(batch):
                engine.submit(parse_request(TokenizedRequest(
                    rid=f"o{i}", owner="bench", input_ids=random_prompt(i, context),
                    sampling=SamplingParams(max_new_tokens=4 * steps, ignore_eos=True),
                    logprob=LogprobParams(return_logprob=True, top_logprobs_num=k)), limits))

            def one_pass(engine: Engine = engine) -> None:
                engine.step()

            for _ in range(3):  # admission and prefill, the first decodes
                one_pass()
            rows.append(OverlapRow(shape, batch, k, overlap, timed(one_pass, runner.device, steps)))
            engine.scheduler.end_all(Outgoing(), "the benchmark is done")
    return rows
