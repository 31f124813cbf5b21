"""What a token is chosen from, stated once: the sampling options' defaults and rules, and SamplingOptions, the frozen
set of them that a request carries from its submit to its last step.

The scheduler builds a request's options once, at submit (SamplingOptions.of its SamplingParams); the gateway's
request models (services/gateway/protocol/sampling.py) take their defaults from DEFAULT_SAMPLING and their ranges
from RANGES, and refuse by those ranges' checks, so that every API and the scheduler refuse the same values with the
same message. The rules that need the served model (token ids within its vocabulary, lengths within its context and
KV memory) are each edge's.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # scheduler.py's twin reads CONSTRAINTS
    from flatwire_wire.scheduler import SamplingParams

# What the messages carry (protobuf int32, uint32, uint64, float32): a larger value does not fit its field, and
# building the message would fail, so a client's value bound for one is checked against these first.
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32

# A temperature below this samples greedily (SGLang's _SAMPLING_EPS): logits / 1e-45 are inf or nan, and the
# softmax of those picks token 0 instead of the most likely one.
GREEDY_BELOW_TEMPERATURE = 1e-6
TOP_K_NO_LIMIT = -1  # SGLang's; the protos' top_k unset or <= 0 is no limit too
CONSTRAINTS = ("json_schema", "regex", "ebnf")  # structured output's kinds: SamplingParams.constraint, at most one


class InvalidSampling(ValueError):
    """Sampling options refused: `field` names the option (SamplingParams' name), the message says why."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Range:
    """The values an option may take: the numbers from `low` to `high` (`low` excluded when `low_open`), and `off`,
    outside them, which turns the option off. Both ends are finite, so NaN and infinities are never in it."""

    low: float
    high: float
    low_open: bool = False
    off: int | None = None

    def check(self, name: str, value: float) -> float:
        """`value`, or InvalidSampling naming the option `name` when it is out of range."""
        above = value > self.low if self.low_open else value >= self.low
        if not (above and value <= self.high) and value != self.off:
            raise InvalidSampling(name, f"must be {self}")
        return value

    def __str__(self) -> str:
        interval = f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}]"
        return interval if self.off is None else f"{self.off} (off) or {interval}"


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)  # an int in full


PENALTY = Range(-2.0, 2.0)  # OpenAI's and SGLang's
# Every bounded option's range (SGLang's, and the wire's integer widths), in SamplingParams' order.
RANGES = {
    "max_new_tokens": Range(0, UINT32_MAX),  # 0: the prompt's logprobs only
    "temperature": Range(0.0, FLOAT32_MAX),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(1, INT32_MAX, off=TOP_K_NO_LIMIT),
    "min_p": Range(0.0, 1.0),
    "seed": Range(0, UINT64_MAX),
    "frequency_penalty": PENALTY,
    "presence_penalty": PENALTY,
    "repetition_penalty": Range(0.0, 2.0, low_open=True),
    "min_new_tokens": Range(0, INT32_MAX),
}


def check(name: str, value: float) -> float:
    """`value` if it is within the range of the option `name` (RANGES), else InvalidSampling naming it."""
    return RANGES[name].check(name, value)


def check_logit_bias(bias: Mapping[int, float]) -> Mapping[int, float]:
    """`bias` if every bias is a finite float32 (a token biased to +inf would make softmax NaN), else
    InvalidSampling."""
    if not all(abs(value) <= FLOAT32_MAX for value in bias.values()):  # NaN is not either
        raise InvalidSampling("logit_bias", f"biases must be finite, within float32's ±{FLOAT32_MAX:g}")
    return bias


# SamplingParams' fields that the message may leave unset: they then take their default.
_UNSET_IS_DEFAULT = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty")


@dataclass(frozen=True)
class SamplingOptions:
    """One request's sampling options, checked whole as they are built and never changed after: what each of its
    steps samples with. A field's default is the server's for an option the request leaves unset (SGLang's)."""

    max_new_tokens: int = 128
    temperature: float = 1.0  # below GREEDY_BELOW_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = TOP_K_NO_LIMIT
    min_p: float = 0.0  # 0: off
    seed: int | None = None  # None: not reproducible
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # ignores stop_token_ids too (SGLang's)
    frequency_penalty: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    min_new_tokens: int = 0  # eos, stop_token_ids and stop strings are held off until the output is this long
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # kept read-only
    constraint: tuple[str, str] | None = None  # structured output: (one of CONSTRAINTS, its text)

    def __post_init__(self) -> None:
        # Read-only copies: the message they are built from stays its own.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", MappingProxyType(dict(self.logit_bias)))
        for name in RANGES:
            if (value := getattr(self, name)) is not None:
                check(name, value)
        check_logit_bias(self.logit_bias)
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidSampling("min_new_tokens", "must not exceed max_new_tokens")
        if self.constraint is not None:  # the grammar decides where the output ends: with a stop token, once complete
            why = f"cannot be combined with a {self.constraint[0]} constraint: the output ends with eos once it matches"
            if self.ignore_eos:
                raise InvalidSampling("ignore_eos", why)
            if self.min_new_tokens:
                raise InvalidSampling("min_new_tokens", why)

    @classmethod
    def of(cls, params: "SamplingParams") -> "SamplingOptions":
        """The options a SamplingParams message asks for: an option it leaves unset takes its default, a top_k <= 0
        is no limit (scheduler.proto's). Raises InvalidSampling naming the option refused."""
        given: dict[str, Any] = {name: value for name in _UNSET_IS_DEFAULT
                                 if (value := getattr(params, name)) is not None}
        if given.get("top_k", TOP_K_NO_LIMIT) <= 0:
            given["top_k"] = TOP_K_NO_LIMIT
        return cls(**given, stop_token_ids=tuple(params.stop_token_ids), ignore_eos=params.ignore_eos,
                   frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
                   min_new_tokens=params.min_new_tokens, logit_bias=params.logit_bias, constraint=params.constraint)

    @property
    def greedy(self) -> bool:
        """Whether it takes the most likely token (a temperature below GREEDY_BELOW_TEMPERATURE, as SGLang)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def cuts(self) -> bool:
        """Whether its draw keeps only part of the vocabulary (top-p, top-k or min-p), or takes one token (greedy): a
        nucleus (top-p replay) smaller than the vocabulary."""
        return self.greedy or self.top_p < 1 or self.top_k != TOP_K_NO_LIMIT or self.min_p > 0


DEFAULT_SAMPLING = SamplingOptions()  # a request that sets no option
