"""The paged engine against transformers: greedy outputs and logprobs (the sampled token's, top-k, the prompt's)
equal the reference model's across page boundaries, chunked prompts, full and partial prefix-cache hits, n samples
of one prompt, preemption and resume, and a weight update with a warm cache; on the default model and on a
second one of another shape (more layers, one KV head per four query heads: tests/scheduler/conftest.py).

The engine runs in process, stepped by the test (engine_run.Run).
"""

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from services.scheduler.engine.control import UpdateWeights
from services.scheduler.model.torch_attention import MAX_PADDING, _similar
from services.scheduler.model.weights import StagedWeights
from tests.scheduler.engine_run import Run, check, prompt


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


def test_streamed_output_coalesces_while_the_subscribers_are_behind(model):
    """A streaming request ships a token per step while its subscribers keep up, and holds up to
    --stream-coalesce-tokens while they are behind: the same tokens and rows, in fewer entries."""
    path, reference_model = model
    steps = iter(range(1000))
    run = Run(path, behind=lambda: next(steps) % 8 < 5, stream_coalesce_tokens=3)  # behind 5 steps of every 8
    ids = prompt(6, 6)
    run.submit("streamed", ids, 20, stream_interval=1)
    run.run()
    check(reference_model, ids, 20, run.result("streamed"))
    counts = [message.counts[i] for message in run.published for i, rid in enumerate(message.rids)
              if rid == "streamed"]
    assert sum(counts) == 20 and max(counts) == 3 and 1 in counts, counts


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
    run = Run(path, own_runner=True)
    ids = prompt(30, 21)
    run.submit("before", ids, 6)
    run.run()
    assert run.engine.kv.stats().pages_cached > 0
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
