"""Routed experts (SGLang's return_routed_experts, for routing replay in MoE RL): a scheduler started with
--enable-return-routed-experts on a small random Qwen3-MoE (harness/checkpoints.py) returns, for every token that
went through the model, the experts each MoE layer's router chose, equal to transformers' own routers on the same
sequence; a prompt prefix found in the prefix cache keeps the routing its first prefill recorded."""

from urllib.parse import urlsplit

import httpx
import numpy as np
import pybase64
import pytest
import torch
from flatwire_client import FlatwireClient, HttpClient
from transformers import AutoModelForCausalLM

from harness.checkpoints import SMALL_VOCABULARY, moe_checkpoint
from harness.http import generate, post
from harness.stack import running
from tests.gateway.external_engine_calls import (
    miles_get_server_info,
    miles_server_args,
    sanity_check_server_args,
    slime_server_args,
    trainer_args,
)

pytestmark = pytest.mark.slow  # runs services as processes of its own

LAYERS, TOP_K, DENSE_LAYER = 3, 2, 1


@pytest.fixture(scope="module")
def moe_dir(small_model_dir, tmp_path_factory):
    """On the small vocabulary (tests/conftest.py small_model_dir): these tests send token ids and read no text."""
    return moe_checkpoint(small_model_dir, tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def moe_stack(moe_dir, log_dir):
    with running(moe_dir, log_dir, scheduler_args=("--enable-return-routed-experts", "--page-size", "4")) as stack:
        yield stack


def routed(meta: dict) -> np.ndarray:
    flat = np.frombuffer(pybase64.b64decode(meta["routed_experts"]), dtype="<i4")
    return flat.reshape(meta["routed_experts_shape"])


def reference(moe_dir, sequence: list[int]) -> np.ndarray:
    """transformers' routers on the sequence: [tokens, layers, top_k], -1 in the dense layer."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sequence]), output_router_logits=True).router_logits
    expected = np.full((len(sequence), LAYERS, TOP_K), -1, dtype=np.int32)
    moe_layers = [layer for layer in range(LAYERS) if layer != DENSE_LAYER]
    for layer, router_logits in zip(moe_layers, logits):
        expected[:, layer] = router_logits.reshape(len(sequence), -1).topk(TOP_K, dim=-1).indices.numpy()
    return expected


def ask(stack, prompt: list[int], new_tokens: int) -> dict:
    return generate(stack.http_url, input_ids=prompt, return_routed_experts=True,
                    sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})


def test_every_token_s_experts_match_transformers(moe_stack, moe_dir):
    prompt = np.random.default_rng(1).integers(0, SMALL_VOCABULARY, 21).tolist()
    body = ask(moe_stack, prompt, 8)
    experts = routed(body["meta_info"])
    sequence = prompt + body["output_ids"][:-1]  # the last sampled token never went through the model
    assert experts.shape == (len(sequence), LAYERS, TOP_K)
    expected = reference(moe_dir, sequence)
    assert (experts[:, DENSE_LAYER] == -1).all()
    np.testing.assert_array_equal(np.sort(experts, axis=-1), np.sort(expected, axis=-1))


def test_a_cached_prefix_keeps_its_routing(moe_stack):
    prompt = np.random.default_rng(2).integers(0, SMALL_VOCABULARY, 30).tolist()
    first = ask(moe_stack, prompt, 4)
    second = ask(moe_stack, prompt + [11, 12, 13], 4)
    assert second["meta_info"]["cached_tokens"] >= 24  # whole pages of the shared prompt
    np.testing.assert_array_equal(routed(second["meta_info"])[:30], routed(first["meta_info"])[:30])


def test_only_asked_for(moe_stack):
    body = generate(moe_stack.http_url, text="Hello", sampling_params={"max_new_tokens": 2})
    assert "routed_experts" not in body["meta_info"]


def test_a_scheduler_without_routing_refuses_it(http):
    reply = post(http, "/generate", {"text": "Hello", "return_routed_experts": True,
                                     "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "return_routed_experts" and "--enable-return-routed-experts" in error["message"]


def test_the_public_grpc_api_and_the_client_carry_them(moe_stack):
    prompt = np.random.default_rng(3).integers(0, SMALL_VOCABULARY, 13).tolist()
    expected = routed(ask(moe_stack, prompt, 5)["meta_info"])
    options = dict(max_new_tokens=5, temperature=0, ignore_eos=True, return_routed_experts=True)
    with FlatwireClient(moe_stack.grpc_address) as client:
        np.testing.assert_array_equal(client.generate(input_ids=prompt, **options).routed_experts, expected)
        stream = client.stream(input_ids=prompt, **options)
        list(stream)
        assert all(chunk.routed_experts is None for chunk in stream.chunks[:-1])  # with the last chunk only
        np.testing.assert_array_equal(stream.result.routed_experts, expected)
        assert client.generate(input_ids=prompt, max_new_tokens=2).routed_experts is None
    with HttpClient(moe_stack.http_url) as http:  # /generate's packed protobuf
        np.testing.assert_array_equal(http.generate(input_ids=prompt, **options).routed_experts, expected)


def test_openai_routes_carry_them_in_meta_info(moe_stack):
    prompt = np.random.default_rng(4).integers(0, SMALL_VOCABULARY, 9).tolist()
    expected = routed(ask(moe_stack, prompt, 3)["meta_info"])
    with httpx.Client(base_url=moe_stack.http_url, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                "return_routed_experts": True, "return_meta_info": True}
        reply = post(http, "/v1/completions", body)
        assert reply.status_code == 200, reply.text
        np.testing.assert_array_equal(routed(reply.json()["choices"][0]["meta_info"]), expected)
        refused = post(http, "/v1/completions", {**body, "return_meta_info": False})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_routed_experts"


def test_routed_experts_start_len(moe_stack):
    prompt = np.random.default_rng(5).integers(0, SMALL_VOCABULARY, 12).tolist()
    whole = routed(ask(moe_stack, prompt, 4)["meta_info"])
    body = generate(moe_stack.http_url, input_ids=prompt, return_routed_experts=True, routed_experts_start_len=5,
                    sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    np.testing.assert_array_equal(routed(body["meta_info"]), whole[5:])
    with FlatwireClient(moe_stack.grpc_address) as client:
        result = client.generate(input_ids=prompt, max_new_tokens=4, temperature=0, ignore_eos=True,
                                 return_routed_experts=True, routed_experts_start_len=5)
        np.testing.assert_array_equal(result.routed_experts, whole[5:])
    reply = post(moe_stack.http_url, "/generate", {"input_ids": prompt, "return_routed_experts": True,
                                                   "routed_experts_start_len": 13,
                                                   "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "routed_experts_start_len", reply.text


@pytest.mark.parametrize("compute", [slime_server_args, miles_server_args], ids=["slime", "miles"])
def test_a_trainer_with_routing_replay_attaches(moe_stack, compute):
    """slime's and miles' --rollout-external check with --use-rollout-routing-replay (tests/gateway/
    test_external_engines.py): this scheduler records the routing, and /get_server_info says so."""
    url = urlsplit(moe_stack.http_url)
    expected, fields = compute(trainer_args(offload_rollout=True, use_rollout_routing_replay=True), 0, url.hostname,
                               url.port)
    assert "enable_return_routed_experts" in fields
    sanity_check_server_args(miles_get_server_info(moe_stack.http_url), expected, fields)
