"""Structured output (services/scheduler/sampling/grammar.py): SGLang's json_schema, regex and ebnf, OpenAI's
response_format. The mask on random logits against the vocabulary itself and the scheduler's checks, in process on
the small vocabulary (tests/conftest.py small_model_dir: Qwen's first byte-pair ranks and special tokens), then
every API through the running stack on the default model (random: the mask alone makes its output valid; seeded
sampling keeps it short and reproducible)."""

import json
import re

import grpc
import jsonschema
import numpy as np
import openai
import pytest
import torch
from flatwire_client import FlatwireClient, HttpClient
from flatwire_wire import public
from flatwire_wire.public import GENERATION, GenerateRequest
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest
from flatwire_wire.steps import FinishReason
from transformers import AutoTokenizer

from harness.checkpoints import SMALL_VOCABULARY
from harness.http import generate, post
from services.scheduler.engine.policy import Scheduler, SlotPool
from services.scheduler.kv.manager import KVManager
from services.scheduler.model.batch_step import launch_step
from services.scheduler.model.runner import ModelRunner
from services.scheduler.output.step_output import Outgoing
from services.scheduler.request import RequestStatus
from services.scheduler.sampling.grammar import Grammars, TokenMask
from services.scheduler.submit import InvalidTokenizedRequest, SubmitLimits, parse_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
REGEX = "[a-z]{3}-[0-9]{2}"
REGEX_PREFIX = re.compile("[a-z]{0,3}|[a-z]{3}-[0-9]{0,2}")  # every prefix of REGEX's strings
EBNF = 'root ::= answer " " answer\nanswer ::= "yes" | "no"'
EBNF_LANGUAGE = {f"{a} {b}" for a in ("yes", "no") for b in ("yes", "no")}
STOP = SMALL_VOCABULARY + 2  # the small vocabulary's <|im_end|>, one of its eos ids


# -- the mask and the scheduler's checks, in process -------------------------------------------------------

@pytest.fixture(scope="module")
def small_tokenizer(small_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(small_model_dir)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == STOP
    return tokenizer


@pytest.fixture(scope="module")
def grammars(small_model_dir, small_tokenizer) -> Grammars:
    return Grammars(small_model_dir, len(small_tokenizer), [STOP])


def allowed(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_mask_keeps_exactly_the_grammar_tokens_of_constrained_rows(grammars, small_tokenizer):
    """Rows 0 and 2 constrained (row 2 mid-way), 1 and 3 not: each constrained row keeps exactly the tokens
    whose text continues a prefix of the language, the other rows are untouched."""
    vocab = len(small_tokenizer)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    start, midway = (grammars.matcher(Grammars.parse("regex", REGEX), frozenset([STOP])) for _ in range(2))
    for token in small_tokenizer.encode("abc-", add_special_tokens=False):
        assert midway.accept_token(token)
    TokenMask(4, vocab, torch.device("cpu")).apply(logits, [(0, start), (2, midway)])

    # Byte-level token strings: letters, digits and "-" are themselves, anything else is not in the language.
    pieces = small_tokenizer.convert_ids_to_tokens(list(range(vocab)))
    assert allowed(logits[0]) == {i for i, p in enumerate(pieces) if p and REGEX_PREFIX.fullmatch(p)}
    assert allowed(logits[2]) == {i for i, p in enumerate(pieces) if p and re.fullmatch("[0-9]{1,2}", p)}
    assert torch.equal(logits[[1, 3]], raw[[1, 3]])
    assert torch.equal(logits[0][torch.isfinite(logits[0])], raw[0][torch.isfinite(logits[0])])


def test_a_complete_output_allows_only_the_stop_tokens(grammars, small_tokenizer):
    matcher = grammars.matcher(Grammars.parse("regex", REGEX), frozenset([STOP, 7]))
    for token in small_tokenizer.encode("abc-12", add_special_tokens=False):
        assert matcher.accept_token(token)
    logits = torch.zeros(1, len(small_tokenizer))
    TokenMask(1, len(small_tokenizer), torch.device("cpu")).apply(logits, [(0, matcher)])
    assert allowed(logits[0]) == {STOP, 7}
    assert matcher.accept_token(STOP) and matcher.is_terminated()


@pytest.fixture(scope="module")
def limits(small_tokenizer) -> SubmitLimits:
    return SubmitLimits(len(small_tokenizer), 4096, 20, (STOP,), 50)


def tokenized(**sampling) -> TokenizedRequest:
    return TokenizedRequest(rid="r", input_ids=[1, 2, 3], sampling=SamplingParams(
        max_new_tokens=8, **sampling))


@pytest.mark.parametrize(("sampling", "field", "says"), [
    (dict(json_schema='{"type": "objec"}'), "sampling.json_schema", 'Unsupported type "objec"'),
    (dict(json_schema="{not json"), "sampling.json_schema", "Failed to parse JSON"),
    (dict(regex="[a-"), "sampling.regex", "Unclosed '['"),
    (dict(ebnf="root ::= "), "sampling.ebnf", "EBNF parser error"),
    (dict(regex="a", ignore_eos=True), "sampling.ignore_eos", "ends with eos"),
    (dict(regex="a", min_new_tokens=2), "sampling.min_new_tokens", "ends with eos"),
], ids=["schema", "schema-json", "regex", "ebnf", "ignore_eos", "min_new_tokens"])
def test_scheduler_refuses_naming_the_field(grammars, limits, sampling, field, says):
    with pytest.raises(InvalidTokenizedRequest) as refused:
        parse_request(tokenized(**sampling), limits, grammars)
    assert refused.value.field == field and says in str(refused.value)
    assert "/project/" not in str(refused.value)  # xgrammar's source location is left out


def test_scheduler_without_grammars_refuses_constraints(limits):
    with pytest.raises(InvalidTokenizedRequest, match="compiles no grammars"):
        parse_request(tokenized(regex="a"), limits)
    assert parse_request(tokenized(), limits).grammar is None


def test_logprobs_stay_raw(small_model_dir, grammars):
    """A constrained and an unconstrained request on the same prompt, in one step: the same raw top-k, and the
    constrained one samples a token its grammar allows where the other takes the raw argmax."""
    runner = ModelRunner(small_model_dir, "cpu", "auto", 256, 2, max_total_tokens=1024)
    limits = SubmitLimits(runner.vocab_size, runner.max_context, 20, tuple(runner.eos_token_ids), 50)
    requests = []
    for sampling in (dict(regex="[0-9]+"), {}):
        request = parse_request(TokenizedRequest(
            rid=f"r{len(requests)}", input_ids=[39, 300, 379, 11, 1814], logprob=LogprobParams(  # "Hello, world"
                return_logprob=True, top_logprobs_num=5, logprob_start_len=-1),
            sampling=SamplingParams(max_new_tokens=4, temperature=0, **sampling)), limits, grammars)
        requests.append(request)
    kv = KVManager(runner.num_pages, runner.page_size, runner.kv_windows, prefix_cache=False)
    scheduler = Scheduler(kv, SlotPool(2), 256, chunked=True)
    for request in requests:  # the constrained one gets in line once its grammar is ready
        scheduler.add(request)
        if request.compiling is not None:
            assert request.status is RequestStatus.COMPILING
            request.compiling.result()
            ended = Outgoing()
            scheduler.compiled(ended)
            assert not ended.finished and request.status is RequestStatus.WAITING
    result = launch_step(runner, scheduler.schedule(), 256).result()
    rows = result.output
    assert rows is not None
    assert np.array_equal(rows.topk_ids[0], rows.topk_ids[1])
    assert np.allclose(rows.topk_values[0], rows.topk_values[1], atol=1e-5)  # rows of one batch
    constrained, free = result.next_ids.tolist()
    assert free == rows.topk_ids[1][0]
    assert constrained != free
    assert rows.token_logprobs[0] < rows.topk_values[0][0]  # a raw logprob below the best one


# -- through the stack --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def sample(http, **sampling) -> dict:
    """/generate of "Reply:" with these sampling params (up to 256 tokens, temperature 1, seed 1 unless given)."""
    return generate(http, text="Reply:",
                    sampling_params={"max_new_tokens": 256, "temperature": 1, "seed": 1, **sampling})


def assert_refused(response, field: str, says: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(field + ":") and says in error["message"]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("as_text", [True, False], ids=["text", "object"])
def test_generate_json_schema_validates(http, seed, as_text):
    body = sample(http, seed=seed, json_schema=json.dumps(SCHEMA) if as_text else SCHEMA)
    assert body["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(body["text"]), SCHEMA)


def test_generate_regex_and_ebnf(http):
    for seed in (1, 2):
        assert re.fullmatch(REGEX, sample(http, seed=seed, regex=REGEX)["text"])
    assert sample(http, temperature=0, ebnf=EBNF)["text"] in EBNF_LANGUAGE


def test_cut_by_max_new_tokens_is_a_prefix(http):
    body = sample(http, regex=REGEX, max_new_tokens=2)
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    assert REGEX_PREFIX.fullmatch(body["text"])


def test_generate_refusals(http):
    def ask(**sampling):
        return post(http, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, **sampling}})

    assert_refused(ask(json_schema='{"type": "objec"}'), "sampling_params.json_schema", "objec")
    assert_refused(ask(regex="[a-"), "sampling_params.regex", "Unclosed")
    assert_refused(ask(ebnf="root ::= "), "sampling_params.ebnf", "EBNF")
    assert_refused(ask(regex="a", ebnf='root ::= "a"'), "sampling_params.ebnf", "at most one")
    assert_refused(ask(regex="a", ignore_eos=True), "sampling_params.ignore_eos", "eos")


def test_chat_response_format_json_schema(openai_client, served_model):
    response = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Give me a."}], max_tokens=256, seed=2, temperature=1,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completions_response_format_json_schema(openai_client, served_model):
    response = openai_client.completions.create(
        model=served_model, prompt="a =", max_tokens=256, seed=3, temperature=1, n=2,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_json_object_is_an_object(openai_client, served_model, tokenizer):
    """Any object goes: the random model would write strings for ever, so a bias on `"` and `}` ends them (the
    mask still decides what is valid)."""
    bias = {str(tokenizer.convert_tokens_to_ids(t)): 8 for t in ('"', "}")}
    response = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "JSON please."}], max_tokens=256, seed=1,
        temperature=1,
        logit_bias=bias, response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_openai_refusals(http, served_model, openai_client):
    chat = {"model": served_model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objec"}}}
    assert_refused(http.post("/v1/chat/completions", json={**chat, "response_format": bad_schema}),
                   "response_format", "objec")
    assert_refused(http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "json_schema"}}),
                   "response_format", "requires json_schema")
    assert_refused(http.post("/v1/chat/completions", json={**chat, "regex": "[a-", "n": 2}), "regex", "Unclosed")
    assert_refused(http.post("/v1/completions", json={"model": served_model, "prompt": "Hi", "regex": "a",
                                                      "response_format": {"type": "json_object"}}),
                   "response_format", "at most one")
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model=served_model, messages=chat["messages"], max_tokens=4,
                                       response_format=bad_schema)
    assert refused.value.body["param"] == "response_format"


def test_public_grpc_api(stack):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = GENERATION.calls(channel)
        [reply] = stub["Generate"](GenerateRequest(text="Code:", sampling=public.SamplingParams(
            max_new_tokens=64, temperature=1, seed=2, regex=REGEX)))
        assert reply.finish_reason == FinishReason.STOP_TOKEN and re.fullmatch(REGEX, reply.text)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub["Generate"](GenerateRequest(text="Code:", sampling=public.SamplingParams(
                max_new_tokens=4, regex="[a-"))))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("sampling.regex:")


def test_client_package_options(stack):
    with FlatwireClient(stack.grpc_address) as grpc_client, HttpClient(stack.http_url) as http_client:
        for client in (grpc_client, http_client):
            result = client.generate("Code:", max_new_tokens=64, temperature=1, seed=2, regex=REGEX)
            assert result.finish_reason == "stop" and re.fullmatch(REGEX, result.text), client
