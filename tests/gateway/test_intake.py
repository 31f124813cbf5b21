"""The gateway's intake (protocol/intake.py) in-process: every API's prompt becomes a GenerateInput through it, the
public gRPC request maps field by field onto /generate's sampling fields, and errors name the client's field."""

import dataclasses

import pytest
from flatwire_wire import public
from flatwire_wire.logprobs import LogprobsMode

from services.gateway.protocol.cost import LogprobFields
from services.gateway.protocol.intake import generate_inputs
from services.gateway.protocol.openai import ChatCompletionRequest, CompletionRequest, prompt_request
from services.gateway.protocol.parse import InvalidRequest, ModelLimits, parse_data
from services.gateway.protocol.public import LOGPROB_FIELDS, PublicGenerateRequest, PublicSampling
from services.gateway.protocol.sglang import GenerateRequest

LIMITS = ModelLimits(vocab_size=1000, max_context=256, max_top_logprobs=8, max_batch_size=8)
FIELDS = LogprobFields(top_k="top_logprobs_num", max_new_tokens="max_new_tokens")


def _public_input(request: public.GenerateRequest):
    req = PublicGenerateRequest.of(request, LIMITS)
    [inp] = generate_inputs([(req.prompt(), req.input_ids)], LIMITS, LOGPROB_FIELDS)
    return inp


def test_every_public_field_is_a_field_of_the_checked_request():
    """A field of generate.proto that these models did not declare would be refused whenever it is set."""
    assert {f.name for f in dataclasses.fields(public.GenerateRequest)} <= set(PublicGenerateRequest.model_fields)
    assert {f.name for f in dataclasses.fields(public.SamplingParams)} <= set(PublicSampling.model_fields)


def test_a_request_that_sets_every_public_field_reaches_the_generate_input():
    sampling = public.SamplingParams(max_new_tokens=5, temperature=0.5, top_p=0.75, top_k=3, min_p=0.125, seed=7,
                                     stop_token_ids=[1], ignore_eos=True, frequency_penalty=0.5, presence_penalty=-0.5,
                                     repetition_penalty=1.5, min_new_tokens=2, logit_bias={4: 1.0}, regex="a+")
    inp = _public_input(public.GenerateRequest(
        input_ids=[9, 8, 7], sampling=sampling, return_logprob=True, top_logprobs_num=2, logprob_start_len=1,
        token_ids_logprob=[3], stop=["x"], skip_special_tokens=False, no_stop_trim=True, stream=True,
        logprobs_mode=LogprobsMode.PROCESSED, return_routed_experts=True, routed_experts_start_len=1))
    assert inp.input_ids == [9, 8, 7] and inp.stream and inp.rid is None
    assert dataclasses.asdict(inp.sampling) == {**dataclasses.asdict(sampling), "json_schema": None, "ebnf": None}
    assert (inp.logprob.return_logprob, inp.logprob.top_logprobs_num, inp.logprob.logprob_start_len,
            inp.logprob.token_ids_logprob, inp.logprob.logprobs_mode) == (True, 2, 1, [3], LogprobsMode.PROCESSED)
    assert (inp.detokenize.stop, inp.detokenize.skip_special_tokens, inp.detokenize.no_stop_trim,
            inp.detokenize.min_new_tokens) == (["x"], False, True, 2)
    assert inp.return_routed_experts and inp.routed_experts_start_len == 1


def test_a_public_field_left_at_its_default_takes_the_protos_default():
    inp = _public_input(public.GenerateRequest(input_ids=[9, 8, 7], sampling=public.SamplingParams(top_k=-5)))
    assert inp.sampling.max_new_tokens == 128 and inp.sampling.temperature == 1.0
    assert inp.sampling.top_k == 0  # generate.proto's top_k <= 0: no limit
    assert inp.detokenize.skip_special_tokens and inp.logprob.logprob_start_len == -1
    assert inp.logprob.logprobs_mode == LogprobsMode.UNSPECIFIED
    cut = _public_input(public.GenerateRequest(input_ids=list(range(252))))
    assert cut.sampling.max_new_tokens == 4  # the default, cut to what the context leaves


def test_a_public_field_without_a_check_is_refused_by_name():
    @dataclasses.dataclass
    class Newer(public.GenerateRequest):  # generate.proto with a field this gateway does not know yet
        priority: int = 0

    assert PublicGenerateRequest.of(Newer(input_ids=[1]), LIMITS).input_ids == [1]  # unset: absent
    with pytest.raises(InvalidRequest) as refused:
        PublicGenerateRequest.of(Newer(input_ids=[1], priority=3), LIMITS)
    assert refused.value.param == "priority"


@pytest.mark.parametrize(("body", "param"), [
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1000}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {"max_new_tokens": 1000}]}, "sampling_params[1].max_new_tokens"),
    ({"input_ids": [[1], [2]], "return_logprob": True, "logprob_start_len": [0, 1]}, "logprob_start_len[1]"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 1}, "logprob_start_len"),
    ({"input_ids": [1] * 256}, "input_ids"),
    ({"text": "long", "input_ids": None}, "text"),
])
def test_generate_errors_name_the_clients_field(body, param):
    req = parse_data(GenerateRequest, body, LIMITS)
    ids = [[0] * 256] if "text" in body else req.prompts()
    with pytest.raises(InvalidRequest) as refused:
        generate_inputs([(req.prompt(i), prompt_ids) for i, prompt_ids in enumerate(ids)], LIMITS, FIELDS)
    assert refused.value.param == param and refused.value.message.startswith(param + ": ")


@pytest.mark.parametrize(("model", "body", "param"), [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000},
     "max_completion_tokens"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}, "max_tokens"),
    (CompletionRequest, {"prompt": [1, 2], "max_tokens": 1000}, "max_tokens"),
])
def test_openai_errors_name_the_clients_field(model, body, param):
    req = parse_data(model, {"model": "m", **body}, LIMITS)
    with pytest.raises(InvalidRequest) as refused:
        generate_inputs([(prompt_request(req), [1, 2])], LIMITS, FIELDS)
    assert refused.value.param == param
    with pytest.raises(InvalidRequest) as empty:
        generate_inputs([(prompt_request(req), [])], LIMITS, FIELDS)
    assert empty.value.param == ("messages" if model is ChatCompletionRequest else "prompt")


def test_samples_are_prompt_major_and_seeded_apart():
    req = parse_data(GenerateRequest, {"input_ids": [[1], [2, 3]], "sampling_params": {"n": 2, "seed": 5}}, LIMITS)
    inputs = generate_inputs([(req.prompt(i), ids) for i, ids in enumerate(req.prompts())], LIMITS, FIELDS,
                             req.samples_per_prompt)
    assert [(inp.input_ids, inp.sampling.seed) for inp in inputs] == [([1], 5), ([1], 6), ([2, 3], 5), ([2, 3], 6)]
