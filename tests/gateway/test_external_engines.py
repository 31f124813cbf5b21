"""slime and miles attaching to a running engine (--rollout-external, issue 49): /get_server_info echoes the SGLang
server arguments they would have launched with, and their own check (tests/gateway/external_engine_calls.py, the
shape of their sources) passes where flatwire is what they ask for, and names the argument where it is not.

flatwire's release_memory_occupation always frees the model's memory: that is what SGLang's enable_memory_saver
says, so the check passes for a trainer that offloads its rollout (--offload-rollout, --colocate) and names
enable_memory_saver for one that does not. Routing replay: tests/scheduler/test_routed_experts.py.
"""

from urllib.parse import urlsplit

import pytest

from tests.gateway.external_engine_calls import (
    miles_get_server_info,
    miles_server_args,
    sanity_check_server_args,
    slime_get_server_info,
    slime_server_args,
    trainer_args,
)

FRAMEWORKS = {"slime": (slime_server_args, slime_get_server_info), "miles": (miles_server_args, miles_get_server_info)}


def attach(stack, framework: str, **args) -> None:
    """What the framework's SGLangEngine._init_external does with the engine at the stack's gateway."""
    compute, get_server_info = FRAMEWORKS[framework]
    url = urlsplit(stack.http_url)
    expected, fields = compute(trainer_args(**args), 0, url.hostname, url.port)
    sanity_check_server_args(get_server_info(stack.http_url), expected, fields)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_trainer_that_offloads_its_rollout_attaches(stack, framework):
    attach(stack, framework, offload_rollout=True)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_one_that_keeps_it_is_told_the_engine_releases_memory(stack, framework):
    with pytest.raises(AssertionError, match=r"^name='enable_memory_saver' expect_value=False actual_value=True"):
        attach(stack, framework, offload_rollout=False)


@pytest.mark.parametrize(("framework", "args", "field"), [
    ("slime", {"fp16": True}, "dtype"),  # the stack computes in float32
    ("miles", {"rollout_num_gpus_per_engine": 2}, "tp_size"),
    ("miles", {"sglang_dp_size": 2}, "dp_size"),  # one scheduler replica
    ("miles", {"use_rollout_indexer_replay": True}, "enable_return_indexer_topk"),
    ("slime", {"use_rollout_routing_replay": True}, "enable_return_routed_experts")])
def test_what_the_engine_is_not_is_named(stack, framework, args, field):
    with pytest.raises(AssertionError, match=rf"^name='{field}'"):
        attach(stack, framework, offload_rollout=True, **args)


def test_miles_checks_where_the_engine_listens(stack):
    """miles compares host and port too: an address the engine does not listen on is named."""
    url = urlsplit(stack.http_url)
    expected, fields = miles_server_args(trainer_args(offload_rollout=True), 0, "10.0.0.1", url.port)
    with pytest.raises(AssertionError, match=r"^name='host'"):
        sanity_check_server_args(miles_get_server_info(stack.http_url), expected, fields)
