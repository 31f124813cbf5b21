"""The sampling options' one set of defaults and rules (flatwire_wire/sampling.py), in process: the defaults, each
rule's refusal naming its option, the options built from a message, and their being frozen once built."""

import dataclasses
import math

import pytest
from flatwire_wire.sampling import (
    DEFAULT_SAMPLING,
    FLOAT32_MAX,
    INT32_MAX,
    RANGES,
    TOP_K_NO_LIMIT,
    UINT32_MAX,
    UINT64_MAX,
    InvalidSampling,
    SamplingOptions,
    check,
)
from flatwire_wire.scheduler import SamplingParams


def test_the_defaults_are_sglangs():
    assert {f.name: getattr(DEFAULT_SAMPLING, f.name) for f in dataclasses.fields(SamplingOptions)} == dict(
        max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=TOP_K_NO_LIMIT, min_p=0.0, seed=None,
        stop_token_ids=(), ignore_eos=False, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
        min_new_tokens=0, logit_bias={}, constraint=None)
    assert not DEFAULT_SAMPLING.greedy


def test_a_message_that_sets_nothing_gets_the_defaults():
    assert SamplingOptions.of(SamplingParams()) == DEFAULT_SAMPLING


@pytest.mark.parametrize("top_k", [0, -1, -7])
def test_a_top_k_of_zero_or_below_on_the_wire_is_no_limit(top_k):
    assert SamplingOptions.of(SamplingParams(top_k=top_k)).top_k == TOP_K_NO_LIMIT


def test_a_message_that_sets_every_option_gets_them_all():
    params = SamplingParams(max_new_tokens=9, temperature=0.5, top_p=0.75, top_k=3, min_p=0.125, seed=7,
                            stop_token_ids=[1, 2], ignore_eos=False, frequency_penalty=0.5, presence_penalty=-0.5,
                            repetition_penalty=1.5, min_new_tokens=2, logit_bias={4: 1.0})
    assert SamplingOptions.of(params) == SamplingOptions(
        max_new_tokens=9, temperature=0.5, top_p=0.75, top_k=3, min_p=0.125, seed=7, stop_token_ids=(1, 2),
        frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.5, min_new_tokens=2, logit_bias={4: 1.0})
    assert SamplingOptions.of(SamplingParams(ebnf="root ::= [a]")).constraint == ("ebnf", "root ::= [a]")


# (option, values its rule refuses, values at the edges it takes)
RULES = [
    ("max_new_tokens", [-1, UINT32_MAX + 1], [0, UINT32_MAX]),
    ("temperature", [-1e-9, math.nan, math.inf, 1e39], [0.0, FLOAT32_MAX]),
    ("top_p", [0.0, 1.0001, math.nan, -math.inf], [1e-50, 1.0]),
    ("top_k", [0, -2, INT32_MAX + 1], [TOP_K_NO_LIMIT, 1, INT32_MAX]),
    ("min_p", [-0.1, 1.5, math.nan], [0.0, 1.0]),
    ("seed", [-1, UINT64_MAX + 1], [0, UINT64_MAX]),
    ("frequency_penalty", [-2.01, 2.5, math.nan, math.inf], [-2.0, 2.0]),
    ("presence_penalty", [-3.0, 2.01, math.nan], [-2.0, 2.0]),
    ("repetition_penalty", [0.0, -1.0, 2.5, math.nan, math.inf], [1e-9, 2.0]),
    ("min_new_tokens", [-1, INT32_MAX + 1], [0, 128]),
]


def test_every_ranged_option_has_a_case():
    assert [name for name, _, _ in RULES] == list(RANGES)


@pytest.mark.parametrize(("name", "refused", "taken"), RULES, ids=[name for name, _, _ in RULES])
def test_each_rule_refuses_naming_its_option(name, refused, taken):
    for value in refused:
        with pytest.raises(InvalidSampling) as caught:
            SamplingOptions(**{name: value})
        assert caught.value.field == name, value
        assert str(caught.value) == f"must be {RANGES[name]}"
        with pytest.raises(InvalidSampling):
            check(name, value)
    for value in taken:
        assert getattr(SamplingOptions(**{name: value}), name) == value
        assert check(name, value) == value


def test_the_rules_read_as_their_ranges():
    assert str(RANGES["top_p"]) == "in (0, 1]"
    assert str(RANGES["frequency_penalty"]) == "in [-2, 2]"
    assert str(RANGES["top_k"]) == f"-1 (off) or in [1, {INT32_MAX}]"


@pytest.mark.parametrize("bias", [math.inf, -math.inf, math.nan, 1e39])
def test_a_bias_that_is_not_a_finite_float32_is_refused(bias):
    with pytest.raises(InvalidSampling) as caught:
        SamplingOptions(logit_bias={5: bias})
    assert caught.value.field == "logit_bias"
    assert SamplingOptions(logit_bias={5: -FLOAT32_MAX}).logit_bias == {5: -FLOAT32_MAX}


def test_min_new_tokens_may_not_exceed_max_new_tokens():
    with pytest.raises(InvalidSampling) as caught:
        SamplingOptions(max_new_tokens=4, min_new_tokens=5)
    assert (caught.value.field, str(caught.value)) == ("min_new_tokens", "must not exceed max_new_tokens")
    assert SamplingOptions(max_new_tokens=4, min_new_tokens=4).min_new_tokens == 4


@pytest.mark.parametrize(("options", "field"), [(dict(ignore_eos=True), "ignore_eos"),
                                                (dict(min_new_tokens=1), "min_new_tokens")])
def test_a_constraint_ends_the_output_itself(options, field):
    with pytest.raises(InvalidSampling, match="cannot be combined with a regex constraint") as caught:
        SamplingOptions(constraint=("regex", "a+"), **options)
    assert caught.value.field == field
    assert SamplingOptions(**options).constraint is None  # either alone is fine


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (1e-45, True), (9.9e-7, True), (1e-6, False),
                                                     (0.7, False)])
def test_a_temperature_below_the_threshold_is_greedy(temperature, greedy):
    assert SamplingOptions(temperature=temperature).greedy is greedy


def test_built_once_the_options_do_not_change():
    bias, stops = {4: 1.0}, [3]
    options = SamplingOptions.of(SamplingParams(logit_bias=bias, stop_token_ids=stops))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.temperature = 0.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.logit_bias[4] = 2.0  # type: ignore[index]
    bias[4], bias[5] = 9.0, 9.0
    stops.append(7)  # the message changing after the build changes nothing
    assert options.logit_bias == {4: 1.0} and options.stop_token_ids == (3,)
