"""Builds the step's StepOutput from host arrays (DESIGN.md, wire rules 1 and 5)."""

import numpy as np

from services.common.arrays import LogprobArrays, encode_block
from services.common.pb import arrays_pb2, scheduler_pb2
from services.scheduler.request import Request


def started(request: Request) -> scheduler_pb2.RequestStart:
    return scheduler_pb2.RequestStart(rid=request.rid, owner=request.owner, detokenize=request.detokenize,
                                      prompt_tokens=request.prompt_len)


def output_block(requests: list[Request], host: dict[str, np.ndarray]) -> arrays_pb2.LogprobBlock:
    """One row per request; each keeps the first k_i of the step's [B, k_max] top-k and n_i of its id logprobs."""
    k = np.array([r.top_logprobs_num for r in requests], dtype=np.int64)
    n = np.array([len(r.token_ids_logprob) for r in requests], dtype=np.int64)
    keep_k = np.arange(host["topk_values"].shape[1]) < k[:, None]
    keep_n = np.arange(host["ids_logprobs"].shape[1]) < n[:, None]
    return encode_block(LogprobArrays(
        rows=np.ones(len(requests), dtype=np.int64),
        null_prefix=np.zeros(len(requests), dtype=np.int64),
        token_logprobs=host["token_logprobs"],
        topk=k,
        topk_values=host["topk_values"][keep_k],
        topk_ids=host["topk_ids"][keep_k],
        id_counts=n,
        ids_logprobs=host["ids_logprobs"][keep_n],
    ))


def prompt_block(requests: list[Request], host: dict[str, np.ndarray]) -> arrays_pb2.LogprobBlock:
    """Prompt rows of requests whose prefill ran this step; the arrays arrive already flat."""
    return encode_block(LogprobArrays(
        rows=np.array([r.prompt_len - r.prompt_logprob_start for r in requests], dtype=np.int64),
        null_prefix=np.array([int(r.logprob_start_len == 0) for r in requests], dtype=np.int64),
        token_logprobs=host["prompt_token_logprobs"],
        topk=np.array([r.top_logprobs_num for r in requests], dtype=np.int64),
        topk_values=host["prompt_topk_values"],
        topk_ids=host["prompt_topk_ids"],
        id_counts=np.array([len(r.token_ids_logprob) for r in requests], dtype=np.int64),
        ids_logprobs=host["prompt_ids_logprobs"],
    ))


def step_output(step: int, new: list[Request], rows: list[Request], host: dict[str, np.ndarray],
                prompt_requests: list[Request], finished: list[scheduler_pb2.Finish]) -> scheduler_pb2.StepOutput:
    message = scheduler_pb2.StepOutput(
        step=step,
        started=[started(r) for r in new],
        rids=[r.rid for r in rows],
        token_ids=host["next_ids"].tolist() if rows else [],
        positions=[len(r.output_ids) - 1 for r in rows],  # each row's token was just appended
        finished=finished,
    )
    if any(r.return_logprob for r in rows):
        message.output.CopyFrom(output_block(rows, host))
    if prompt_requests:
        message.prompt_rids.extend(r.rid for r in prompt_requests)
        message.prompt.CopyFrom(prompt_block(prompt_requests, host))
    return message
