"""Loads the model and runs one flattened forward per step.

The model is any local Hugging Face causal LM whose attention goes through
transformers' AttentionInterface and whose layers the engine implements
(model/architecture.py). Its attention is switched to `model/attention.py`, and KV lives
in our paged pool (kv/pool.py) rather than a transformers Cache, so requests can join and
leave between steps without padding, and share the pages of a common prefix.
"""

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from services.scheduler.kv.manager import FRESH
from services.scheduler.kv.pool import KVPool, pool_pages
from services.scheduler.kv.quantize import is_float8, storage_dtype
from services.scheduler.kv.specs import token_bytes
from services.scheduler.model.architecture import (
    UnsupportedModel,
    describe,
    layout_of,
    load_config,
    route_layers,
    unused_tensors,
)
from services.scheduler.model.attention import ATTENTION_NAME, PagedBatch, PageTable, check_backend
from services.scheduler.model.batch_step import LaunchedStep, launch_step
from services.scheduler.model.gated_delta_kernels import gated_delta_kernels
from services.scheduler.model.kv_scales import read_kv_scales
from services.scheduler.model.linear_attention import StateRows, state_rows
from services.scheduler.model.lora import LoraLayers
from services.scheduler.model.routed_experts import ExpertRouting, router_top_k
from services.scheduler.parallel.calls import Forward
from services.scheduler.parallel.sharding import Sharding
from services.scheduler.sampling.sampler import Sampler
from services.scheduler.step import Batch, StepResult

if TYPE_CHECKING:
    from services.scheduler.model.cuda_graphs import DecodeGraphs
    from services.scheduler.parallel.group import RankGroup

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 4096  # of a config that states none
DUMMY_SEED = 0  # --load-format dummy's random weights
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, checkpoint_dtype) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half precision matmuls are slow and lossy on CPU
    if isinstance(checkpoint_dtype, str):  # configs may store the name
        checkpoint_dtype = DTYPES.get(checkpoint_dtype)
    # A half-precision checkpoint runs as stored; a float32 one, or one that says nothing, in bfloat16 (as
    # vLLM's and SGLang's auto run float32 checkpoints in half precision).
    return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def eos_token_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:  # a vision-language checkpoint's is its text model's
        eos = getattr(model.config.get_text_config(), "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def model_max_context(config) -> int:
    return int(getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_CONTEXT)


class ModelRunner:
    def __init__(self, model_dir: Path, device: str, dtype: str, context_length: int, max_running: int,
                 page_size: int = 16, max_total_tokens: int = 0, mem_fraction_static: float = 0.85,
                 logits_chunk_rows: int = 256, routed_experts: bool = False, attention_backend: str = "torch",
                 cuda_graph_max_bs: int = 0, load_format: str = "auto", state_checkpoints: int = 0,
                 kv_cache_dtype: str = "auto", lora: tuple[frozenset[str], int, int] | None = None,
                 ranks: "RankGroup | None" = None, linear_attention_backend: str = "torch"):
        """`routed_experts`: record the experts a MoE model routes each token to (--enable-return-routed-experts);
        `attention_backend`: model/attention.py's BACKENDS; `cuda_graph_max_bs`: decode batches up to this many rows
        replay CUDA graphs (model/cuda_graphs.py), 0: none; `load_format` "dummy": random weights (the
        checkpoint's config alone), else the checkpoint's; `state_checkpoints`: a linear-attention model's state
        checkpoints for the prefix cache (0: `max_running`); `kv_cache_dtype`: what the KV pages store
        (kv/quantize.py: auto, fp8_e4m3, fp8_e5m2); `lora`: (target module names, adapters per step, largest rank)
        of LoRA adapters to serve (model/lora.py), None: none; `ranks`: this process's tensor-parallel rank and the
        others (parallel/): the model is cut into its share, and rank 0 tells the others each step's rows;
        `linear_attention_backend`: what computes Gated DeltaNet layers (model/gated_delta_kernels.py's BACKENDS)."""
        self.logits_chunk_rows = logits_chunk_rows
        self.name = str(model_dir)
        self.device = pick_device(device)
        self.attention_backend = check_backend(attention_backend, self.device)
        linear_kernels = gated_delta_kernels(linear_attention_backend, self.device)
        config = load_config(model_dir)
        text_config = config.get_text_config()
        self.dtype = pick_dtype(dtype, self.device, getattr(text_config, "dtype", None))
        kv_dtype = storage_dtype(kv_cache_dtype, self.dtype)
        self.ranks = ranks
        tp_size = ranks.size if ranks is not None else 1
        if tp_size > 1 and (lora is not None or cuda_graph_max_bs):
            raise ValueError(f"--tp-size {tp_size}: not with --enable-lora or --enable-cuda-graph yet")
        # before the weights: a refusal is quick
        layout = layout_of(self.name, text_config, self.dtype, kv_dtype, tp_size)
        groups = layout.groups
        if load_format == "dummy":  # random weights built on the device, the config alone (benchmarks)
            torch.manual_seed(DUMMY_SEED)  # the same random model on every tensor-parallel rank, and every start
            with self.device:
                model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, attn_implementation=ATTENTION_NAME)
        else:
            transformers_logging.disable_progress_bar()  # a bar of carriage returns in the service's log
            model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=self.dtype,
                                                         attn_implementation=ATTENTION_NAME)
        self.sharding = None
        if ranks is not None:  # cut before the move: a rank's device holds its share alone
            self.sharding = Sharding.plan(self.name, model, ranks.rank, ranks.size)
            self.sharding.apply(model, ranks.devices)
        # transformers declares PreTrainedModel.to with functools.wraps(nn.Module.to), which mypy reads as unbound
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        route_layers(self.name, self.model, layout, self.attention_backend, linear_kernels)
        if load_format != "dummy" and (unused := unused_tensors(model_dir, self.model)):
            matching = ", ".join(f"{count} matching {pattern}" for pattern, count in unused.items())
            log.info("%s: %s of its tensors are not loaded, as its model class declares (%s): multi-token prediction "
                     "layers (no speculative decoding here) or a vision tower (text only)", model_dir,
                     sum(unused.values()), matching)
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.vocab_size = int(text_config.vocab_size)
        self.eos_token_ids = eos_token_ids(self.model)
        self.max_context = min(context_length or model_max_context(text_config), model_max_context(text_config))
        self.query_group = text_config.num_attention_heads // tp_size // groups[0].spec.page_shape[0]
        self.kv_windows = layout.windows
        self.state_slots = (max_running, state_checkpoints or max_running) if layout.states is not None else None
        self.state_bytes = layout.states.slot_bytes if layout.states is not None else 0
        self.kv_layers = describe(layout)
        slots = sum(self.state_slots) if self.state_slots else 0
        self.kv_token_bytes = per_token = token_bytes(groups)
        self.page_size = page_size
        self.num_pages = pool_pages(max_total_tokens, page_size, layout, self.device, mem_fraction_static, slots)
        if ranks is not None:  # the page tables are rank 0's, the same on every rank
            self.num_pages = ranks.agree_min(self.num_pages)
        scales = read_kv_scales(model_dir, layout.num_layers) if is_float8(kv_dtype) and load_format != "dummy" \
            else None
        self.kv = KVPool(layout, self.num_pages, page_size, self.device, state_slots=slots,
                         routed_top_k=router_top_k(self.model) if routed_experts else 0, scales=scales)
        self.expert_routing = ExpertRouting(self.model, self.kv) if routed_experts else None
        self.lora = LoraLayers(self.model, *lora) if lora is not None else None
        self.sampler = Sampler(max_running, self.vocab_size, self.device)
        self.graphs = self._decode_graphs(min(cuda_graph_max_bs, max_running), int(text_config.hidden_size))
        self._check_a_step()
        states = f"; {slots} linear-attention state slots of {self.state_bytes} bytes" if layout.states else ""
        log.info("loaded %s on %s (%s), vocab %d, context %d; KV memory %d pages of %d tokens (%.2f GiB, pages in "
                 "%s, %d bytes a page slot%s; %s)", model_dir, self.device, str(self.dtype).removeprefix("torch."),
                 self.vocab_size, self.max_context, self.num_pages - 1, page_size, self.kv.bytes / 2**30,
                 str(kv_dtype).removeprefix("torch."), per_token, states, self.kv_layers)

    def _decode_graphs(self, max_batch: int, hidden_size: int) -> "DecodeGraphs | None":
        if not max_batch:
            return None
        if self.attention_backend != "triton":
            raise ValueError("--enable-cuda-graph: decode graphs attend with the Triton kernel; add "
                             "--attention-backend triton")
        if self.lora is not None:
            raise ValueError("--enable-cuda-graph: not with --enable-lora (its matmuls run outside the graphs)")
        if self.expert_routing is not None:
            raise ValueError("--enable-cuda-graph: not with --enable-return-routed-experts (its recording runs on "
                             "the host, per step)")
        if len(self.kv.groups) > 1 or self.kv.layout.states is not None:
            raise ValueError("--enable-cuda-graph: decode graphs hold one page table per row and attend only, and "
                             f"this model's layers are {describe(self.kv.layout)}")
        from services.scheduler.model.cuda_graphs import DecodeGraphs  # imports triton

        # Off CUDA only the interpreted kernels get here (check_backend): the tests, which run graphs eagerly.
        return DecodeGraphs(self._decode, self.kv, hidden_size, self.dtype, self.query_group,
                            -(-self.max_context // self.page_size), max_batch, self.device,
                            capture=self.device.type == "cuda")

    def memory_moved(self) -> None:
        """The weights' or the KV memory's tensors were replaced (an update, a release and resume)."""
        if self.graphs is not None:
            self.graphs.forget()

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(self.device, non_blocking=True)

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, paged: PagedBatch) -> torch.Tensor:
        """Final hidden states [T, hidden] of flat token ids at positions [T]."""
        out = self.decoder(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            # A mask mapping tells transformers the masks are handled (by our attention).
            attention_mask={"full_attention": None, "sliding_attention": None, "linear_attention": None},
            use_cache=False,
            paged_batch=paged,
        )
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def forward(self, batch: Batch, input_ids: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's tokens."""
        tables = [[row.request.kv.tables[group] for row in batch.rows] for group in range(len(self.kv.groups))]
        if self.graphs is not None and len(input_ids) == len(batch.rows) and self.graphs.holds(len(batch.rows)):
            return self.graphs.run(input_ids, positions, tables[0])  # every row decodes: one token each
        starts = np.array([row.start for row in batch.rows], dtype=np.int64)
        ends = np.array([row.end for row in batch.rows], dtype=np.int64)
        states = None
        if self.state_slots is not None:
            kvs = [row.request.kv for row in batch.rows]
            states = state_rows([row.request.slot for row in batch.rows], starts, ends - starts,
                                [kv.restore for kv in kvs], [kv.capture for kv in kvs], self.page_size)
        if self.ranks is not None:  # rank 0: every rank runs the same rows on its share
            needed = (-(-ends // self.page_size)).tolist()  # the pages each row's context reaches
            call = Forward([[np.asarray(table[:count], dtype=np.int64) for table, count in zip(group, needed)]
                            for group in tables], starts, ends, input_ids, positions, states)
            self.ranks.tell(call)
            return self.forward_rows(call)
        if self.lora is None:
            return self._forward_rows(tables, starts, ends, input_ids, positions, states)
        self.lora.prepare([row.request.adapter for row in batch.rows], ends - starts)
        try:
            return self._forward_rows(tables, starts, ends, input_ids, positions, states)
        finally:
            self.lora.finish()

    @torch.inference_mode()
    def forward_rows(self, call: Forward) -> torch.Tensor:
        """A tensor-parallel rank's forward over the rows rank 0 told (no LoRA: refused)."""
        return self._forward_rows(call.tables, call.starts, call.ends, call.input_ids, call.positions, call.states)

    def _forward_rows(self, tables: Sequence[Sequence[PageTable]], starts: np.ndarray,
                      ends: np.ndarray, input_ids: np.ndarray, positions: np.ndarray,
                      states: StateRows | None) -> torch.Tensor:
        paged = PagedBatch.build(self.kv, tables, starts, ends, self.device, self.attention_backend, self.query_group,
                                 states)
        routing = self.expert_routing
        with routing.recording(tables[routing.group], starts, ends) if routing else nullcontext():
            return self._decode(self._tensor(input_ids), self._tensor(positions), paged)

    @torch.inference_mode()
    def _check_a_step(self) -> None:
        """Run one prefill of two tokens in the padding page before serving, so that a model the engine cannot run
        fails at start, naming its model, rather than on its first request."""
        try:
            tables = [[[0, 0]] for _ in self.kv.groups]
            starts, ends = np.array([0]), np.array([2])
            states = state_rows([0], starts, ends - starts, [FRESH], [None], self.page_size) \
                if self.state_slots is not None else None
            self.logits(self._forward_rows(tables, starts, ends, np.array([0, 0]), np.array([0, 1]), states))
        except Exception as exc:
            raise UnsupportedModel(f"{self.name}: a first step failed ({type(exc).__name__}: {exc})") from exc
        finally:
            self.kv.clear_slot(page=0, state=0)
            if self.expert_routing is not None:
                self.kv.routed_experts[0] = -1

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of the given hidden rows."""
        return self.lm_head(hidden).float()

    def launch(self, batch: Batch) -> LaunchedStep:
        """One model step over the batch's rows (batch_step.launch_step), its results on their way to the host."""
        return launch_step(self, batch, self.logits_chunk_rows)

    def step(self, batch: Batch) -> StepResult:
        return self.launch(batch).result()
