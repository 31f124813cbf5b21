"""A request while the scheduler holds it: its validated options, its state, and its output not shipped yet
(output/pending.py)."""

import enum
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch
import xgrammar as xgr
from flatwire_wire.logprobs import LogprobRows, LogprobsMode
from flatwire_wire.sampling import SamplingOptions
from flatwire_wire.steps import DetokenizeParams

from services.scheduler.kv.manager import KVState
from services.scheduler.kv.prefix_cache import SHARED
from services.scheduler.model.lora_adapter import LoraAdapter
from services.scheduler.output.pending import PendingOutput
from services.scheduler.sampling.logit_adjust import LogitAdjustment


class RequestStatus(enum.Enum):
    """Where a request is; the scheduling policy (engine/policy.py) alone moves it, through ALLOWED."""

    COMPILING = "compiling"  # accepted; its grammar compiles (sampling/grammar.py) before it may wait its turn
    WAITING = "waiting"  # accepted, holds no KV yet
    RUNNING = "running"  # holds KV pages and a request slot: prefilling (in chunks) or decoding a token per step
    # Dropped its KV (pause "retract", or preempted when pages ran short; its full pages stay in the prefix cache):
    # waits, first in line, to be prefilled again, prompt and output so far.
    RETRACTED = "retracted"
    FINISHED = "finished"


ALLOWED = {
    RequestStatus.COMPILING: {RequestStatus.WAITING, RequestStatus.FINISHED},
    RequestStatus.WAITING: {RequestStatus.RUNNING, RequestStatus.FINISHED},
    RequestStatus.RUNNING: {RequestStatus.RETRACTED, RequestStatus.FINISHED},
    RequestStatus.RETRACTED: {RequestStatus.RUNNING, RequestStatus.FINISHED},
    RequestStatus.FINISHED: set(),
}


@dataclass(eq=False)  # a request is itself: compared and hashed by identity
class Request:
    rid: str
    owner: str
    input_ids: np.ndarray  # [prompt_len] int64
    detokenize: DetokenizeParams
    sampling: SamplingOptions  # what its tokens are chosen from, built at submit
    stop_ids: frozenset[int]  # the tokens that end it: eos (unless ignore_eos) and stop_token_ids
    return_logprob: bool
    top_logprobs_num: int  # 0 unless return_logprob
    logprob_start_len: int  # -1 unless return_logprob
    token_ids_logprob: list[int]  # empty unless return_logprob
    logprobs_mode: LogprobsMode  # which distribution its output logprobs are of: RAW, SGLANG or PROCESSED
    return_top_p_token_ids: bool  # top-p replay: each output token's nucleus ships with it
    return_routed_experts: bool  # its Finish carries the experts each of its tokens was routed to
    routed_experts_start_len: int  # from this position on
    adjustment: LogitAdjustment | None  # `sampling`'s penalties, logit_bias, min_new_tokens as arrays; None: none
    grammar: xgr.GrammarMatcher | None  # structured output (sampling/grammar.py); None: unconstrained
    pending: PendingOutput  # output not shipped yet
    adapter: LoraAdapter | None = None  # the LoRA adapter it runs on (None: the base model), held until it ends
    cache_namespace: Hashable = SHARED  # where its KV is cached and looked up (engine/lora_registry.py)
    status: RequestStatus = RequestStatus.WAITING
    compiling: Future[xgr.GrammarMatcher] | None = None  # its grammar's matcher while COMPILING
    compile_deadline: float = 0.0  # time.monotonic() past which a COMPILING request fails
    slot: int = -1  # its row of per-request sampling state while RUNNING
    output_ids: list[int] = field(default_factory=list)  # appended through append_output
    kv: KVState = field(default_factory=KVState)  # its KV memory, the KV manager's (kv/manager.py)
    cached_tokens: int = 0  # prompt tokens its first prefill found in the prefix cache
    admitted: bool = False  # it ran once (cached_tokens is known)
    prompt_logprobs: LogprobRows | None = None  # the prompt's rows, gathered chunk by chunk until they ship
    prompt_logprobs_sent: bool = False  # a request prefilled again (after a retract) does not send them twice
    length: int = field(init=False)  # tokens in the sequence so far (prompt + generated): read every step
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.length = len(self.input_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Whether its prefill ships the prompt's logprobs."""
        return self.logprob_start_len >= 0 and not self.prompt_logprobs_sent

    @property
    def decoding(self) -> bool:
        """Its KV holds every token but the last: its next row is one token."""
        return self.kv.computed == self.length - 1

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.length += 1

    def sequence(self) -> np.ndarray:
        """Its tokens: the prompt, then the output so far."""
        if not self.output_ids:
            return self.input_ids
        return np.concatenate([self.input_ids, np.asarray(self.output_ids, dtype=np.int64)])

    @property
    def prompt_logprob_start(self) -> int:
        """First prompt position that gets a logprob row (position 0 never has one)."""
        return max(self.logprob_start_len, 1)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own random stream (seeded requests only), so that its draws
        do not depend on which other requests share the step."""
        if self.sampling.seed is not None and self._generator is None:
            self._generator = torch.Generator(device).manual_seed(self.sampling.seed)
        return self._generator
