"""SGLang's `GET /v1/loads` and its older `GET /get_load`: each scheduler replica's load, as the routers in front of
SGLang engines poll them for their load-aware policies (smg /v1/loads, sglang-router 0.3 /get_load). A replica is
one of SGLang's data-parallel ranks; its numbers are from its last health round (at most --health-interval-s old).
/v1/loads has the "core" section only: the others (memory breakdown, speculative decoding, LoRA, disaggregation,
queue breakdown) are sections SGLang leaves out too when it has nothing to say, and flatwire has none of their
numbers.
"""

import time
from datetime import UTC, datetime

import orjson
from fastapi import APIRouter, Request, Response
from flatwire_wire.scheduler import SchedulerStats

from services.gateway.http.context import gateway_of
from services.gateway.http.native import flatwire_version
from services.gateway.protocol.parse import InvalidRequest

router = APIRouter()

# SGLang's GetLoadsReqInput.VALID_SECTIONS.
SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


@router.get("/v1/loads")
async def loads(request: Request, include: str | None = None, dp_rank: int | None = None,
                format: str | None = None) -> Response:  # noqa: A002 (SGLang's query parameter)
    """{"timestamp", "version", "accelerator", "num_accelerators", "loads": [one per replica, in address order,
    those with a health round behind them]}; `dp_rank` picks one, `include` is checked as SGLang checks it."""
    gateway = gateway_of(request)
    sections = {part.strip() for part in include.split(",")} if include else set()
    if unknown := sections - SECTIONS:
        raise InvalidRequest("include", f"include: unknown sections {sorted(unknown)}; valid: {sorted(SECTIONS)}")
    if format not in (None, "json"):
        raise InvalidRequest("format", "format: not supported by this server yet; only json is accepted")
    replicas = len(gateway.engine.schedulers.replicas)
    if dp_rank is not None and not 0 <= dp_rank < replicas:
        raise InvalidRequest("dp_rank", f"dp_rank: {dp_rank} is not one of the {replicas} replicas' ranks")
    info = gateway.engine.model_info
    assert info is not None  # fetched when the pipeline starts, before the server listens
    ranks = [(rank, stats) for rank, stats in _ranks(request) if dp_rank in (None, rank)]
    body = {"timestamp": datetime.now(UTC).isoformat(), "version": flatwire_version(),
            "accelerator": None,  # the device's marketing name: not known to the gateway (SGLang's when unknown)
            "num_accelerators": 0 if info.device == "cpu" else 1,  # per rank: one device, or none on a CPU
            "loads": [core_load(rank, stats, info.max_running_requests) for rank, stats in ranks]}
    return Response(orjson.dumps(body), media_type="application/json")


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """SGLang's deprecated /get_load (its shim over /v1/loads), which sglang-router 0.3 polls (summing num_tokens):
    per rank, requests held, waiting, and tokens: those whose KV is held plus those waiting to be prefilled."""
    ts = time.perf_counter()
    body = [{"dp_rank": rank, "num_reqs": stats.running + stats.waiting, "num_waiting_reqs": stats.waiting,
             "num_tokens": _used_tokens(stats) + stats.waiting_tokens, "num_pending_tokens": stats.waiting_tokens,
             "ts_tic": ts} for rank, stats in _ranks(request)]
    return Response(orjson.dumps(body), media_type="application/json")


def _ranks(request: Request) -> list[tuple[int, SchedulerStats]]:
    """(rank, stats) of each replica with a health round behind it; ranks in address order."""
    replicas = gateway_of(request).engine.schedulers.replicas
    stats = [replicas[address].stats for address in sorted(replicas)]
    return [(rank, one) for rank, one in enumerate(stats) if one is not None]


def _used_tokens(stats: SchedulerStats) -> int:
    """KV memory held by requests, in tokens (whole pages; the prefix cache's other pages can be evicted)."""
    return stats.kv_pages_used * stats.page_size


def core_load(rank: int, stats: SchedulerStats, max_running_requests: int) -> dict:
    """SGLang's core load fields of one rank, with flatwire's numbers: KV memory held by requests, the tokens
    waiting to be prefilled (num_total_tokens: those and the held ones, as SGLang counts them), and the prefix
    cache's hit rate over the prompt tokens since the replica started. Fields flatwire does not count (generation
    throughput, utilization) are left out rather than sent as zeros."""
    used, total = _used_tokens(stats), stats.kv_pages_total * stats.page_size
    prompt_tokens = stats.cached_prompt_tokens + stats.prefill_tokens
    return {"dp_rank": rank, "num_running_reqs": stats.running, "num_waiting_reqs": stats.waiting,
            "num_used_tokens": used, "num_total_tokens": used + stats.waiting_tokens, "max_total_num_tokens": total,
            "max_running_requests": max_running_requests, "token_usage": used / total if total else 0.0,
            "cache_hit_rate": stats.cached_prompt_tokens / prompt_tokens if prompt_tokens else 0.0}
