"""The request options every client takes, as the public gRPC request and as /generate's JSON."""

from dataclasses import dataclass, field

from flatwire_wire.logprobs import LogprobsMode
from flatwire_wire.public import GenerateRequest, SamplingParams
from flatwire_wire.sampling import DEFAULT_SAMPLING


@dataclass(frozen=True)
class Options:
    """Sampling, logprob and stop options: the fields of GenerateRequest (protos/flatwire/v1/generate.proto). A
    sampling option left None takes the server's default (flatwire_wire.sampling.DEFAULT_SAMPLING)."""

    max_new_tokens: int = DEFAULT_SAMPLING.max_new_tokens
    temperature: float | None = None  # 0: greedy
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Change what is sampled, and the logprobs returned unless they are raw_logprobs.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_new_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured output, at most one: the output follows the JSON schema (JSON text), regex or EBNF grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    return_logprob: bool = False  # implied by top_logprobs_num or token_ids_logprob
    top_logprobs_num: int = 0
    logprob_start_len: int | None = None  # None: no prompt logprobs
    token_ids_logprob: tuple[int, ...] = ()
    # raw_logprobs, processed_logprobs, sglang_logprobs; None: the server's default (sglang_logprobs, or raw_logprobs
    # with the gateway's --return-original-logprob)
    logprobs_mode: str | None = None
    stop: tuple[str, ...] = field(default=())
    skip_special_tokens: bool | None = None
    no_stop_trim: bool = False
    return_routed_experts: bool = False  # MoE: Generation.routed_experts (a server with --enable-return-routed-experts)
    routed_experts_start_len: int = 0  # from this sequence position on
    return_top_p_token_ids: bool = False  # top-p replay: Generation.top_p, each token's nucleus

    @property
    def wants_logprobs(self) -> bool:
        return self.return_logprob or self.top_logprobs_num > 0 or bool(self.token_ids_logprob)

    def grpc_request(self, text: str | None, input_ids: list[int] | None, stream: bool) -> GenerateRequest:
        sampling = SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, min_new_tokens=self.min_new_tokens,
            logit_bias=dict(self.logit_bias), json_schema=self.json_schema, regex=self.regex, ebnf=self.ebnf)
        return GenerateRequest(
            text=text or "", input_ids=list(input_ids or []), sampling=sampling, return_logprob=self.wants_logprobs,
            top_logprobs_num=self.top_logprobs_num, logprob_start_len=self.logprob_start_len,
            token_ids_logprob=list(self.token_ids_logprob), stop=list(self.stop),
            skip_special_tokens=self.skip_special_tokens, no_stop_trim=self.no_stop_trim, stream=stream,
            logprobs_mode=LogprobsMode.named(self.logprobs_mode) if self.logprobs_mode else LogprobsMode.UNSPECIFIED,
            return_routed_experts=self.return_routed_experts, routed_experts_start_len=self.routed_experts_start_len,
            return_top_p_token_ids=self.return_top_p_token_ids)

    def generate_body(self, text: str | None, input_ids: list[int] | None, stream: bool) -> dict:
        """/generate's JSON (SGLang's field names)."""
        sampling = {"max_new_tokens": self.max_new_tokens, "stop_token_ids": list(self.stop_token_ids),
                    "ignore_eos": self.ignore_eos, "stop": list(self.stop), "no_stop_trim": self.no_stop_trim,
                    "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                    "min_new_tokens": self.min_new_tokens,
                    "logit_bias": {str(token): bias for token, bias in self.logit_bias.items()}}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "skip_special_tokens", "repetition_penalty",
                     "json_schema", "regex", "ebnf"):
            if (value := getattr(self, name)) is not None:
                sampling[name] = value
        if self.return_top_p_token_ids:
            sampling["custom_params"] = {"return_top_p_token_ids": True}
        body = {"sampling_params": sampling, "return_logprob": self.wants_logprobs,
                "top_logprobs_num": self.top_logprobs_num, "token_ids_logprob": list(self.token_ids_logprob),
                "stream": stream, "text" if text is not None else "input_ids": text if text is not None else input_ids}
        if self.logprob_start_len is not None:
            body["logprob_start_len"] = self.logprob_start_len
        if self.logprobs_mode is not None:
            body["logprobs_mode"] = self.logprobs_mode
        if self.return_routed_experts:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = self.routed_experts_start_len
        return body
