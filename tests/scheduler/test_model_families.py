"""Model families with sliding windows, attention sinks and latent attention (Mistral, Gemma 3, OLMo 3, gpt-oss,
DeepSeek V3), each a tiny random checkpoint made here, against transformers' own forward: greedy tokens identical
and logprobs within engine_run's ATOL, across chunked prefills and window edges, in batches that mix prefill and
decode of different lengths, on a prefix-cache hit, after retraction and resume; and a window group gives back the
pages its window has left."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    SiglipVisionConfig,
)

from services.scheduler.kv.prefix_cache import DROPPED
from tests.scheduler.engine_run import Run, check, run_and_check, tiny_checkpoint
from tests.scheduler.engine_run import prompts as tiny_prompts

VOCAB, WINDOW, PAGE = 512, 16, 4
# No eos: the reference (transformers' generate with min_new_tokens) would hold it off where the engine, ignoring
# eos, samples it.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, eos_token_id=None, bos_token_id=2, pad_token_id=0)
SLIDING_THEN_FULL = ["sliding_attention"] * 3 + ["full_attention"]
FAMILIES = {
    # No layer_types: Mistral's config window applies to every layer.
    "mistral": lambda: MistralForCausalLM(MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **COMMON)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=4, sliding_window=WINDOW,
                                                         query_pre_attn_scalar=16, layer_types=SLIDING_THEN_FULL,
                                                         **COMMON)),
    "olmo3": lambda: Olmo3ForCausalLM(Olmo3Config(num_hidden_layers=4, sliding_window=WINDOW,
                                                  layer_types=SLIDING_THEN_FULL, **COMMON)),
    # Sinks, a MoE, yarn rope, and sliding and full layers alternating.
    "gpt_oss": lambda: GptOssForCausalLM(GptOssConfig(
        num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], rope_parameters={"rope_type": "default"},
        **{**COMMON, "intermediate_size": 64})),
    # Multi-head latent attention (the KV memory keeps the latent), a dense first layer, then a grouped MoE.
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        num_hidden_layers=3, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, **{**COMMON, "num_key_value_heads": 4, "head_dim": 8})),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint path, transformers' model) of one family."""
    return tiny_checkpoint(tmp_path_factory.mktemp(request.param), FAMILIES[request.param])


def prompts(seed: int, lengths: list[int]) -> dict[str, list[int]]:
    return tiny_prompts(seed, lengths, VOCAB)


def test_mixed_batches_and_chunked_prefills_equal_transformers(family):
    """Prompts shorter than, at and past the window, chunked by 13 (across window and page edges), admitted
    together and decoding past the window."""
    path, reference = family
    run = Run(path, chunked_prefill_size=13)
    cases = prompts(0, [5, WINDOW, WINDOW + 1, 40])
    run_and_check(run, reference, cases, 24)


def test_a_prefix_cache_hit_equals_transformers(family):
    path, reference = family
    run = Run(path)
    ids = prompts(1, [41])["r0"]
    for rid in ("first", "again", "longer"):
        run.submit(rid, ids + ([7, 8, 9] if rid == "longer" else []), 10)
        run.run()
    assert run.result("again")["finish"].cached_tokens == 40  # every full page: the window's are held
    assert run.result("longer")["finish"].cached_tokens == 40
    check(reference, ids, 10, run.result("again"))
    check(reference, ids + [7, 8, 9], 10, run.result("longer"))


def test_retracted_requests_resume_identical(family):
    path, reference = family
    run = Run(path, max_total_tokens=48)  # short prompts are admitted together, then outgrow the memory
    cases = prompts(2, [5, 6, 7, 9])
    for rid, ids in cases.items():
        run.submit(rid, ids, 30)
    run.run()
    assert run.engine.stats.retractions >= 1
    for rid, ids in cases.items():
        check(reference, ids, 30, run.result(rid))


def test_a_window_group_gives_back_the_pages_its_window_left(family):
    """While a request decodes far past the window, each window group holds only the pages its next query sees (the
    window, the page it starts in and the one being filled); full-attention groups hold every page."""
    path, reference = family
    run = Run(path, disable_radix_cache=True)
    ids = prompts(3, [30])["r0"]
    run.submit("long", ids, 60)
    windows = run.engine.kv.windows
    most = WINDOW // PAGE + 2
    for _ in range(100):
        run.step()
        if not run.engine.scheduler.requests:
            break
        for request in run.engine.scheduler.running:
            for window, table in zip(windows, request.kv.tables):
                held = sum(page != DROPPED for page in table)
                assert held <= most if window else held == len(table), (window, table)
    check(reference, ids, 60, run.result("long"))
    assert run.engine.kv.pages.free == run.engine.kv.pages.usable  # nothing leaked


def test_a_vision_language_checkpoint_is_served_text_only(tmp_path):
    """Gemma 3 as published: the vision-language class (its text model under model.language_model, the config's
    text part under text_config, no eos at the top) serves text, equal to transformers' own forward."""
    text = Gemma3TextConfig(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=16,
                            layer_types=SLIDING_THEN_FULL, **COMMON)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                 mm_tokens_per_image=4, image_token_index=VOCAB - 3,
                                                 boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 1)
                                   ).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reference).__name__ == "Gemma3ForConditionalGeneration"
    run = Run(tmp_path, chunked_prefill_size=13)
    cases = prompts(4, [9, 40])
    run_and_check(run, reference, cases, 12)
