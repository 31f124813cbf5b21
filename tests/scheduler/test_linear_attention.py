"""Hybrid linear attention (Qwen3.5 dense and MoE, its vision-language layout, Qwen3-Next), each a tiny random
checkpoint made here, against transformers' own forward: greedy tokens identical and logprobs within engine_run's
ATOL, in mixed batches of chunked prompts (and a prompt chunked at every size, from one token to whole, gives the
whole prompt's output: the chunked delta rule from each chunk's state, the recurrent one for decoding rows), after
retraction and resume, and on prefix-cache hits that resume the recurrent state from a checkpoint at a page
boundary: n samples of one prompt prefill it about once, a session's next turn prefills its new message and at most
a page more; checkpoints beyond their slots go least recently used first."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from tests.scheduler.engine_run import Run, check, run_and_check, tiny_checkpoint
from tests.scheduler.engine_run import prompts as tiny_prompts

VOCAB, PAGE = 512, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
              eos_token_id=None)  # no eos: the reference (generate with min_new_tokens) would hold it off
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
FAMILIES = {
    "qwen3_5": lambda: Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON)),
    "qwen3_5_moe": lambda: Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**MOE, **COMMON)),
    "qwen3_next": lambda: Qwen3NextForCausalLM(Qwen3NextConfig(**MOE, **COMMON)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint path, transformers' model) of one family."""
    return tiny_checkpoint(tmp_path_factory.mktemp(request.param), FAMILIES[request.param])


def prompts(seed: int, lengths: list[int]) -> dict[str, list[int]]:
    return tiny_prompts(seed, lengths, VOCAB)


@pytest.mark.parametrize("chunk", [3, 2048])
def test_mixed_batches_equal_transformers(family, chunk):
    path, reference = family
    run = Run(path, chunked_prefill_size=chunk)
    cases = prompts(0, [1, 5, 17, 40])
    run_and_check(run, reference, cases, 12)


def test_every_chunk_boundary_gives_the_whole_prompts_output(tmp_path):
    """A prompt of three pages prefilled in chunks of every size, from one token (the recurrent rule's shape) to all
    of it: each chunk starts from the state the one before left, and the output is the whole prompt's."""
    torch.manual_seed(0)
    FAMILIES["qwen3_5"]().save_pretrained(tmp_path)
    path = tmp_path
    ids = prompts(7, [11])["r0"]
    whole = Run(path)
    whole.submit("whole", ids, 3)
    whole.run()
    expected = whole.result("whole")
    for chunk in range(1, len(ids)):
        run = Run(path, chunked_prefill_size=chunk)
        run.submit("chunked", ids, 3)
        run.run()
        got = run.result("chunked")
        assert got["tokens"] == expected["tokens"], chunk
        np.testing.assert_allclose(got["token_logprobs"], expected["token_logprobs"], atol=1e-5, rtol=0)


def test_retracted_requests_resume_identical(family):
    path, reference = family
    run = Run(path, max_total_tokens=48)
    cases = prompts(1, [5, 6, 7, 9])
    for rid, ids in cases.items():
        run.submit(rid, ids, 30)
    run.run()
    assert run.engine.stats.retractions >= 1
    for rid, ids in cases.items():
        check(reference, ids, 30, run.result(rid))


def test_n_samples_of_a_prompt_prefill_it_about_once(family):
    """The first sample prefills the 41 tokens and leaves a checkpoint of the state after page 10 (40 tokens); the
    others find the pages and the checkpoint cached and compute one token each."""
    path, reference = family
    run = Run(path)
    ids = prompts(2, [41])["r0"]
    for n in range(8):
        run.submit(f"s{n}", ids, 6)
    run.run()
    for n in range(8):
        check(reference, ids, 6, run.result(f"s{n}"))
    assert run.engine.stats.prefill_tokens == 41 + 7 * 1 <= 1.3 * 41


def test_a_sessions_next_turn_prefills_its_new_message_and_at_most_a_page_more(family):
    path, reference = family
    run = Run(path)
    first = prompts(3, [30])["r0"]
    run.submit("turn-1", first, 10)
    run.run()
    answer = run.result("turn-1")["tokens"]
    second = first + answer + prompts(4, [8])["r0"]
    before = run.engine.stats.prefill_tokens
    run.submit("turn-2", second, 6)
    run.run()
    got = run.result("turn-2")
    check(reference, second, 6, got)
    computed = run.engine.stats.prefill_tokens - before
    assert got["finish"].cached_tokens == 36  # the last page boundary its decode crossed: a checkpoint there
    assert computed == len(second) - 36 <= 8 + PAGE


def test_checkpoints_beyond_their_slots_go_least_recently_used_first(family):
    """Two checkpoint slots, three prompts of one token's output (a checkpoint each, after their third page): the
    third one's takes the first one's slot. Asked again, the two latest resume from theirs; the first resumes
    nowhere (its pages are cached, its state is not) and computes its prompt again; every slot is free after a
    flush."""
    path, reference = family
    run = Run(path, state_checkpoints=2)
    cases = prompts(5, [13, 13, 13])
    for rid, ids in cases.items():
        run.submit(rid, ids, 1)
        run.run()
    hits = {}
    for rid in ("r2", "r1", "r0"):  # one token each again: no decode row crosses a page end to take a checkpoint
        run.submit(f"{rid}-again", cases[rid], 1)
        run.run()
        hits[rid] = run.result(f"{rid}-again")["finish"].cached_tokens
        check(reference, cases[rid], 1, run.result(f"{rid}-again"))
    assert hits == {"r2": 12, "r1": 12, "r0": 0}, hits
    states = run.engine.kv.states
    run.engine.kv.flush()
    assert states.free == states.checkpoints


def test_the_vision_language_layout_is_served_text_only(tmp_path):
    """Qwen3.5 as published: the vision-language checkpoint (its text model under model.language_model), which
    transformers loads for causal LM as Qwen3_5ForCausalLM."""
    text = Qwen3_5TextConfig(**COMMON)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision,
                                                  image_token_id=VOCAB - 3, video_token_id=VOCAB - 2,
                                                  vision_start_token_id=VOCAB - 1)).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reference).__name__ == "Qwen3_5ForCausalLM"
    run = Run(tmp_path, chunked_prefill_size=13)
    cases = prompts(6, [9, 40])
    run_and_check(run, reference, cases, 10)


def test_multi_token_prediction_weights_are_skipped_knowingly(tmp_path, caplog):
    """A checkpoint with Qwen3-Next's multi-token-prediction layer (mtp.*): not loaded (no speculative decoding
    here), said in the start log, and the model serves as transformers' does."""
    torch.manual_seed(0)
    FAMILIES["qwen3_next"]().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["mtp.fc.weight"] = torch.zeros(64, 128)
    weights["mtp.norm.weight"] = torch.ones(64)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with caplog.at_level("INFO", logger="services.scheduler.model.runner"):
        run = Run(tmp_path, own_runner=True)
    assert "2 of its tensors are not loaded" in caplog.text and "2 matching ^mtp.*" in caplog.text
    ids = prompts(8, [9])["r0"]
    run.submit("r", ids, 6)
    run.run()
    check(reference, ids, 6, run.result("r"))
