"""--load-format dummy: the checkpoint's shape with random weights (benchmarks of shapes whose weights are not
here, as SGLang's and vLLM's flag)."""

import torch
from transformers import AutoModelForCausalLM

from services.scheduler.model.runner import ModelRunner


def test_dummy_weights_have_the_checkpoints_shapes_not_its_values(model_dir):
    checkpoint = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    runner = ModelRunner(model_dir, "cpu", "float32", 0, 2, max_total_tokens=256, load_format="dummy")
    dummy = runner.model.state_dict()
    assert {name: t.shape for name, t in dummy.items()} == {name: t.shape for name, t in checkpoint.items()}
    weight = "model.layers.0.mlp.down_proj.weight"
    assert dummy[weight].std() > 0 and not torch.equal(dummy[weight], checkpoint[weight])
