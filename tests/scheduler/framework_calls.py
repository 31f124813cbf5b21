"""The calls RL frameworks make to a colocated SGLang engine's HTTP server, in the shapes their sources send: each
builder names the file it copies (the repositories as of this writing: THUDM/slime, radixark/miles,
NVIDIA-NeMo/RL, volcengine/verl with sglang/srt/weight_sync/utils.py). The tensors travel as torch's shared-memory
handles (harness/sglang_payloads.py: SGLang's serializer without SGLang); the GPU frameworks send CUDA IPC handles
of the same pickles.
"""

from dataclasses import dataclass, field

import torch

from harness.sglang_payloads import LocalSerializedTensor, flattened_bucket, pickled, serialize, shared_memory

Named = list[tuple[str, torch.Tensor]]


@dataclass
class Call:
    """An HTTP call: its method, path and JSON body (None: no body), with the tensors its handles name (the trainer
    keeps them until the call returns)."""

    method: str
    path: str
    body: dict | None = None
    keep: list = field(default_factory=list)


def _bucketed(named: Named) -> tuple[str, dict]:
    with shared_memory():
        data = flattened_bucket(named)
        return serialize(data), data


def slime_update(named: Named, weight_version: int) -> Call:
    """slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py `_send_to_colocated_engine` (one
    bucket of every dtype: SGLang's FlattenedTensorBucket.supports_multi_dtypes), posted by
    slime/backends/sglang_utils/sglang_engine.py `update_weights_from_tensor` (flush_cache False)."""
    entry, data = _bucketed(named)
    return Call("POST", "/update_weights_from_tensor", {
        "serialized_named_tensors": [entry], "load_format": "flattened_bucket", "flush_cache": False,
        "weight_version": str(weight_version)}, [data])


def slime_update_cycle(named: Named, weight_version: int) -> list[Call]:
    """slime's UpdateWeightFromTensor.update_weights (the same file): pause, flush (the engine's flush_cache: GET,
    retried until 200), the buckets, continue."""
    return [Call("POST", "/pause_generation", {}), Call("GET", "/flush_cache"),
            slime_update(named, weight_version), Call("POST", "/continue_generation", {})]


def miles_update_cycle(buckets: list[Named], weight_version: int) -> list[Call]:
    """miles/backends/megatron_utils/update_weight/update_weight_from_tensor.py `update_weights`: pause
    (--pause-generation-mode, retract by default), flush, begin_weight_update(selector), each bucket
    (`_send_to_colocated_engine`: flattened_bucket, weight_version, selector; the body as
    miles/backends/sglang_utils/sglang_engine.py `update_weights_from_tensor` posts it), end_weight_update,
    continue."""
    calls = [Call("POST", "/pause_generation", {"mode": "retract"}), Call("GET", "/flush_cache"),
             Call("POST", "/begin_weight_update", {"selector": "all"})]
    for named in buckets:
        entry, data = _bucketed(named)
        calls.append(Call("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": [entry], "load_format": "flattened_bucket", "flush_cache": False,
            "selector": "all", "weight_version": str(weight_version)}, [data]))
    return calls + [Call("POST", "/end_weight_update", {}), Call("POST", "/continue_generation", {})]


def nemo_rl_update(named: Named, weight_version: int) -> list[Call]:
    """nemo_rl/models/policy/utils.py `_flush_bucket` (a bucket per dtype, its own FlattenedTensorBucket in
    nemo_rl/models/generation/sglang/utils/train_utils.py) and `stream_weights_via_http_impl` (a GET /flush_cache
    after the last bucket)."""
    calls = []
    for dtype in dict.fromkeys(tensor.dtype for _, tensor in named):
        entry, data = _bucketed([(name, tensor) for name, tensor in named if tensor.dtype == dtype])
        calls.append(Call("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": [entry], "load_format": "flattened_bucket", "flush_cache": False,
            "weight_version": str(weight_version)}, [data]))
    return calls + [Call("GET", "/flush_cache")]


def verl_update(named: Named, tp_size: int = 1) -> list[Call]:
    """verl/workers/rollout/sglang_rollout/sglang_rollout.py `update_weights` → sglang/srt/weight_sync/utils.py
    `update_weights` (per name a LocalSerializedTensor of each rank's pickled tensor; the list pickled once per
    rank; load_format None), posted base64 by verl/workers/rollout/sglang_rollout/http_server_engine.py
    `update_weights_from_tensor` (flush_cache: the request's default, True), then flush_cache."""
    with shared_memory():
        per_rank = [(name, LocalSerializedTensor(values=[pickled(tensor) for _ in range(tp_size)]))
                    for name, tensor in named]
        entries = [serialize(per_rank) for _ in range(tp_size)]
    return [Call("POST", "/update_weights_from_tensor", {"serialized_named_tensors": entries, "load_format": None,
                                                          "flush_cache": True}, [named]),
            Call("GET", "/flush_cache")]


def sglang_engine_update(named: Named, load_format: str | None = None) -> Call:
    """SGLang's own Engine.update_weights_from_tensor(named_tensors, load_format) over HTTP
    (python/sglang/srt/entrypoints/http_server_engine.py): the (name, tensor) list pickled once per rank."""
    with shared_memory():
        entry = serialize(named)
    return Call("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [entry],
                                                         "load_format": load_format, "flush_cache": True}, [named])


def slime_memory_cycle() -> list[Call]:
    """slime/backends/sglang_utils/sglang_engine.py `release_memory_occupation` (flush, then no body: every tag),
    slime/ray/rollout.py `onload_weights` (tags weights) and `onload_kv` (kv_cache and cuda_graph)."""
    return [Call("GET", "/flush_cache"), Call("POST", "/release_memory_occupation", {}),
            Call("POST", "/resume_memory_occupation", {"tags": ["weights"]}),
            Call("POST", "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})]


def nemo_rl_memory_cycle() -> list[Call]:
    """nemo_rl/models/generation/sglang/sglang_worker.py `release_memory_occupation` / `resume_memory_occupation`
    (kv_cache brings cuda_graph with it)."""
    tags = ["weights", "kv_cache", "cuda_graph"]
    return [Call("POST", "/release_memory_occupation", {"tags": tags}),
            Call("POST", "/resume_memory_occupation", {"tags": tags})]


def miles_memory_cycle() -> list[Call]:
    """miles/backends/sglang_utils/sglang_engine.py: release (flush, then tags None), resume by tag."""
    return [Call("GET", "/flush_cache"), Call("POST", "/release_memory_occupation", {"tags": None}),
            Call("POST", "/resume_memory_occupation", {"tags": ["weights"]}),
            Call("POST", "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})]


def slime_check_weights(action: str) -> Call:
    """slime/backends/sglang_utils/sglang_engine.py `check_weights` (slime/ray/placement_group.py: snapshot, then
    reset_tensors, before the first update; compare after it, --check-weight-update-equal)."""
    return Call("POST", "/weights_checker", {"action": action})


def miles_check_weights(action: str, skip: list[str] | None = None) -> Call:
    """miles/backends/sglang_utils/sglang_engine.py `check_weights`."""
    body = {"action": action, "allow_quant_error": False, "selector": "all"}
    return Call("POST", "/weights_checker", body if skip is None else {**body, "skip_tensor_list": skip})


def slime_post_process_weights(before_load: bool) -> Call:
    """slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py: around the buckets, for
    compressed-tensors quantization (restore before the load, quantize after)."""
    return Call("POST", "/post_process_weights", {"restore_weights_before_load": before_load,
                                                  "post_process_quantization": not before_load})


def miles_update_from_distributed(tensors: dict, group_name: str) -> Call:
    """miles/backends/sglang_utils/sglang_engine.py `update_weights_from_distributed` (with its selector)."""
    return Call("POST", "/update_weights_from_distributed", {**tensors, "group_name": group_name,
                                                             "flush_cache": False, "selector": "all"})
