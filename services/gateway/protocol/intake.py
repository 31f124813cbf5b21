"""The gateway's intake: one prompt of a validated request and its token ids -> the GenerateInput the engine client
submits, after the checks that need the tokens (the prompt's and the output's lengths, logprob_start_len, the
response's size).

Every API builds its generations here: /generate (protocol/sglang.py), the OpenAI routes (protocol/openai.py) and
the public gRPC API (protocol/public.py) each see one of their prompts as a PromptRequest. Its `fields` names the
scheduler's fields as the client's API does (protocol.parse.rename_field): the intake's own refusals go through it
as the scheduler's do (EngineClient), so that every error names the field the client sent.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from flatwire_wire.scheduler import LogprobParams, SamplingParams
from flatwire_wire.steps import DetokenizeParams

from services.gateway.protocol.cost import LogprobFields, check_logprob_elements
from services.gateway.protocol.parse import InvalidRequest, ModelLimits, rename_field
from services.gateway.protocol.sampling import SamplingFields


@dataclass
class GenerateInput:
    """One generation, as the engine client submits it (EngineClient.generate)."""

    input_ids: list[int]
    sampling: SamplingParams
    logprob: LogprobParams
    detokenize: DetokenizeParams
    stream: bool = False  # replies as tokens arrive; otherwise one, the whole output
    rid: str | None = None  # the client's id for the request (SGLang's rid); None: a fresh uuid
    routing_key: str | None = None  # the client's session key: its requests go to one replica (routing.py)
    return_routed_experts: bool = False  # a MoE scheduler's record of the experts each token went to
    routed_experts_start_len: int = 0
    return_top_p_token_ids: bool = False  # top-p replay: each output token's nucleus
    lora_name: str = ""  # the LoRA adapter it runs on ("": the base model)
    cache_namespace: str = ""  # its prefix-cache namespace (cache_salt, extra_key; "": the shared one)
    # The scheduler's field names -> the client's (protocol.parse.rename_field), for a refusal that
    # got past the gateway's own checks: {"sampling": "sampling_params", ...}.
    fields: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptRequest:
    """One prompt's options from a validated request, and the client's names for the scheduler's fields."""

    sampling: SamplingFields
    max_new_tokens: int | None  # as the client asked; None: `default_max_new_tokens`
    default_max_new_tokens: int | None  # cut to what the context leaves; None: all that it leaves
    detokenize: DetokenizeParams
    logprob: LogprobParams
    fields: dict[str, str]  # GenerateInput.fields
    stream: bool = False
    rid: str | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_top_p_token_ids: bool = False
    lora_name: str = ""
    cache_namespace: str = ""

    def client_name(self, scheduler_field: str) -> str:
        """What the client's API calls a field of the scheduler's request ("sampling.max_new_tokens")."""
        name, _ = rename_field(scheduler_field, "", self.fields)
        assert name is not None  # a field in, a field out
        return name


def generate_inputs(prompts: Sequence[tuple[PromptRequest, list[int]]], limits: ModelLimits, fields: LogprobFields,
                    samples: int = 1) -> list[GenerateInput]:
    """Each prompt's `samples` generations, prompt-major (sample j seeded apart: PromptRequest.sampling), after the
    checks that need the tokens; the logprob values they ask for in all are bounded (named by `fields`)."""
    inputs = [generate_input(prompt, prompt_ids, limits, sample)
              for prompt, prompt_ids in prompts for sample in range(samples)]
    check_logprob_elements(inputs, limits, fields)
    return inputs


def generate_input(prompt: PromptRequest, prompt_ids: list[int], limits: ModelLimits,
                   sample: int = 0) -> GenerateInput:
    """The prompt's GenerateInput for its `sample`-th sample, after the checks that need its tokens."""
    max_new = check_lengths(prompt_ids, limits, prompt.client_name("input_ids"), prompt.max_new_tokens,
                            prompt.client_name("sampling.max_new_tokens"), prompt.default_max_new_tokens)
    start = prompt.logprob.logprob_start_len
    if start >= len(prompt_ids):  # -1 without prompt logprobs
        param = prompt.client_name("logprob.logprob_start_len")
        raise InvalidRequest(param, f"{param}: {start} is not a position of the {len(prompt_ids)}-token prompt; "
                                    f"use -1 (no prompt logprobs) or 0 to {len(prompt_ids) - 1}")
    return GenerateInput(input_ids=prompt_ids, sampling=prompt.sampling.sampling(max_new, sample),
                         logprob=prompt.logprob, detokenize=prompt.detokenize, stream=prompt.stream, rid=prompt.rid,
                         return_routed_experts=prompt.return_routed_experts,
                         routed_experts_start_len=prompt.routed_experts_start_len,
                         return_top_p_token_ids=prompt.return_top_p_token_ids, lora_name=prompt.lora_name,
                         cache_namespace=prompt.cache_namespace, fields=prompt.fields)


def prompt_too_long(field: str, tokens: int, max_context: int) -> InvalidRequest:
    return InvalidRequest(field, f"{field}: the prompt has {tokens} tokens; this model's context is {max_context}")


def check_lengths(ids: list[int], limits: ModelLimits, prompt_field: str, max_new_tokens: int | None,
                  max_field: str, default: int | None = None) -> int:
    """The max_new_tokens to ask for: the requested one; when None (not asked), `default` or, without one or
    past it, what the context leaves (SGLang's scheduler cuts its default so)."""
    if not ids:
        raise InvalidRequest(prompt_field, f"{prompt_field}: the prompt is empty")
    room = limits.max_context - len(ids)
    if room <= 0:
        raise prompt_too_long(prompt_field, len(ids), limits.max_context)
    if max_new_tokens is None:
        return room if default is None else min(default, room)
    if max_new_tokens > room:
        raise InvalidRequest(max_field, f"{max_field}: {len(ids)} prompt tokens + {max_new_tokens} new tokens "
                                        f"exceed this model's context of {limits.max_context}")
    return max_new_tokens
