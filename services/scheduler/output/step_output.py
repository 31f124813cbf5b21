"""Builds a step's StepMessage: the entries of the requests that ship, and the step's prompt rows."""

import time
from dataclasses import dataclass, field

from flatwire_wire.logprobs import LogprobBlock, LogprobRows
from flatwire_wire.steps import Finish, RequestStart, StepMessage

from services.scheduler.output.pending import shipped_block, shipped_nuclei
from services.scheduler.request import Request

NO_ROWS: LogprobRows = LogprobRows.allocate(0, 0, 0)  # the part of a request without logprobs in a block


@dataclass
class Outgoing:
    """What the engine's next StepMessage carries besides the step's own output."""

    new: list[Request] = field(default_factory=list)  # to announce (started)
    finished: list[Finish] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)  # their pending output ships with their Finish
    due: list[Request] = field(default_factory=list)  # running, an entry's worth of output pending
    prompts: list[Request] = field(default_factory=list)  # their prompt logprob rows are whole: they ship

    def end(self, request: Request, finish: Finish) -> None:
        self.ended.append(request)
        self.finished.append(finish)


def started(request: Request) -> RequestStart:
    return RequestStart(rid=request.rid, owner=request.owner, detokenize=request.detokenize,
                        prompt_tokens=request.prompt_len)


def step_message(step: int, new: list[Request], shipping: list[Request], prompt_requests: list[Request],
                 finished: list[Finish], weight_version: str) -> StepMessage:
    """The message of one step; `shipping` requests' pending output becomes its entries (and is marked shipped),
    every token of them produced by the weights labelled `weight_version`; `prompt_requests` (whose prefill
    reached the end of the prompt) ship the prompt logprob rows they gathered."""
    output = None
    if any(r.return_logprob for r in shipping):
        order, output = shipped_block([r.pending for r in shipping])
        shipping = [shipping[i] for i in order]
    top_p = shipped_nuclei([r.pending for r in shipping]) if any(r.return_top_p_token_ids for r in shipping) \
        else None
    prompt = None
    if prompt_requests:
        prompt = LogprobBlock.of_rows([r.prompt_logprobs or NO_ROWS for r in prompt_requests],
                                      [int(r.logprob_start_len == 0) for r in prompt_requests])
    message = StepMessage(
        step=step,
        weight_version=weight_version,
        made_at_unix_us=time.time_ns() // 1000,
        started=[started(r) for r in new],
        rids=[r.rid for r in shipping],
        token_ids=[token for r in shipping for token in r.pending.token_ids],
        positions=[r.pending.first_position for r in shipping],
        counts=[r.pending.count for r in shipping],
        output=output,
        prompt_rids=[r.rid for r in prompt_requests],
        prompt=prompt,
        finished=finished,
        top_p=top_p,
    )
    for request in shipping:
        request.pending.shipped()
    return message
