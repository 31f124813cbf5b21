"""The engine on an 8-bit KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) against a 32-bit one, on the default
model's shape (on the small vocabulary: tests/conftest.py small_model_dir): 64 greedy tokens the same but at
near-ties, and logprobs within LOGPROB_TOLERANCE; the pool's bytes a token half of bfloat16's and a quarter of
float32's; a checkpoint's k_scale and v_scale taken, and the Triton kernel and the CUDA-graph decode (both without
CUDA: interpreted, and eager) equal to the torch path on them; DeepSeek V3's latent and a hybrid model's attention
layers in 8 bits, its linear-attention state not."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from services.scheduler.kv.quantize import KVScales
from services.scheduler.model.runner import ModelRunner
from tests.scheduler.engine_run import ATOL, Run, prompt, prompts, tiny_checkpoint
from tests.scheduler.test_linear_attention import FAMILIES as HYBRID_FAMILIES
from tests.scheduler.test_model_families import FAMILIES, VOCAB

LOGPROB_TOLERANCE = 0.05
NEW_TOKENS = 64
PROMPTS = {f"p{seed}": prompt(seed, length) for seed, length in enumerate([5, 37, 100, 16, 64, 200])}


def generate(model_dir: Path, prompts: dict[str, list[int]], new_tokens: int, **options) -> dict[str, dict]:
    run = Run(model_dir, **options)
    for rid, ids in prompts.items():
        run.submit(rid, ids, new_tokens)
    run.run()
    return {rid: run.result(rid) for rid in prompts}


@pytest.fixture(scope="module")
def float_outputs(small_model_dir) -> dict[str, dict]:
    return generate(small_model_dir, PROMPTS, NEW_TOKENS)


def compare(reference: dict, got: dict) -> tuple[int, float]:
    """(the first position whose greedy token differs, the output's length if none; the largest logprob difference
    up to it: the chosen token's before it, the top-k values' up to it, a ranked row whatever its ids)."""
    differs = [i for i, (a, b) in enumerate(zip(reference["tokens"], got["tokens"])) if a != b]
    first = differs[0] if differs else len(reference["tokens"])
    chosen = np.abs(reference["token_logprobs"][:first] - got["token_logprobs"][:first])
    ranked = np.abs(reference["topk_values"][:first + 1] - got["topk_values"][:first + 1])
    return first, float(max(chosen.max(initial=0), ranked.max(initial=0)))


def check_near(references: dict[str, dict], outputs: dict[str, dict]) -> tuple[int, float]:
    """An 8-bit cache's outputs against a float cache's: logprobs within LOGPROB_TOLERANCE up to where the greedy
    tokens part, and parting only at a near-tie (the float cache's top two within the tolerance, the 8-bit cache
    choosing the second). (Outputs unchanged, the largest logprob difference.)"""
    largest, unchanged = 0.0, 0
    for rid, reference in references.items():
        first, difference = compare(reference, outputs[rid])
        largest = max(largest, difference)
        if first == len(reference["tokens"]):
            unchanged += 1
            continue
        top_two = reference["topk_values"][first]
        assert top_two[0] - top_two[1] < LOGPROB_TOLERANCE, (rid, first, top_two[:2])
        assert outputs[rid]["tokens"][first] == reference["topk_ids"][first][1], (rid, first)
    assert largest <= LOGPROB_TOLERANCE
    return unchanged, largest


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_an_8_bit_cache_keeps_the_greedy_output_and_its_logprobs(small_model_dir, float_outputs, kv_cache_dtype):
    """The default model has random weights: its next-token distribution is nearly flat, and some steps' top two
    tokens lie a few thousandths of a nat apart, where an 8-bit cache may pick the second."""
    unchanged, largest = check_near(float_outputs, generate(small_model_dir, PROMPTS, NEW_TOKENS,
                                                            kv_cache_dtype=kv_cache_dtype))
    print(f"{kv_cache_dtype}: {unchanged} of {len(PROMPTS)} outputs unchanged over {NEW_TOKENS} tokens; largest "
          f"logprob difference {largest:.4f}")


def test_an_8_bit_cache_takes_half_of_bfloat16s_bytes_and_a_quarter_of_float32s(small_model_dir):
    """4 layers x (keys, values) x 2 KV heads x 32 wide, at 2, 1 or 4 bytes a value."""
    pool_bytes = {}
    for dtype, kv_cache_dtype, stored, token_bytes in [
            ("bfloat16", "auto", torch.bfloat16, 1024), ("bfloat16", "fp8_e4m3", torch.float8_e4m3fn, 512),
            ("float32", "auto", torch.float32, 2048), ("float32", "fp8_e5m2", torch.float8_e5m2, 512)]:
        runner = ModelRunner(small_model_dir, "cpu", dtype, 0, 2, max_total_tokens=256,
                             kv_cache_dtype=kv_cache_dtype)
        assert runner.kv.keys(0).dtype == runner.kv.values(3).dtype == stored
        assert runner.kv_token_bytes == token_bytes
        pool_bytes[dtype, kv_cache_dtype] = runner.kv.bytes
    assert pool_bytes["bfloat16", "fp8_e4m3"] * 2 == pool_bytes["bfloat16", "auto"]
    assert pool_bytes["float32", "fp8_e5m2"] * 4 == pool_bytes["float32", "auto"]


def scaled_checkpoint(model_dir: Path, path: Path) -> list[KVScales]:
    """The default model with per-layer k_scale and v_scale beside its weights, as an fp8-calibrated checkpoint
    carries them (its keys reach about 4 and its values 1: each scale keeps them within e4m3's 448; powers of two,
    which float32 holds exactly)."""
    path.mkdir()
    for file in model_dir.iterdir():
        os.symlink(file, path / file.name)
    scales = [KVScales(2.0 ** -(6 - layer), 2.0 ** -(8 - layer)) for layer in range(4)]
    save_file({name: torch.tensor(value) for layer, scale in enumerate(scales) for name, value in (
        (f"model.layers.{layer}.self_attn.k_scale", scale.key), (f"model.layers.{layer}.self_attn.v_scale",
                                                                 scale.value))}, path / "kv_scales.safetensors")
    return scales


def test_checkpoint_scales_reach_the_torch_path_the_kernel_and_the_decode_graphs(small_model_dir, tmp_path):
    path = tmp_path / "scaled"
    scales = scaled_checkpoint(small_model_dir, path)
    cases = {rid: PROMPTS[rid] for rid in ("p1", "p3")}
    reference = generate(small_model_dir, cases, 12)
    on_torch = generate(path, cases, 12, kv_cache_dtype="fp8_e4m3")
    graphs = Run(path, kv_cache_dtype="fp8_e4m3", attention_backend="triton", enable_cuda_graph=True, own_runner=True)
    assert graphs.runner.kv.scales == scales
    for rid, ids in cases.items():
        graphs.submit(rid, ids, 12)
    graphs.run()
    assert graphs.runner.graphs is not None and graphs.runner.graphs.replays > 0
    for rid in cases:
        first, difference = compare(reference[rid], on_torch[rid])
        assert first == 12 and difference <= LOGPROB_TOLERANCE
        kernel = graphs.result(rid)
        assert kernel["tokens"] == on_torch[rid]["tokens"]
        np.testing.assert_allclose(kernel["token_logprobs"], on_torch[rid]["token_logprobs"], atol=ATOL, rtol=0)
        np.testing.assert_allclose(kernel["topk_values"], on_torch[rid]["topk_values"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_latents_and_hybrid_models_keep_their_pages_in_8_bits(tmp_path, family):
    """DeepSeek V3's latent and rope key (model/mla.py, over the checkpoint's k_scale) and Qwen3.5's full-attention
    layers in 8 bits; Qwen3.5's linear-attention state in the compute dtype (SGLang's --kv-cache-dtype leaves it
    alone too); their outputs near the float cache's as the default model's are."""
    path, _ = tiny_checkpoint(tmp_path / family, {**FAMILIES, **HYBRID_FAMILIES}[family])
    save_file({f"model.layers.{layer}.self_attn.k_scale": torch.tensor(2.0 ** -5) for layer in range(4)},
              path / "kv_scales.safetensors")
    cases = prompts(0, [5, 30], VOCAB)
    reference = generate(path, cases, 24)
    run = Run(path, kv_cache_dtype="fp8_e4m3")
    kv = run.runner.kv
    paged = sorted(kv.group_of)
    assert paged and all(kv.keys(layer).dtype == torch.float8_e4m3fn for layer in paged)
    assert all(kv.scales[layer] == KVScales(2.0 ** -5, 2.0 ** -5) for layer in paged)
    if kv.layout.states is not None:
        assert kv.layout.states.spec.dtype == run.runner.dtype == torch.float32
    for rid, ids in cases.items():
        run.submit(rid, ids, 24)
    run.run()
    unchanged, largest = check_near(reference, {rid: run.result(rid) for rid in cases})
    print(f"{family} fp8_e4m3: {unchanged} of {len(cases)} outputs unchanged; largest logprob difference "
          f"{largest:.4f}")
