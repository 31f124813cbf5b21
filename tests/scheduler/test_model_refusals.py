"""What the engine cannot run is refused at load, in one line naming the model and the feature (and what is
supported), never on a first request; and a checkpoint published for remote code under a model type transformers
does not know (Kimi K2's `kimi_k2`) loads by the architecture it names."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from harness.procs import ROOT
from services.scheduler.model.architecture import UnsupportedModel
from services.scheduler.model.runner import ModelRunner
from tests.scheduler.engine_run import Run, check

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=256, eos_token_id=None)
DEEPSEEK = dict(num_hidden_layers=2, moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=4,
                num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                **{**TINY, "num_key_value_heads": 2, "head_dim": 8})


def saved(path, model, **config_changes):
    """The checkpoint of `model`, its config.json edited."""
    torch.manual_seed(0)
    model.save_pretrained(path)
    if config_changes:
        file = path / "config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config_changes}))
    return path


def load(path) -> ModelRunner:
    return ModelRunner(path, "cpu", "float32", 0, 2, 4, 256)


@pytest.mark.parametrize("make,changes,feature", [
    (lambda: Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, **TINY)),
     {"layer_types": ["chunked_attention", "full_attention"]},
     "layer type chunked_attention is not supported; this engine runs full_attention, sliding_attention, "
     "linear_attention layers"),
    (lambda: Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, **TINY)),
     {"layer_types": ["linear_attention", "full_attention"]}, "linear_attention layers that are not Gated DeltaNet"),
    (lambda: Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=2, **TINY)), {},
     "attention logit soft-capping (Gemma 2) (attn_logit_softcapping = 50.0)"),
    (lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK)), {"index_topk": 64},
     "sparse attention (DeepSeek V3.2's indexer)"),
    (lambda: Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, **TINY)),
     {"rope_parameters": {"rope_type": "spiral", "rope_theta": 10000.0}}, "rope type 'spiral' is not supported"),
    # A config transformers' own forward cannot run (DeepSeek's rope width against its head_dim): the engine's first
    # step, at load, finds it.
    (lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK)), {"head_dim": 24}, "a first step failed"),
])
def test_refused_at_load_by_name(tmp_path, make, changes, feature):
    path = saved(tmp_path / "model", make(), **changes)
    with pytest.raises(UnsupportedModel) as refused:
        load(path)
    assert str(refused.value).startswith(f"{path}: ") and feature in str(refused.value), refused.value


@pytest.mark.slow
def test_the_scheduler_says_it_in_one_line_and_exits(tmp_path):
    path = saved(tmp_path / "gemma2", Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=2, **TINY)))
    done = subprocess.run([sys.executable, "-m", "services", "scheduler", "--model", str(path), "--port", "0",
                           "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flatwire scheduler: ") and str(path) in last and "soft-capping" in last, \
        done.stderr[-2000:]


def test_kimi_k2_published_for_remote_code_loads_as_deepseek_v3(tmp_path):
    """Its weights as well: under model type kimi_k2 transformers would not fuse the checkpoint's per-expert
    tensors, and leave the experts random."""
    path = saved(tmp_path / "kimi", DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK)))
    reference = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # read as DeepSeek V3
    saved(path, reference, model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    run = Run(path)
    ids = np.random.default_rng(0).integers(3, 256, 11).tolist()
    run.submit("kimi", ids, 6)
    run.run()
    check(reference, ids, 6, run.result("kimi"))
