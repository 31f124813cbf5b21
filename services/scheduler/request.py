"""A request's validated parameters and its state while the scheduler holds it."""

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import xgrammar as xgr

from services.common.pb import scheduler_pb2
from services.scheduler.grammar import Grammars, InvalidGrammar
from services.scheduler.logit_adjust import LogitAdjustment
from services.scheduler.pending import PendingOutput

# A temperature below this samples greedily (SGLang's _SAMPLING_EPS): logits / 1e-45 are inf or nan,
# and the softmax of those picks token 0 instead of the most likely one.
GREEDY_BELOW_TEMPERATURE = 1e-6
# Bounds the tokens (and logprob rows) a request holds back between two entries.
MAX_STREAM_INTERVAL = 1024


class InvalidTokenizedRequest(ValueError):
    """A TokenizedRequest the scheduler refuses: `field` names the offending field, and the message starts
    with it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    max_top_logprobs: int
    eos_token_ids: tuple[int, ...]
    output_interval: int  # tokens per entry of a request that does not stream (--output-interval)


@dataclass
class Request:
    rid: str
    owner: str
    input_ids: np.ndarray  # [prompt_len] int64
    detokenize: scheduler_pb2.DetokenizeParams
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    top_k: int  # 0: off
    min_p: float
    stop_ids: frozenset[int]  # eos (unless ignore_eos) and stop_token_ids
    return_logprob: bool
    top_logprobs_num: int  # 0 unless return_logprob
    logprob_start_len: int  # -1 unless return_logprob
    token_ids_logprob: list[int]  # empty unless return_logprob
    seed: int | None
    adjustment: LogitAdjustment | None  # penalties, logit_bias, min_new_tokens; None: sample the raw logits
    grammar: xgr.GrammarMatcher | None  # structured output (grammar.py); None: unconstrained
    pending: PendingOutput  # output not shipped yet
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    retracted: bool = False  # its KV was dropped (pause "retract"): its next prefill is of prompt and output
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def length(self) -> int:
        """Tokens in the sequence so far (prompt + generated)."""
        return len(self.input_ids) + len(self.output_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.logprob_start_len >= 0

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Whether its prefill ships the prompt's logprobs (a retracted request shipped them with its first)."""
        return self.wants_prompt_logprobs and not self.retracted

    @property
    def prefill_ids(self) -> np.ndarray:
        """What its prefill runs: the prompt; after a retract, the prompt and the output so far, whose logits
        give the next token."""
        if not self.retracted:
            return self.input_ids
        return np.concatenate([self.input_ids, np.asarray(self.output_ids, dtype=np.int64)])

    @property
    def prompt_logprob_start(self) -> int:
        """First prompt position that gets a logprob row (position 0 never has one)."""
        return max(self.logprob_start_len, 1)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own random stream (seeded requests only), so that its draws
        do not depend on which other requests share the step."""
        if self.seed is not None and self._generator is None:
            self._generator = torch.Generator(device).manual_seed(self.seed)
        return self._generator


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidTokenizedRequest(name, message)


def _check_ids(ids, name: str, vocab_size: int) -> None:
    array = np.asarray(ids, dtype=np.int64)
    _check(bool((array >= 0).all() and (array < vocab_size).all()), name, f"token ids must be in [0, {vocab_size})")


def parse_request(msg: scheduler_pb2.TokenizedRequest, limits: Limits, grammars: Grammars | None = None) -> Request:
    """Validate a TokenizedRequest; raises InvalidTokenizedRequest naming the offending field. A constrained
    request's grammar is compiled by `grammars` (blocking: see Grammars.compile); without them it is refused."""
    sampling, logprob = msg.sampling, msg.logprob
    _check(bool(msg.rid), "rid", "must not be empty")
    input_ids = np.array(msg.input_ids, dtype=np.int64)
    _check(len(input_ids) > 0, "input_ids", "must not be empty")
    _check_ids(input_ids, "input_ids", limits.vocab_size)
    _check(len(input_ids) < limits.max_context, "input_ids",
           f"{len(input_ids)} tokens leave no room to generate within max_context {limits.max_context}")
    _check(msg.stream_interval <= MAX_STREAM_INTERVAL, "stream_interval", f"must be at most {MAX_STREAM_INTERVAL}")
    temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
    _check(math.isfinite(temperature) and temperature >= 0, "sampling.temperature", "must be a finite number >= 0")
    if temperature < GREEDY_BELOW_TEMPERATURE:  # as SGLang: dividing the logits by it would overflow
        temperature = 0.0
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    _check(0 < top_p <= 1, "sampling.top_p", "must be in (0, 1]")
    min_p = sampling.min_p if sampling.HasField("min_p") else 0.0
    _check(0 <= min_p <= 1, "sampling.min_p", "must be in [0, 1]")
    _check_ids(sampling.stop_token_ids, "sampling.stop_token_ids", limits.vocab_size)
    for name in ("frequency_penalty", "presence_penalty"):
        _check(math.isfinite(getattr(sampling, name)), f"sampling.{name}", "must be a finite number")
    repetition_penalty = sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0
    _check(0 < repetition_penalty < math.inf, "sampling.repetition_penalty", "must be a finite number > 0")
    _check(sampling.min_new_tokens <= sampling.max_new_tokens, "sampling.min_new_tokens",
           "must not exceed max_new_tokens")
    _check_ids(list(sampling.logit_bias), "sampling.logit_bias", limits.vocab_size)
    _check(all(map(math.isfinite, sampling.logit_bias.values())), "sampling.logit_bias", "biases must be finite")

    wants = logprob.return_logprob
    _check(logprob.top_logprobs_num <= limits.max_top_logprobs, "logprob.top_logprobs_num",
           f"{logprob.top_logprobs_num} exceeds the maximum {limits.max_top_logprobs}")
    _check(-1 <= logprob.logprob_start_len < len(msg.input_ids), "logprob.logprob_start_len",
           "must be -1 (no prompt logprobs) or a prompt position")
    _check_ids(logprob.token_ids_logprob, "logprob.token_ids_logprob", limits.vocab_size)

    eos = () if sampling.ignore_eos else limits.eos_token_ids
    stop_ids = frozenset(sampling.stop_token_ids) | frozenset(eos)
    grammar = _grammar(sampling, stop_ids, grammars)
    # Stop strings are matched by the detokenizer: it must see every token as soon as it exists.
    interval = 1 if any(msg.detokenize.stop) else (msg.stream_interval or limits.output_interval)
    top_k = logprob.top_logprobs_num if wants else 0
    ids = list(logprob.token_ids_logprob) if wants else []
    return Request(
        rid=msg.rid,
        owner=msg.owner,
        input_ids=input_ids,
        detokenize=msg.detokenize,
        max_new_tokens=sampling.max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(sampling.top_k, 0) if sampling.HasField("top_k") else 0,
        min_p=min_p,
        stop_ids=stop_ids,
        return_logprob=wants,
        top_logprobs_num=top_k,
        logprob_start_len=logprob.logprob_start_len if wants else -1,
        token_ids_logprob=ids,
        seed=sampling.seed if sampling.HasField("seed") else None,
        adjustment=LogitAdjustment.of(sampling.frequency_penalty, sampling.presence_penalty, repetition_penalty,
                                      sampling.min_new_tokens, stop_ids, dict(sampling.logit_bias)),
        grammar=grammar,
        pending=PendingOutput(max(1, min(interval, sampling.max_new_tokens)), top_k, len(ids), wants),
    )


def _grammar(sampling: scheduler_pb2.SamplingParams, stop_ids: frozenset[int],
             grammars: Grammars | None) -> xgr.GrammarMatcher | None:
    """The request's grammar matcher, if it has a constraint (SamplingParams.constraint)."""
    kind = sampling.WhichOneof("constraint")
    if kind is None:
        return None
    # The grammar decides where the output ends: with a stop token, once it is complete.
    why = f"cannot be combined with a {kind} constraint: the output ends with eos once it matches"
    _check(not sampling.ignore_eos, "sampling.ignore_eos", why)
    _check(sampling.min_new_tokens == 0, "sampling.min_new_tokens", why)
    _check(bool(stop_ids), "sampling.stop_token_ids",
           f"the model has no eos token: a {kind} constraint needs stop_token_ids to end the output with")
    if grammars is None:
        raise InvalidTokenizedRequest(f"sampling.{kind}", "this scheduler compiles no grammars")
    try:
        return grammars.matcher(kind, getattr(sampling, kind), stop_ids)
    except InvalidGrammar as exc:
        raise InvalidTokenizedRequest(f"sampling.{kind}", str(exc)) from None
