"""The scheduler's edge for new requests: a submitted TokenizedRequest checked whole and turned into a Request.

Every refusal names the offending field (InvalidTokenizedRequest.field, in the internal API's names; the
gateway renames it to the client's), and the server answers it with INVALID_ARGUMENT. The sampling options are
built and checked by their own rules (flatwire_wire.sampling, which the gateway applies too); the checks here are
those that need the served model.
"""

import zlib
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import xgrammar as xgr
from flatwire_wire.logprobs import LogprobsMode
from flatwire_wire.sampling import InvalidSampling, SamplingOptions
from flatwire_wire.scheduler import TokenizedRequest

from services.scheduler.engine.lora_registry import LoraRegistry, cache_namespace
from services.scheduler.model.lora_adapter import LoraAdapter
from services.scheduler.output.pending import PendingOutput
from services.scheduler.request import Request, RequestStatus
from services.scheduler.sampling.grammar import Grammars, InvalidGrammar
from services.scheduler.sampling.logit_adjust import LogitAdjustment

# Bounds the tokens (and logprob rows) a request holds back between two entries.
MAX_STREAM_INTERVAL = 1024


class InvalidTokenizedRequest(ValueError):
    """A TokenizedRequest the scheduler refuses: `field` names the offending field, and the message starts
    with it; `not_found`: it names what the scheduler does not have (a LoRA adapter), NOT_FOUND rather than
    INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str, not_found: bool = False):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.not_found = not_found


@dataclass(frozen=True)
class SubmitLimits:
    vocab_size: int
    max_context: int
    max_top_logprobs: int
    eos_token_ids: tuple[int, ...]
    output_interval: int  # tokens per entry of a request that does not stream (--output-interval)
    stream_coalesce_tokens: int = 1  # most tokens an entry holds while the subscribers are behind (the lane's rows)
    max_total_tokens: int = 1 << 62  # the KV memory: a sequence longer than it can never run
    logprobs_mode: LogprobsMode = LogprobsMode.RAW  # a request's that names none (--logprobs-mode)
    routed_experts: bool = False  # whether routed experts are recorded (--enable-return-routed-experts on a MoE)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidTokenizedRequest(name, message)


def _check_ids(ids, name: str, vocab_size: int) -> None:
    array = np.asarray(ids, dtype=np.int64)
    _check(bool((array >= 0).all() and (array < vocab_size).all()), name, f"token ids must be in [0, {vocab_size})")


def parse_request(msg: TokenizedRequest, limits: SubmitLimits, grammars: Grammars | None = None,
                  adapters: LoraRegistry | None = None) -> Request:
    """Validate a TokenizedRequest; raises InvalidTokenizedRequest naming the offending field. A constrained
    request's grammar is parsed by `grammars` and compiled in their thread (the request is COMPILING until then);
    without them it is refused. Its LoRA adapter is looked up in `adapters` (None: LoRA is off)."""
    logprob = msg.logprob
    _check(bool(msg.rid), "rid", "must not be empty")
    input_ids = np.array(msg.input_ids, dtype=np.int64)
    _check(len(input_ids) > 0, "input_ids", "must not be empty")
    _check_ids(input_ids, "input_ids", limits.vocab_size)
    _check(len(input_ids) < limits.max_context, "input_ids",
           f"{len(input_ids)} tokens leave no room to generate within max_context {limits.max_context}")
    _check(len(input_ids) < limits.max_total_tokens, "input_ids",
           f"{len(input_ids)} tokens do not fit the KV memory of {limits.max_total_tokens} tokens (max_total_tokens)")
    _check(msg.stream_interval <= MAX_STREAM_INTERVAL, "stream_interval", f"must be at most {MAX_STREAM_INTERVAL}")
    try:
        sampling = SamplingOptions.of(msg.sampling)
    except InvalidSampling as refused:
        raise InvalidTokenizedRequest(f"sampling.{refused.field}", str(refused)) from None
    max_new_tokens = sampling.max_new_tokens
    _check_ids(sampling.stop_token_ids, "sampling.stop_token_ids", limits.vocab_size)
    # Its whole sequence must fit the KV memory at once (past the context it ends anyway: LENGTH).
    longest = min(len(input_ids) + max_new_tokens, limits.max_context)
    _check(longest <= limits.max_total_tokens, "sampling.max_new_tokens",
           f"{len(input_ids)} prompt tokens + {max_new_tokens} new ones do not fit the KV memory of "
           f"{limits.max_total_tokens} tokens (max_total_tokens)")
    _check_ids(list(sampling.logit_bias), "sampling.logit_bias", limits.vocab_size)

    wants = logprob.return_logprob
    _check(logprob.top_logprobs_num <= limits.max_top_logprobs, "logprob.top_logprobs_num",
           f"{logprob.top_logprobs_num} exceeds the maximum {limits.max_top_logprobs}")
    _check(-1 <= logprob.logprob_start_len < len(msg.input_ids), "logprob.logprob_start_len",
           "must be -1 (no prompt logprobs) or a prompt position")
    _check_ids(logprob.token_ids_logprob, "logprob.token_ids_logprob", limits.vocab_size)

    # As SGLang: ignore_eos ignores every stop token, stop_token_ids too (min_new_tokens still holds them off).
    stop_ids = frozenset(sampling.stop_token_ids) | frozenset(limits.eos_token_ids)
    _check(limits.routed_experts or not msg.return_routed_experts, "return_routed_experts",
           "this scheduler records no routed experts: a MoE model, started with --enable-return-routed-experts")
    _check(msg.routed_experts_start_len <= len(msg.input_ids), "routed_experts_start_len",
           f"must be at most the prompt's length, {len(msg.input_ids)}")
    _check(not msg.return_top_p_token_ids or sampling.cuts, "return_top_p_token_ids",
           "the request samples without top_p, top_k or min_p: its nucleus would be the whole vocabulary")
    adapter = _adapter(msg.lora_name, adapters)
    compiling = _grammar(sampling, stop_ids, grammars)
    # Stop strings are matched by the detokenizer: it must see every token as soon as it exists.
    interval = 1 if any(msg.detokenize.stop) else (msg.stream_interval or limits.output_interval)
    interval = max(1, min(interval, max_new_tokens))
    # The first entry of a whole-output request that will ship before its end is staggered by its rid
    # (output/pending.py): nobody waits for it.
    staggered = not msg.stream_interval and max_new_tokens > interval
    first_interval = interval - zlib.crc32(msg.rid.encode()) % interval if staggered else interval
    top_k = logprob.top_logprobs_num if wants else 0
    ids = list(logprob.token_ids_logprob) if wants else []
    return Request(
        rid=msg.rid,
        owner=msg.owner,
        input_ids=input_ids,
        detokenize=msg.detokenize,
        sampling=sampling,
        stop_ids=frozenset() if sampling.ignore_eos else stop_ids,
        return_logprob=wants,
        top_logprobs_num=top_k,
        logprob_start_len=logprob.logprob_start_len if wants else -1,
        token_ids_logprob=ids,
        logprobs_mode=_logprobs_mode(logprob.logprobs_mode or limits.logprobs_mode, msg.return_top_p_token_ids),
        return_top_p_token_ids=msg.return_top_p_token_ids,
        return_routed_experts=msg.return_routed_experts,
        routed_experts_start_len=msg.routed_experts_start_len,
        adjustment=LogitAdjustment.of(sampling, stop_ids),
        grammar=None,
        adapter=adapter,
        cache_namespace=cache_namespace(adapter, msg.cache_namespace),
        compiling=compiling,
        status=RequestStatus.COMPILING if compiling is not None else RequestStatus.WAITING,
        pending=PendingOutput(interval, (top_k, len(ids)) if wants else None, first_interval,
                              lane=min(limits.stream_coalesce_tokens, max_new_tokens),
                              top_p=msg.return_top_p_token_ids),
    )


def _adapter(name: str, adapters: LoraRegistry | None) -> LoraAdapter | None:
    """The loaded adapter of that name (None for "": the base model); an unknown one is refused by name."""
    if not name:
        return None
    if adapters is None:
        raise InvalidTokenizedRequest("lora_name", f"The model `{name}` does not exist: this scheduler serves no LoRA "
                                      "adapters (--enable-lora)", not_found=True)
    if (adapter := adapters.lookup(name)) is None:
        names = [info.name for info in adapters.loaded()]
        loaded = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") or "none"
        raise InvalidTokenizedRequest("lora_name", f"The model `{name}` does not exist: no LoRA adapter of that name "
                                      f"is loaded (loaded: {loaded})", not_found=True)
    return adapter


def _logprobs_mode(mode: LogprobsMode, top_p_replay: bool) -> LogprobsMode:
    """The distribution its output logprobs are of: SGLang's with top-p replay is the renormalized nucleus (as
    slime's SGLang returns it, so that the rollout's logprob is the one its trainer recomputes over the nucleus)."""
    return LogprobsMode.PROCESSED if mode is LogprobsMode.SGLANG and top_p_replay else mode


def _grammar(sampling: SamplingOptions, stop_ids: frozenset[int],
             grammars: Grammars | None) -> Future[xgr.GrammarMatcher] | None:
    """The request's grammar matcher to be, if it has a constraint (SamplingOptions.constraint): parsed now (a
    constraint that does not parse is refused), compiled after Submit has answered."""
    if sampling.constraint is None:
        return None
    kind, text = sampling.constraint
    # The grammar ends the output with a stop token once it is complete: there must be one.
    _check(bool(stop_ids), "sampling.stop_token_ids",
           f"the model has no eos token: a {kind} constraint needs stop_token_ids to end the output with")
    if grammars is None:
        raise InvalidTokenizedRequest(f"sampling.{kind}", "this scheduler compiles no grammars")
    try:
        grammar = grammars.parse(kind, text)
    except InvalidGrammar as exc:
        raise InvalidTokenizedRequest(f"sampling.{kind}", str(exc)) from None
    return grammars.matcher_later(grammar, stop_ids)
