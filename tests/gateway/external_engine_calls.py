"""What slime and miles check when they attach to an SGLang engine already running (--rollout-external), in the
shape of their sources (read, not imported: both import sglang and ray at the top):

- slime: slime/backends/sglang_utils/sglang_engine.py, `_compute_server_args` (the server arguments it would have
  launched with; those not in `_EXTERNAL_ENGINE_SKIP_CHECK_FIELDS` are checked) and `SGLangEngine._init_external`
  (`_sanity_check_server_args`); the server's arguments come from slime/backends/sglang_utils/external.py,
  `get_server_info` (/server_info, else /get_server_info).
- miles: miles/backends/sglang_utils/sglang_engine.py, the same names; it reads /get_server_info and skips fewer
  fields (host, port, the placement and the parallel sizes are checked).

Only a regular worker's arguments (not prefill/decode/encoder, not LoRA, no --sglang-config overrides), and only the
ones computed before the `sglang_*` arguments are added, as both compute the fields to check there.
"""

from types import SimpleNamespace

import httpx

# slime's _EXTERNAL_ENGINE_SKIP_CHECK_FIELDS
SLIME_SKIPPED = ["model_path", "trust_remote_code", "random_seed", "host", "port", "nccl_port", "nnodes", "node_rank",
                 "dist_init_addr", "gpu_id_step", "base_gpu_id", "tp_size", "dp_size", "pp_size", "ep_size",
                 "skip_server_warmup", "enable_draft_weights_cpu_backup", "enable_metrics", "mem_fraction_static"]
# miles' _EXTERNAL_ENGINE_SKIP_CHECK_FIELDS
MILES_SKIPPED = ["model_path", "trust_remote_code", "random_seed", "nccl_port", "dist_init_addr", "skip_server_warmup",
                 "enable_draft_weights_cpu_backup", "enable_metrics", "mem_fraction_static"]


def trainer_args(**overrides) -> SimpleNamespace:
    """The trainer's arguments these read, at their defaults for one single-GPU engine (--rollout-num-gpus-per-engine
    1, no parallelism); `offload_rollout` is what --offload-rollout (or --colocate) sets."""
    return SimpleNamespace(**{"hf_checkpoint": "/ckpt", "seed": 1234, "offload_rollout": False,
                              "rollout_num_gpus_per_engine": 1, "num_gpus_per_node": 8, "sglang_dp_size": 1,
                              "sglang_pp_size": 1, "sglang_ep_size": 1, "use_rollout_routing_replay": False,
                              "use_rollout_indexer_replay": False, "fp16": False, **overrides})


def slime_server_args(args, rank: int, host: str, port: int, base_gpu_id: int = 0) -> tuple[dict, list[str]]:
    """slime's _compute_server_args for a regular worker: (the arguments, the names it checks)."""
    gpus = args.rollout_num_gpus_per_engine
    pp_size = args.sglang_pp_size
    nnodes = max(1, gpus // args.num_gpus_per_node)
    kwargs = {
        "model_path": args.hf_checkpoint, "trust_remote_code": True,
        "random_seed": args.seed + rank * args.num_gpus_per_node,
        "enable_memory_saver": args.offload_rollout,
        "host": host, "port": port, "nccl_port": None, "nnodes": nnodes, "node_rank": rank % nnodes,
        "dist_init_addr": f"{host}:{port}", "gpu_id_step": 1, "base_gpu_id": base_gpu_id,
        "tp_size": gpus // pp_size, "dp_size": args.sglang_dp_size, "pp_size": pp_size, "ep_size": args.sglang_ep_size,
        "skip_server_warmup": True, "enable_draft_weights_cpu_backup": True, "enable_metrics": True,
    }
    if args.use_rollout_routing_replay:
        kwargs["enable_return_routed_experts"] = True
    if args.fp16:
        kwargs["dtype"] = "float16"
    return kwargs, [k for k in kwargs if k not in SLIME_SKIPPED]


def miles_server_args(args, rank: int, host: str, port: int, base_gpu_id: int = 0) -> tuple[dict, list[str]]:
    """miles' _compute_server_args for a regular worker: (the arguments, the names it checks). `base_gpu_id`: the
    device miles placed the engine on."""
    gpus = args.rollout_num_gpus_per_engine
    nnodes = max(1, gpus // args.num_gpus_per_node)
    kwargs = {
        "model_path": args.hf_checkpoint, "trust_remote_code": True, "random_seed": args.seed + rank,
        "enable_memory_saver": args.offload_rollout,
        "host": host, "port": port, "nccl_port": None, "nnodes": nnodes, "node_rank": rank % nnodes,
        "dist_init_addr": f"{host}:{port}", "gpu_id_step": 1, "base_gpu_id": base_gpu_id,
        "tp_size": gpus, "dp_size": args.sglang_dp_size, "pp_size": args.sglang_pp_size,
        "ep_size": args.sglang_ep_size,
        "skip_server_warmup": True, "enable_draft_weights_cpu_backup": True, "enable_metrics": True,
    }
    if args.use_rollout_routing_replay:
        kwargs["enable_return_routed_experts"] = True
    if args.use_rollout_indexer_replay:
        kwargs["enable_return_indexer_topk"] = True
    if args.fp16:
        kwargs["dtype"] = "float16"
    return kwargs, [k for k in kwargs if k not in MILES_SKIPPED]


def slime_get_server_info(url: str) -> dict:
    """slime's external.get_server_info."""
    errors = []
    for endpoint in ("/server_info", "/get_server_info"):
        try:
            response = httpx.get(f"{url}{endpoint}", timeout=30)
            response.raise_for_status()
            return response.json()
        except Exception as exc:  # noqa: BLE001 (slime's own handling)
            errors.append(f"{endpoint}: {exc}")
    raise RuntimeError(f"Failed to fetch SGLang server info from {url}: {'; '.join(errors)}")


def miles_get_server_info(url: str) -> dict:
    """miles' _get_actual_server_args."""
    response = httpx.get(f"{url}/get_server_info", timeout=30)
    response.raise_for_status()
    return response.json()


def sanity_check_server_args(actual_server_args: dict, expect_server_args: dict, fields: list[str]) -> None:
    """Both frameworks' _sanity_check_server_args."""
    for name in fields:
        expect_value = expect_server_args.get(name)
        actual_value = actual_server_args.get(name)
        assert actual_value == expect_value, f"{name=} {expect_value=} {actual_value=}"
