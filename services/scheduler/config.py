"""Scheduler options (every field is a flag and a FLATWIRE_* environment variable)."""

from dataclasses import dataclass

from flatwire_wire.logprobs import LogprobsMode

from services.common.config import ServiceConfig, option, require_positive

# The Linear modules a LoRA adapter may adapt (--lora-target-modules all: model/lora.py), and SGLang's names for
# those it fuses, which a Hugging Face model keeps apart.
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass
class SchedulerConfig(ServiceConfig):
    """flatwire scheduler: owns the model, batches requests, streams one StepOutput per step."""

    port: int = option(30010, "gRPC port (where the detokenizer's and the gateway's --schedulers look by default)")
    device: str = option("auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto (on CUDA the checkpoint's half-precision dtype, bfloat16 for a float32 "
                        "checkpoint or one that names none; float32 on CPU), float32, bfloat16, float16")
    kv_cache_dtype: str = option("auto", "what the KV memory stores (SGLang's flag): auto, the model's --dtype; "
                                 "fp8_e4m3 or fp8_e5m2, 8-bit floats (half of bfloat16's bytes a token) over the "
                                 "checkpoint's per-layer k_scale and v_scale, else 1.0 (kv/quantize.py)")
    max_running_requests: int = option(64, "most requests running at once (each also holds a row of per-request "
                                       "sampling state); the KV memory admits fewer when it is short")
    context_length: int = option(0, "longest sequence (prompt + output); 0: the model's maximum. Costs nothing until "
                                 "a request uses it: KV memory is paged")
    page_size: int = option(16, "tokens per KV page: the unit of KV memory and of prefix sharing")
    max_total_tokens: int = option(0, "KV memory in tokens kept in every layer, over every request and the prefix "
                                   "cache (a model with sliding windows holds more); 0: on CUDA, "
                                   "what --mem-fraction-static leaves after the weights; on CPU, 131072")
    mem_fraction_static: float = option(0.85, "CUDA, without --max-total-tokens: the fraction of the device's "
                                        "memory that the weights and the KV memory take together")
    chunked_prefill_size: int = option(2048, "most prompt tokens one step prefills, over every request: a longer "
                                       "prompt is prefilled in chunks, batched with the running decodes; -1: off "
                                       "(each prompt whole, within --max-prefill-tokens)")
    max_prefill_tokens: int = option(16384, "with --chunked-prefill-size -1, the prompt tokens one step prefills; "
                                     "a longer prompt is still admitted, alone")
    disable_radix_cache: bool = option(False, "no prefix cache: every request prefills its whole prompt")
    state_checkpoints: int = option(0, "a linear-attention model (Qwen3.5, Qwen3-Next): checkpoints of its state at "
                                    "page boundaries the prefix cache keeps, each the size of one request's state; "
                                    "0: as many as --max-running-requests")
    logprobs_mode: str = option("raw_logprobs", "the distribution output logprobs are of when an OpenAI request names "
                                "none (vLLM's flag and names; /generate and the public gRPC API default to SGLang's, "
                                "the gateway's --return-original-logprob): raw_logprobs, the model's; "
                                "processed_logprobs, the one each token was drawn from (after logit_bias, penalties, "
                                "grammar, temperature, top-k/p, min-p); sglang_logprobs, SGLang's (the adjusted "
                                "logits at the temperature, before top-k/p and min-p)")
    enable_return_routed_experts: bool = option(
        False, "record the experts a MoE model's routers choose for every token (SGLang's flag), for requests that "
        "ask with return_routed_experts: int32 per KV slot, layer and expert slot (model/routed_experts.py)")
    attention_backend: str = option(
        "torch", "torch: batched SDPA over gathered pages (CPU, and the reference); triton: a paged kernel that "
        "reads the pages in place (CUDA; not yet run on a GPU in this project, so not the default)")
    linear_attention_backend: str = option(
        "torch", "a linear-attention model's (Qwen3.5, Qwen3-Next) Gated DeltaNet layers: torch, transformers' torch "
        "rules (CPU, and the reference); fla, the flash-linear-attention Triton kernels (CUDA; the package "
        "flash-linear-attention; run only in Triton's CPU interpreter in this project so far, so not the default)")
    load_format: str = option("auto", "auto: the checkpoint's weights; dummy: random weights from its config.json "
                              "alone (SGLang's and vLLM's name; for benchmarks of a shape whose weights are not here)")
    enable_cuda_graph: bool = option(
        False, "replay decode steps from CUDA graphs captured per batch size (model/cuda_graphs.py; needs "
        "--attention-backend triton). Off by default until a GPU run in this project has exercised it; SGLang has "
        "them on and --disable-cuda-graph")
    cuda_graph_max_bs: int = option(256, "with --enable-cuda-graph, the largest decode batch replayed from a graph "
                                    "(at most --max-running-requests); larger ones run eagerly")
    enable_overlap_schedule: bool = option(
        False, "build and publish a step's output while the device computes the next one (SGLang's overlap "
        "schedule, there on by default): pays on CUDA, where steps run asynchronously; on the CPU a step's output "
        "would wait for the next step. Off until a GPU run in this project has measured it")
    grammar_compile_timeout_s: float = option(300.0, "most seconds a structured-output request waits for its "
                                              "grammar to compile (after its Submit answered) before it fails")
    max_top_logprobs: int = option(256, "largest top_logprobs_num a request may ask for")
    logits_chunk_rows: int = option(256, "prompt positions turned into logits at once (bounds [rows, vocab] memory)")
    output_interval: int = option(50, "output tokens a request that does not stream ships per message (SGLang ships "
                                  "every 50 steps too); streaming requests ship every step, or per their "
                                  "stream_interval")
    stream_coalesce_tokens: int = option(8, "most output tokens a request that ships every step (streaming, or "
                                         "matching stop strings) holds back while a step subscriber is behind (a "
                                         "message queued for it): fewer, larger entries for every hop that cannot "
                                         "keep up; 1: every token ships on its step")
    replay_window_s: float = option(30.0, "seconds of published steps kept for a detokenizer that reconnects or "
                                    "restarts: an outage shorter than this loses nothing")
    replay_window_mb: int = option(256, "most MiB of published steps kept for that replay (oldest dropped first)")
    engine: str = option("model", "model: run the checkpoint; synthetic: no weights, deterministic tokens at "
                         "--step-ms per step (capacity planning)")
    step_ms: float = option(10.0, "milliseconds each step takes, only with --engine synthetic")
    weights_sync_timeout_s: float = option(300.0, "most seconds joining a trainer's weight update group, or one "
                                           "broadcast of it, may take before the call fails (a trainer gone)")
    max_subscriber_backlog: int = option(128, "step messages queued for one detokenizer before the engine waits for "
                                         "it to catch up (back-pressure)")
    stall_timeout_s: float = option(10.0, "a detokenizer that stays past --max-subscriber-backlog this long has its "
                                    "stream ended: it resubscribes and is replayed what it missed")
    enable_lora: bool = option(False, "serve LoRA adapters of the model (SGLang's flag): requests on different "
                               "adapters and on the base model share a step (model/lora.py); on with --lora-paths")
    lora_paths: list[str] = option([], "PEFT adapter directories loaded at start, comma-separated, each NAME=PATH or "
                                   "PATH (named by its path), SGLang's forms (vLLM's --lora-modules)",
                                   aliases=("lora_modules",))
    max_loras_per_batch: int = option(8, "LoRA adapters one step runs at most (SGLang's; vLLM's --max-loras): device "
                                      "buffers of --max-lora-rank for each, per target module",
                                      aliases=("max_loras",))
    max_lora_rank: int = option(16, "largest LoRA rank an adapter may have (vLLM's default)")
    lora_target_modules: list[str] = option(["all"], "the Linear modules adapters may adapt: q_proj, k_proj, "
                                            "v_proj, o_proj, gate_proj, up_proj, down_proj (SGLang's qkv_proj, "
                                            "gate_up_proj: their parts), or all of them")
    max_loaded_loras: int = option(0, "LoRA adapters held in host memory at once (SGLang's; vLLM's --max-cpu-loras): "
                                   "loading one more unloads the least recently used one no request runs on and "
                                   "not pinned; 0: 4 x --max-loras-per-batch", aliases=("max_cpu_loras",))
    tp_size: int = option(1, "tensor-parallel ranks (SGLang's flag; vLLM's --tensor-parallel-size): the model's "
                          "heads, MLP and experts cut over N processes (one device each: cuda:0..N-1; gloo on CPU), "
                          "each keeping its share of the KV heads; rank 0 serves and samples (parallel/)",
                          aliases=("tensor_parallel_size",))
    max_waiting_requests: int = option(0, "requests accepted but not yet running (the waiting list); past it Submit "
                                       "answers RESOURCE_EXHAUSTED (HTTP 429 at the gateway); 0: max(4096, 8 x "
                                       "--max-running-requests), room for a gateway's largest batch")

    def __post_init__(self):
        super().__post_init__()
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype: unknown dtype {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"--kv-cache-dtype: expected auto, fp8_e4m3 or fp8_e5m2, not {self.kv_cache_dtype!r}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"--device: expected auto, cpu or cuda[:N], not {self.device!r}")
        require_positive(self, ("max_running_requests", "max_prefill_tokens", "max_top_logprobs", "logits_chunk_rows",
                                "output_interval", "stream_coalesce_tokens", "page_size", "cuda_graph_max_bs",
                                "max_loras_per_batch", "max_lora_rank", "tp_size"))
        self._check_lora()
        if self.tp_size > 1 and (self.engine == "synthetic" or self.enable_lora or self.enable_cuda_graph):
            raise ValueError("--tp-size: not with --engine synthetic, --enable-lora or --enable-cuda-graph (yet)")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("--chunked-prefill-size: must be positive, or -1 (off)")
        if self.max_total_tokens < 0:
            raise ValueError("--max-total-tokens: must be 0 (automatic) or positive")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError("--mem-fraction-static: must be in (0, 1)")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("--grammar-compile-timeout-s: must be positive")
        if not self.weights_sync_timeout_s > 0:
            raise ValueError("--weights-sync-timeout-s: must be positive")
        if self.replay_window_s < 0 or self.replay_window_mb < 0:
            raise ValueError("--replay-window-s, --replay-window-mb: must not be negative")
        if self.context_length < 0:
            raise ValueError("--context-length: must be 0 (the model's maximum) or positive")
        if self.state_checkpoints < 0:
            raise ValueError("--state-checkpoints: must be 0 (automatic) or positive")
        if self.max_waiting_requests < 0:
            raise ValueError("--max-waiting-requests: must be 0 (automatic) or positive")
        try:
            LogprobsMode.named(self.logprobs_mode)
        except ValueError as exc:
            raise ValueError(f"--logprobs-mode: {exc}") from None
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format: expected auto or dummy, not {self.load_format!r}")
        if self.engine not in ("model", "synthetic"):
            raise ValueError(f"--engine: expected model or synthetic, not {self.engine!r}")
        if not self.step_ms >= 0:  # also refuses nan
            raise ValueError("--step-ms: must not be negative")

    def _check_lora(self) -> None:
        if self.lora_paths:
            self.enable_lora = True  # as SGLang: adapters at start mean LoRA on
        names = [entry.partition("=")[0] if "=" in entry else entry for entry in self.lora_paths]
        if any(entry.lstrip().startswith("{") for entry in self.lora_paths):
            raise ValueError("--lora-paths: JSON entries are not supported; give NAME=PATH or PATH")
        if len(set(names)) < len(names):
            raise ValueError("--lora-paths: two adapters of one name")
        if unknown := sorted(set(self.lora_target_modules) - {"all", *LORA_PROJECTIONS, *FUSED_PROJECTIONS}):
            raise ValueError(f"--lora-target-modules: unknown {', '.join(unknown)}; one of all, "
                             f"{', '.join(LORA_PROJECTIONS)}, {', '.join(FUSED_PROJECTIONS)}")
        if self.max_loaded_loras < 0 or 0 < self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError("--max-loaded-loras: 0 (automatic) or at least --max-loras-per-batch")
        if self.enable_lora and self.enable_cuda_graph:
            raise ValueError("--enable-lora: not with --enable-cuda-graph (the LoRA matmuls run outside the graphs)")
        if self.enable_lora and self.engine == "synthetic":
            raise ValueError("--enable-lora: not with --engine synthetic, which has no model to adapt")

    @property
    def lora_modules(self) -> list[tuple[str, str]]:
        """--lora-paths as (name, path) pairs."""
        return [(entry.partition("=")[0], entry.partition("=")[2]) if "=" in entry else (entry, entry)
                for entry in self.lora_paths]

    @property
    def lora_layers(self) -> tuple[frozenset[str], int, int] | None:
        """ModelRunner's `lora`: the target modules (`all` is every projection; SGLang's fused names are their
        parts), adapters per step and the largest rank; None without --enable-lora."""
        if not self.enable_lora:
            return None
        kinds: set[str] = set()
        for name in self.lora_target_modules:
            kinds.update(LORA_PROJECTIONS if name == "all" else FUSED_PROJECTIONS.get(name, (name,)))
        return frozenset(kinds), self.max_loras_per_batch, self.max_lora_rank

    @property
    def loaded_loras(self) -> int:
        """--max-loaded-loras, or its automatic value."""
        return self.max_loaded_loras or 4 * self.max_loras_per_batch

    @property
    def prefill_budget(self) -> int:
        """Prompt tokens one step prefills."""
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else self.max_prefill_tokens

    @property
    def waiting_limit(self) -> int:
        """--max-waiting-requests, or its automatic value."""
        return self.max_waiting_requests or max(4096, 8 * self.max_running_requests)
