"""Builds a step's StepOutput: the entries of the requests that ship, and the step's prompt rows."""

import numpy as np

from services.common.arrays import LogprobArrays, encode_block
from services.common.pb import arrays_pb2, scheduler_pb2
from services.scheduler.request import Request


def started(request: Request) -> scheduler_pb2.RequestStart:
    return scheduler_pb2.RequestStart(rid=request.rid, owner=request.owner, detokenize=request.detokenize,
                                      prompt_tokens=request.prompt_len)


def output_block(shipping: list[Request]) -> arrays_pb2.LogprobBlock:
    """Each entry's pending rows, one request after another (a request without logprobs has none)."""
    pending = [r.pending for r in shipping]
    rows = [p.count if p.with_logprobs else 0 for p in pending]
    return encode_block(LogprobArrays(
        rows=np.array(rows, dtype=np.int64),
        null_prefix=np.zeros(len(pending), dtype=np.int64),
        token_logprobs=np.concatenate([p.token_logprobs[:n] for p, n in zip(pending, rows)]),
        topk=np.array([p.k for p in pending], dtype=np.int64),
        topk_values=np.concatenate([p.topk_values[:n].reshape(-1) for p, n in zip(pending, rows)]),
        topk_ids=np.concatenate([p.topk_ids[:n].reshape(-1) for p, n in zip(pending, rows)]),
        id_counts=np.array([p.m for p in pending], dtype=np.int64),
        ids_logprobs=np.concatenate([p.ids_logprobs[:n].reshape(-1) for p, n in zip(pending, rows)]),
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


def step_output(step: int, new: list[Request], shipping: list[Request], host: dict[str, np.ndarray],
                prompt_requests: list[Request], finished: list[scheduler_pb2.Finish],
                weight_version: str) -> scheduler_pb2.StepOutput:
    """The message of one step; `shipping` requests' pending output becomes its entries (and is marked shipped),
    every token of them produced by the weights labelled `weight_version`."""
    message = scheduler_pb2.StepOutput(
        step=step,
        weight_version=weight_version,
        started=[started(r) for r in new],
        rids=[r.rid for r in shipping],
        token_ids=[token for r in shipping for token in r.pending.token_ids],
        positions=[r.pending.first_position for r in shipping],
        counts=[r.pending.count for r in shipping],
        finished=finished,
    )
    if any(r.return_logprob for r in shipping):
        message.output.CopyFrom(output_block(shipping))
    for request in shipping:
        request.pending.shipped()
    if prompt_requests:
        message.prompt_rids.extend(r.rid for r in prompt_requests)
        message.prompt.CopyFrom(prompt_block(prompt_requests, host))
    return message
