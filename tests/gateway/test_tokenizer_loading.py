"""services.common.tokenizer: the tokenizer AutoTokenizer would give, without importing torch where the
checkpoint's class is the generic one."""

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from services.common.tokenizer import load_tokenizer

TEXTS = ["Hello world", "a\n\n  b\t", "你好，世界 <think>x</think> <|im_end|>", "<tool_call>{\"a\": 1}</tool_call>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Today's weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_the_default_models_tokenizer_is_autotokenizers(model_dir):
    ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(auto)
    assert (len(ours), ours.all_special_ids, ours.eos_token_id) == (len(auto), auto.all_special_ids, auto.eos_token_id)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    rendered = [t.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
                for t in (ours, auto)]
    assert rendered[0] == rendered[1] and "weather" in rendered[0]


def test_the_gateway_loads_it_without_torch(model_dir):
    script = ("import sys\nimport services.gateway.server\nfrom services.common.tokenizer import load_tokenizer\n"
              f"assert load_tokenizer({str(model_dir)!r}).encode('hi')\n"
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _naming(model_dir, tmp_path, tokenizer_class: str):
    """A copy of the default model's tokenizer files whose tokenizer_config.json names `tokenizer_class`."""
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text()) | {"tokenizer_class": tokenizer_class}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name", ["PreTrainedTokenizerFast", "Qwen2Tokenizer"])
def test_other_class_names(model_dir, tmp_path, name):
    """The generic class's other name loads it directly; a model-specific class goes through AutoTokenizer."""
    ours = load_tokenizer(_naming(model_dir, tmp_path, name))
    assert type(ours).__name__ == ("Qwen2Tokenizer" if name == "Qwen2Tokenizer" else "TokenizersBackend")
