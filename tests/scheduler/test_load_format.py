"""How the runner builds the model: --load-format dummy (the checkpoint's shape with random weights, for
benchmarks of shapes whose weights are not here, as SGLang's and vLLM's flag), and --dtype auto."""

import torch
from transformers import AutoModelForCausalLM

from services.scheduler.model.runner import ModelRunner, pick_dtype


def test_dummy_weights_have_the_checkpoints_shapes_not_its_values(small_model_dir):
    checkpoint = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32).state_dict()
    runner = ModelRunner(small_model_dir, "cpu", "float32", 0, 2, max_total_tokens=256, load_format="dummy")
    dummy = runner.model.state_dict()
    assert {name: t.shape for name, t in dummy.items()} == {name: t.shape for name, t in checkpoint.items()}
    weight = "model.layers.0.mlp.down_proj.weight"
    assert dummy[weight].std() > 0 and not torch.equal(dummy[weight], checkpoint[weight])


def test_cuda_runs_half_precision_unless_told_otherwise():
    """--dtype auto: bfloat16 on CUDA for a float32 checkpoint or one that names no dtype, float16 kept; float32
    on the CPU; an explicit --dtype wins everywhere."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert pick_dtype("auto", cuda, "float32") is torch.bfloat16
    assert pick_dtype("auto", cuda, None) is torch.bfloat16
    assert pick_dtype("auto", cuda, torch.float16) is torch.float16
    assert pick_dtype("auto", cpu, "bfloat16") is torch.float32
    assert pick_dtype("float32", cuda, "bfloat16") is torch.float32
