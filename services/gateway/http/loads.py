"""SGLang's `GET /v1/loads`: each scheduler replica's load, as the routers in front of SGLang engines (smg,
sglang-router) poll it for their load-aware policies. A replica is one of SGLang's data-parallel ranks; its numbers
are from its last health round (at most --health-interval-s old). The "core" section only: the others (memory
breakdown, speculative decoding, LoRA, disaggregation, queue breakdown) are sections SGLang leaves out too when it
has nothing to say, and flatwire has none of their numbers.
"""

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
    replicas = [gateway.engine.schedulers.replicas[address] for address in sorted(gateway.engine.schedulers.replicas)]
    if dp_rank is not None and not 0 <= dp_rank < len(replicas):
        raise InvalidRequest("dp_rank", f"dp_rank: {dp_rank} is not one of the {len(replicas)} replicas' ranks")
    info = gateway.engine.model_info
    assert info is not None  # fetched when the pipeline starts, before the server listens
    ranks = [(rank, replica.stats) for rank, replica in enumerate(replicas)
             if replica.stats is not None and dp_rank in (None, rank)]
    body = {"timestamp": datetime.now(UTC).isoformat(), "version": flatwire_version(),
            "accelerator": None,  # the device's marketing name: not known to the gateway (SGLang's when unknown)
            "num_accelerators": 0 if info.device == "cpu" else 1,  # per rank: one device, or none on a CPU
            "loads": [core_load(rank, stats, info.max_running_requests) for rank, stats in ranks]}
    return Response(orjson.dumps(body), media_type="application/json")


def core_load(rank: int, stats: SchedulerStats, max_running_requests: int) -> dict:
    """SGLang's core load fields of one rank, with flatwire's numbers: KV memory in pages held by requests (the
    prefix cache's other pages can be evicted), and the prefix cache's hit rate over the prompt tokens since the
    replica started. Fields flatwire does not count (generation throughput, utilization, tokens waiting to be
    prefilled) are left out rather than sent as zeros."""
    used, total = stats.kv_pages_used * stats.page_size, stats.kv_pages_total * stats.page_size
    prompt_tokens = stats.cached_prompt_tokens + stats.prefill_tokens
    return {"dp_rank": rank, "num_running_reqs": stats.running, "num_waiting_reqs": stats.waiting,
            "num_used_tokens": used, "max_total_num_tokens": total, "max_running_requests": max_running_requests,
            "token_usage": used / total if total else 0.0,
            "cache_hit_rate": stats.cached_prompt_tokens / prompt_tokens if prompt_tokens else 0.0}
