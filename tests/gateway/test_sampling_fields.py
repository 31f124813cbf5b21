"""The gateway's sampling fields (protocol/sampling.py) in process: every API's defaults and refusals are the server's
one set (flatwire_wire.sampling), the same the scheduler builds a request's options by."""

import pytest
from flatwire_wire import public
from flatwire_wire.sampling import DEFAULT_SAMPLING, RANGES, InvalidSampling, SamplingOptions

from services.gateway.protocol.openai import ChatCompletionRequest
from services.gateway.protocol.parse import InvalidRequest, ModelLimits, parse_data
from services.gateway.protocol.public import PublicGenerateRequest
from services.gateway.protocol.sampling import SamplingParamsFields
from services.gateway.protocol.sglang import GenerateRequest

LIMITS = ModelLimits(vocab_size=1000, max_context=256, max_top_logprobs=8, max_batch_size=8)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _below(name: str) -> int | float:
    """A value just under the option's range (JSON cannot carry the NaN and infinities it also refuses)."""
    bounds = RANGES[name]
    return bounds.low if bounds.low_open else bounds.low - 1


def test_the_fields_default_to_the_servers_defaults():
    fields = SamplingParamsFields()
    for name, field in SamplingParamsFields.model_fields.items():
        if name in RANGES:
            assert getattr(fields, name) == getattr(DEFAULT_SAMPLING, name), name
            assert field.default == getattr(DEFAULT_SAMPLING, name), name


@pytest.mark.parametrize("name", list(RANGES))
def test_generate_refuses_what_the_scheduler_refuses_with_its_message(name):
    with pytest.raises(InvalidSampling) as scheduler:
        SamplingOptions(**{name: _below(name)})
    with pytest.raises(InvalidRequest) as gateway:
        parse_data(GenerateRequest, {"text": "a", "sampling_params": {name: _below(name)}}, LIMITS)
    assert gateway.value.param == f"sampling_params.{name}"
    assert gateway.value.message == f"sampling_params.{name}: {scheduler.value}"


@pytest.mark.parametrize("name", [name for name in RANGES if name not in ("max_new_tokens", "min_new_tokens")])
def test_the_openai_routes_and_the_public_api_refuse_by_the_same_rule(name):
    rule = f"must be {RANGES[name]}" if name != "temperature" else "must be in [0, 2]"  # OpenAI's own range
    with pytest.raises(InvalidRequest) as chat:
        parse_data(ChatCompletionRequest, {**CHAT, name: _below(name)}, LIMITS)
    assert (chat.value.param, chat.value.message) == (name, f"{name}: {rule}")
    if name == "top_k":
        return  # generate.proto's top_k <= 0 is no limit
    with pytest.raises(InvalidRequest) as grpc:
        PublicGenerateRequest.of(public.GenerateRequest(
            input_ids=[1], sampling=public.SamplingParams(**{name: _below(name)})), LIMITS)
    assert grpc.value.param == f"sampling.{name}" and grpc.value.message.endswith(f"must be {RANGES[name]}")


def test_openai_temperature_stays_within_openais_range():
    with pytest.raises(InvalidRequest) as refused:
        parse_data(ChatCompletionRequest, {**CHAT, "temperature": 2.5}, LIMITS)
    assert refused.value.param == "temperature"
    assert parse_data(GenerateRequest, {"text": "a", "sampling_params": {"temperature": 2.5}}, LIMITS)
