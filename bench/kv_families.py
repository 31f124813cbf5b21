"""KV memory per model family: bytes per token and concurrent sessions at a 32k context in the same memory.

    python -m bench.kv_families      # seconds; no model weights (the shapes of published configs)

For each family's shape (the attention part of its published config.json: layers, KV heads, head width, sliding
window and which layers use it, or the MLA latent), the layer groups are built as the engine builds them
(model/architecture.py, kv/specs.py), then measured two ways:
- computed: what one token takes if every layer kept it, against what the pool takes for a session of 32k tokens
  (a window group keeps its window, the page it starts in and the one being filled; a latent is one vector);
- measured on the pool: the pool's tensors for a fixed memory (24 GiB of KV in bf16) are laid out on torch's meta
  device (kv/pool.py: their bytes without the memory), and sessions are prefilled into the KV manager (kv/manager.py)
  in chunks of 2048 tokens, a window group giving back its pages as it goes, until the next one does not fit.
The full-attention KV of the same layers is the baseline: the same shape with no window.
"""

import argparse

import torch
from transformers import PretrainedConfig

from bench.common import Progress, Table, fmt_bytes, fmt_ratio, write_results
from services.scheduler.kv.manager import KVManager, KVState
from services.scheduler.kv.pool import KVPool
from services.scheduler.kv.specs import KVLayout, LayerGroup, token_bytes
from services.scheduler.model.architecture import layout_of

CONTEXT, CHUNK, PAGE = 32768, 2048, 16
MEMORY = 24 * 2**30  # bytes of KV memory, bf16
DTYPE = torch.bfloat16


def alternating(layers: int, full_every: int) -> list[str]:
    """Sliding layers with every `full_every`-th one full (gpt-oss: 2, OLMo 3: 4, Gemma 3: 6)."""
    return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(layers)]


# The attention part of each family's published config.json.
SHAPES = {
    "Llama 3.1 8B": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "Mistral 7B v0.1": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            sliding_window=4096),
    "gpt-oss-20b": dict(num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        sliding_window=128, layer_types=alternating(24, 2)),
    "OLMo 3 7B": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                      sliding_window=4096, layer_types=alternating(32, 4)),
    "Gemma 3 27B": dict(num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                        sliding_window=1024, layer_types=alternating(62, 6)),
    "DeepSeek V3": dict(num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, head_dim=64,
                        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
}


class Session:
    """What the KV manager needs of a request: its tokens and its KV state."""

    owes_prompt_logprobs = False

    def __init__(self, length: int):
        self.length = length
        self.kv = KVState()

    def sequence(self):
        return range(self.length)


def groups_of(shape: dict) -> list[LayerGroup]:
    return layout_of("bench", PretrainedConfig(**shape), DTYPE).groups


def full_attention_token_bytes(shape: dict) -> int:
    """Keys and values of every layer for one token, as a full-attention cache keeps them (MLA: decompressed, each
    head's key of nope + rope width and value)."""
    if "kv_lora_rank" in shape:
        per_head = shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"] + shape["v_head_dim"]
        return shape["num_hidden_layers"] * shape["num_attention_heads"] * per_head * DTYPE.itemsize
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * DTYPE.itemsize


def in_pool(groups: list[LayerGroup]) -> tuple[int, int]:
    """(sessions of CONTEXT tokens the pool of MEMORY holds at once, the bytes one session holds), measured: the
    pool laid out on the meta device, sessions prefilled into the KV manager until the next does not fit."""
    page_bytes = token_bytes(groups) * PAGE
    pages = MEMORY // page_bytes + 1
    layout = KVLayout(groups, None, sum(len(group.layers) for group in groups))
    assert KVPool(layout, pages, PAGE, torch.device("meta")).bytes == (pages * page_bytes)
    kv = KVManager(pages, PAGE, tuple(group.window for group in groups), prefix_cache=False)
    sessions, one_session = 0, 0
    while True:
        session = Session(CONTEXT)
        for end in range(CHUNK, CONTEXT + 1, CHUNK):
            if kv.pages_needed(session, end) > kv.available:
                return sessions, one_session
            kv.allocate(session, end)
            kv.computed(session, end, commit=False)
        sessions += 1
        one_session = one_session or (kv.pages.usable - kv.pages.free) * page_bytes


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    progress = Progress(len(SHAPES), "kv_families")
    table = Table(f"KV memory per family shape at a {CONTEXT // 1024}k context, bf16, pages of {PAGE}",
                  ["family (shape)", "layers", "full-attention KV a token", "this KV a token at 32k",
                   f"sessions in {MEMORY // 2**30} GiB: full attention", "sessions: this KV", "ratio"],
                  "Full-attention KV: keys and values of every layer (MLA's decompressed). This KV: the pool's bytes "
                  "one 32k session holds, over 32k (window groups keep their window; MLA its latent). Sessions of "
                  "this KV: measured on the pool, prefilled into the KV manager until the next one does not fit.")
    data = {}
    for name, shape in SHAPES.items():
        progress.step(name)
        groups = groups_of(shape)
        sessions, session_bytes = in_pool(groups)
        baseline = full_attention_token_bytes(shape)
        full_sessions = MEMORY // (baseline * CONTEXT)
        per_token = session_bytes // CONTEXT
        data[name] = {"full_attention_bytes_per_token": baseline, "bytes_per_token_at_32k": per_token,
                      "sessions": sessions, "full_attention_sessions": full_sessions, "groups": len(groups)}
        table.add(name, shape["num_hidden_layers"], fmt_bytes(baseline), fmt_bytes(per_token), full_sessions,
                  sessions, fmt_ratio(sessions / full_sessions) if full_sessions else "-")
    print(write_results("kv_families", "python -m bench.kv_families", [table], data))


if __name__ == "__main__":
    main()
