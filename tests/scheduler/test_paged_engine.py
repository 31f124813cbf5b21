"""The paged engine against transformers: greedy outputs and logprobs (the sampled token's, top-k, the prompt's)
equal the reference model's across page boundaries, chunked prompts, full and partial prefix-cache hits, n samples
of one prompt, preemption and resume, and a weight update with a warm cache; on the default model and on a
second one of another shape (more layers, one KV head per four query heads).

The engine runs in process: its loop body one pass at a time (no thread, no gRPC), as test_rollout_control does.
"""

import shutil

import numpy as np
import pytest
import torch
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest
from flatwire_wire.steps import StepMessage
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from services.scheduler.config import SchedulerConfig
from services.scheduler.engine.control import UpdateWeights
from services.scheduler.engine.engine import Engine
from services.scheduler.model.attention import MAX_PADDING, _similar
from services.scheduler.model.runner import ModelRunner
from services.scheduler.model.weights import StagedWeights
from services.scheduler.submit import SubmitLimits, parse_request

K = 5
ATOL = 1e-4


@pytest.fixture(scope="module")
def gqa_model(model_dir, tmp_path_factory):
    """Random weights, 6 layers, 8 query heads over 2 KV heads of 16, the default model's vocabulary."""
    path = tmp_path_factory.mktemp("gqa-model")
    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=248077, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=[248046, 248044], pad_token_id=248044)
    Qwen3ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, path / name)
    return path


@pytest.fixture(scope="module", params=["default", "gqa"])
def model(request, model_dir, gqa_model):
    path = model_dir if request.param == "default" else gqa_model
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class Run:
    """An Engine on the model, stepped by the test; what it published, per request."""

    def __init__(self, model_dir, slots: int = 8, **options):
        options = {"page_size": 4, "max_total_tokens": 4096, **options}
        self.config = SchedulerConfig(max_running_requests=slots, **options)
        self.runner = ModelRunner(model_dir, "cpu", "float32", 0, slots, self.config.page_size,
                                  self.config.max_total_tokens)
        self.published: list[StepMessage] = []
        self.engine = Engine(self.runner, self.config, publish=self.published.append)
        self.limits = SubmitLimits(self.runner.vocab_size, self.runner.max_context, 16,
                                   tuple(self.runner.eos_token_ids), 50,
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


def test_page_boundaries_and_chunked_prompts(model):
    """Pages of 4 tokens, prompts chunked by 5 tokens: lengths around page and chunk boundaries, prompt logprobs
    gathered across chunks; streaming (a token per entry) or not."""
    path, reference_model = model
    run = Run(path, chunked_prefill_size=5)
    cases = {f"r{n}": (prompt(n, n), 9, 0 if n % 2 else -1) for n in (1, 3, 4, 5, 8, 13)}
    for rid, (ids, new_tokens, start) in cases.items():
        run.submit(rid, ids, new_tokens, start, stream_interval=1 if len(ids) > 4 else 0)
    run.run()
    for rid, (ids, new_tokens, start) in cases.items():
        check(reference_model, ids, new_tokens, run.result(rid), start)


def test_prefix_cache_full_and_partial_hits(model):
    """A prompt, then the same prompt (a full hit but its last token), then it with more tokens (a partial hit), then
    a prompt sharing a page with it, and prompt logprobs from a late position (the hit stops before it)."""
    path, reference_model = model
    run = Run(path)
    base = prompt(7, 22)
    cases = [("first", base, -1, 0), ("again", base, -1, 20), ("longer", base + prompt(8, 9), -1, 20),
             ("sibling", base[:5] + prompt(9, 10), -1, 4), ("late-logprobs", base, 17, 16)]
    for rid, ids, start, cached in cases:
        run.submit(rid, ids, 6, start)
        run.run()
        got = run.result(rid)
        check(reference_model, ids, 6, got, start)
        assert got["finish"].cached_tokens == cached, rid
    assert run.engine.stats.cached_prompt_tokens == 60


def test_n_samples_of_a_prompt_prefill_it_once(model):
    path, reference_model = model
    run = Run(path)
    ids = prompt(11, 40)
    for n in range(4):
        run.submit(f"s{n}", ids, 5)
    run.run()
    for n in range(4):
        check(reference_model, ids, 5, run.result(f"s{n}"))
    # The first computes 40 tokens; the others find 36 (9 full pages) cached and compute the last 4.
    assert run.engine.stats.prefill_tokens == 40 + 3 * 4


def test_preempted_requests_resume_identical(model):
    """A KV memory of 12 pages of 4 tokens for requests of 20 to 40 tokens: decoding runs out of pages, the newest
    requests are retracted and resumed by a prefill of prompt and output so far; every output (tokens and
    logprobs) equals the reference."""
    path, reference_model = model
    run = Run(path, max_total_tokens=48)
    cases = {f"p{n}": prompt(20 + n, 6 + 4 * n) for n in range(4)}
    for rid, ids in cases.items():
        run.submit(rid, ids, 14)
    run.run()
    assert run.engine.stats.retractions >= 1
    for rid, ids in cases.items():
        check(reference_model, ids, 14, run.result(rid))


def test_a_weight_update_never_serves_kv_of_the_old_weights(model):
    path, _ = model
    run = Run(path)
    ids = prompt(30, 21)
    run.submit("before", ids, 6)
    run.run()
    assert run.engine.prefix_cache.nodes > 0
    new_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in new_model.parameters():
            parameter.mul_(1.25)
    new, served = new_model.state_dict(), run.runner.model.state_dict(keep_vars=True)
    staged = StagedWeights([(tensor, new[name]) for name, tensor in served.items()], "scaled")
    update = UpdateWeights(staged=staged, abort_all_requests=False, weight_version="v2")
    run.engine.control(update)
    run.submit("after", ids, 6)
    run.run()
    assert update.done.result().success
    got = run.result("after")
    assert got["finish"].cached_tokens == 0  # the cache was flushed with the update
    check(new_model, ids, 6, got)


def test_rows_of_similar_size_share_an_attention_call():
    """One SDPA call per group of rows: similar rows are one call; a long context among short ones is its own,
    rather than the length every row is padded to."""
    one_query = np.ones(32, dtype=np.int64)
    uniform = _similar(np.arange(32), one_query, np.full(32, 64))
    assert [len(g) for g in uniform] == [32]
    mixed = _similar(np.arange(32), one_query, np.array([16] * 31 + [512]))
    assert [sorted(g.tolist()) for g in mixed] == [[31], list(range(31))]
    spread = _similar(np.arange(32), one_query, np.arange(1, 33))
    for group in spread:  # padded to the group's most pages: within MAX_PADDING of what the rows need
        assert len(group) * (group.max() + 1) <= MAX_PADDING * (group + 1).sum()
