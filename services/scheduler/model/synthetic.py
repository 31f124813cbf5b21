"""A stand-in for the model: no weights, deterministic tokens at a fixed step time.

`flatwire scheduler --engine synthetic --step-ms X` serves the same messages and
shapes as the real model (the checkpoint's vocabulary size, eos ids and context
length, read from its config files) so that the detokenizer, the gateway and their
clients can be measured at a chosen token rate without a GPU: a step starts every
`step_ms` (the engine's own work between steps counts in it, as a GPU step's host
work does), or as soon as the previous one ends when that takes longer.

A request's next token is a function of (its seed or 0, its position), drawn from an
English paragraph encoded with the model's tokenizer, and is never an eos id:
requests run to max_new_tokens. Nothing else in its sampling parameters changes that:
temperature, top-p/k/min-p, penalties, logit_bias and a structured-output constraint
(validated and compiled as for the model, then not applied) are ignored. Logprobs are
cheap constants: the chosen token is always the best of a fixed, descending top-k row; a
top-p replay nucleus is the chosen token alone (its draw is a greedy one).
"""

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from flatwire_wire.logprobs import LogprobRows
from flatwire_wire.nucleus import Nuclei

from services.common.tokenizer import load_tokenizer
from services.scheduler.kv.pool import DEFAULT_CPU_TOKENS
from services.scheduler.model.architecture import load_config
from services.scheduler.model.lora import LoraLayers
from services.scheduler.model.routed_experts import ExpertRouting
from services.scheduler.model.runner import model_max_context
from services.scheduler.step import Batch, BatchRow, DoneStep, StepResult

log = logging.getLogger(__name__)

PARAGRAPH = (
    "The river runs past the old mill and under the stone bridge, where children throw bread to the ducks "
    "on summer afternoons. In the evening the lamps along the quay come on one by one, and the boats rock "
    "gently against their moorings while fishermen mend their nets and talk about the weather, the price of "
    "coffee, and the football results. A train crosses the valley every hour; its whistle echoes from the "
    "hills, and the dogs of the village answer it. Nobody here is in a hurry, yet the bakery opens at six, "
    "the post arrives at nine, and by noon the market square is full of vegetables, flowers and cheese."
)
SEED_STRIDE = 7919  # seeds start at different places in the paragraph
OTHER_LOGPROB = -20.0  # token_ids_logprob entries and prompt tokens


def _eos_ids(model_dir: Path, config) -> list[int]:
    generation = model_dir / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    eos = config.eos_token_id if eos is None else eos
    return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


class SyntheticRunner:
    """The model's shapes and messages without its weights; its KV memory is only the pages the policy counts."""

    def __init__(self, model_dir: Path, context_length: int, max_top_logprobs: int, step_ms: float,
                 page_size: int = 16, max_total_tokens: int = 0):
        config = load_config(model_dir).get_text_config()
        self.vocab_size = int(config.vocab_size)
        self.eos_token_ids = _eos_ids(model_dir, config)
        self.max_context = min(context_length or model_max_context(config), model_max_context(config))
        self.page_size = page_size
        self.kv_windows: tuple[int, ...] = (0,)  # one group of pages, which the policy counts
        self.state_slots: tuple[int, int] | None = None
        self.state_bytes = 0
        self.kv_layers = "synthetic: no model layers"
        self.num_pages = (max_total_tokens or DEFAULT_CPU_TOKENS) // page_size + 1
        self.expert_routing: ExpertRouting | None = None  # no model, no routers
        self.lora: LoraLayers | None = None  # no model to adapt
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.step_s = step_ms / 1e3
        self._next_step_at = 0.0  # time.perf_counter() at which the next step may return
        ids = np.array(load_tokenizer(model_dir).encode(PARAGRAPH, add_special_tokens=False))
        ids = ids[~np.isin(ids, self.eos_token_ids) & (ids < self.vocab_size)]
        # Top-k candidates: the paragraph's distinct ids in order of appearance, then other ids up to k + 1.
        unique, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        order = np.argsort(first)
        rank = np.empty(len(unique), dtype=np.int64)
        rank[order] = np.arange(len(unique))
        others = np.setdiff1d(np.arange(self.vocab_size), np.concatenate([unique, self.eos_token_ids]))
        missing = max(0, max_top_logprobs + 1 - len(unique))
        self.candidates = np.concatenate([unique[order], others[:missing]]).astype(np.int32)
        self.text = rank[inverse]  # the paragraph as indices into candidates
        self.values = (-0.25 - np.log(np.arange(1, max_top_logprobs + 2))).astype(np.float32)  # best first
        # Row i: the k + 1 candidates from candidate i on (a view, no copy), so that a step's ids are one row gather.
        doubled = np.concatenate([self.candidates, self.candidates])
        self.windows = np.lib.stride_tricks.sliding_window_view(doubled, len(self.values))[:len(self.candidates)]
        log.info("synthetic engine (no weights) for %s: %g ms per step, vocab %d, context %d, %d KV pages of %d",
                 model_dir, step_ms, self.vocab_size, self.max_context, self.num_pages - 1, page_size)

    def _ids(self, first: np.ndarray, k: int) -> np.ndarray:
        """[len(first), k] distinct candidate ids, row i starting at candidate first[i]."""
        return self.windows[first % len(self.candidates), :k]

    def step(self, batch: Batch) -> StepResult:
        rows = [row.request for row in batch.sampling]
        # The new token's position is the sequence length so far (prompt + generated).
        where = np.array([((r.sampling.seed or 0) * SEED_STRIDE + r.length) % len(self.text) for r in rows],
                         dtype=np.int64)
        chosen = self.text[where]
        result = StepResult(next_ids=self.candidates[chosen],
                            prompt=[self._prompt_rows(row) for row in batch.rows if len(row.prompt_positions)])
        if replayed := [i for i, r in enumerate(rows) if r.return_top_p_token_ids]:
            result.top_p = Nuclei.of_sizes(np.ones(len(replayed), np.int32), result.next_ids[replayed])
        if any(r.return_logprob for r in rows):
            k = max(r.top_logprobs_num for r in rows)
            m = max(len(r.token_ids_logprob) for r in rows)
            # Constant rows as read-only broadcast views: the engine copies what it keeps of a step's rows.
            result.output = LogprobRows(np.broadcast_to(self.values[0], len(rows)),
                                        np.broadcast_to(self.values[:k], (len(rows), k)), self._ids(chosen, k),
                                        np.broadcast_to(np.float32(OTHER_LOGPROB), (len(rows), m)))
        now = time.perf_counter()
        if self._next_step_at > now:
            time.sleep(self._next_step_at - now)
        self._next_step_at = max(now, self._next_step_at) + self.step_s
        return result

    def launch(self, batch: Batch) -> DoneStep:
        return DoneStep(self.step(batch))

    def memory_moved(self) -> None:
        """Nothing holds the stand-in's memory."""

    def _prompt_rows(self, row: BatchRow) -> LogprobRows[np.ndarray]:
        """Rows for the prompt positions the row computes."""
        positions = np.arange(row.prompt_positions.start, row.prompt_positions.stop)
        k, m = row.request.top_logprobs_num, len(row.request.token_ids_logprob)
        return LogprobRows(np.full(len(positions), OTHER_LOGPROB, dtype=np.float32),
                           np.tile(self.values[:k], (len(positions), 1)), self._ids(positions, k),
                           np.full((len(positions), m), OTHER_LOGPROB, dtype=np.float32))
