"""LoRA adapters batched in one step (issue 50), in process: requests on different adapters and on the base model
share steps, and each request's greedy tokens and logprobs are those of its adapter merged into the weights by PEFT;
adapters load, unload and are replaced between two steps while requests run; the prefix cache never serves KV of
another adapter, of an adapter's earlier weights, or of another cache namespace (cache_salt); the loaded adapters
are bounded, least recently used first, never one a request runs on.

Adapters are made by PEFT on a small random Qwen3 (lora_adapters.py)."""

import dataclasses

import numpy as np
import pytest
import torch
from flatwire_wire.scheduler import LogprobParams, SamplingParams, TokenizedRequest
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from services.scheduler.config import SchedulerConfig
from services.scheduler.engine.control import LoadAdapter, UnloadAdapter
from services.scheduler.engine.lora_registry import of_adapter
from services.scheduler.model.lora_adapter import AdapterRefused, read_adapter_dir
from services.scheduler.model.runner import ModelRunner
from services.scheduler.submit import InvalidTokenizedRequest, parse_request
from tests.scheduler.engine_run import K, Run, check, prompts, tiny_checkpoint
from tests.scheduler.lora_adapters import merged, peft_adapter

VOCAB = 1024
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# Four adapters of different ranks, scalings and targets (rslora, a per-module rank).
ADAPTERS = {"a": dict(r=4, alpha=8, modules=["q_proj", "v_proj"]),
            "b": dict(r=8, alpha=16, modules=ATTENTION + MLP),
            "c": dict(r=16, alpha=8, modules=["o_proj", *MLP], use_rslora=True),
            "d": dict(r=2, alpha=4, modules=["k_proj", "down_proj"], rank_pattern={"down_proj": 6})}


def small_qwen3():
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=1024, eos_token_id=1, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("lora-base"), small_qwen3)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """name -> (its PEFT directory, PEFT's merge of it: the reference)."""
    path, _ = base
    made = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        spec = dict(spec)
        directory = peft_adapter(path, tmp_path_factory.mktemp(f"adapter-{name}"), seed, spec.pop("r"),
                                 spec.pop("alpha"), spec.pop("modules"), **spec)
        made[name] = directory, merged(path, directory)
    return made


def lora_run(base, adapters, names=(), slots: int = 32, **options) -> Run:
    path, _ = base
    return Run(path, slots=slots, enable_lora=True, lora_paths=[f"{n}={adapters[n][0]}" for n in names], **options)


def load(run: Run, name: str, directory, replace: bool = False, pinned: bool = False):
    """Load an adapter as the service does: read off the engine thread, installed by the next step."""
    lora = run.runner.lora
    adapter = read_adapter_dir(name, str(directory), lora.features, lora.max_rank, lora.dtype)
    adapter.pinned = pinned
    return run.engine.control(LoadAdapter(adapter=adapter, replace=replace))


def steps_with_adapters(run: Run) -> list[set]:
    """Wrap the runner's LoRA preparation: per step, the adapters (None: the base model) its rows run on."""
    seen = []
    lora = run.runner.lora
    prepare = lora.prepare

    def recording(adapters, counts):
        seen.append({adapter.name if adapter is not None else None for adapter in adapters})
        prepare(adapters, counts)

    lora.prepare = recording
    return seen


def test_a_step_of_32_requests_over_4_adapters_and_the_base_model_equals_each_adapter_merged(base, adapters):
    path, reference = base
    run = lora_run(base, adapters, ADAPTERS, own_runner=True, max_loras_per_batch=4)
    seen = steps_with_adapters(run)
    cases = prompts(50, [5 + (3 * i) % 23 for i in range(32)], VOCAB)
    on = {rid: [*ADAPTERS, ""][i % 5] for i, rid in enumerate(cases)}  # 7 requests per adapter, 4 on the base
    for i, (rid, ids) in enumerate(cases.items()):
        run.submit(rid, ids, 8, logprob_start_len=0 if i % 4 == 0 else -1, lora_name=on[rid])
    run.run()
    assert any(len(step) == 5 for step in seen), "the four adapters and the base model shared a step"
    for i, (rid, ids) in enumerate(cases.items()):
        model = adapters[on[rid]][1] if on[rid] else reference
        check(model, ids, 8, run.result(rid), logprob_start_len=0 if i % 4 == 0 else -1)
    for name in ADAPTERS:  # every adapter changes what is generated
        rid = next(r for r in cases if on[r] == name)
        with torch.no_grad():
            base_tokens = reference.generate(torch.tensor([cases[rid]]), max_new_tokens=8, do_sample=False)[0]
        assert run.output(rid) != base_tokens[len(cases[rid]):].tolist(), name


def test_requests_on_more_adapters_than_a_step_takes_wait_for_room(base, adapters):
    path, reference = base
    run = lora_run(base, adapters, ["a", "b", "c"], own_runner=True, max_loras_per_batch=2)
    seen = steps_with_adapters(run)
    cases = prompts(51, [9, 14, 6, 11, 17, 8], VOCAB)
    on = {rid: "abc"[i % 3] for i, rid in enumerate(cases)}
    for rid, ids in cases.items():
        run.submit(rid, ids, 6, lora_name=on[rid])
    run.run()
    assert max(len(step) for step in seen) == 2 and len(seen) > 8  # never three; the third waited
    for rid, ids in cases.items():
        check(adapters[on[rid]][1], ids, 6, run.result(rid))


def test_loading_an_adapter_while_requests_run_pauses_none_of_them(base, adapters):
    run = lora_run(base, adapters, ["a"])
    cases = prompts(52, [7, 12, 9], VOCAB)
    for i, (rid, ids) in enumerate(cases.items()):
        run.submit(rid, ids, 24, stream_interval=1, lora_name="a" if i < 2 else "")
    run.step(2)  # prefilled, decoding
    before = {rid: len(run.output(rid)) for rid in cases}
    steps = run.engine.stats.steps
    loaded = load(run, "b", adapters["b"][0])
    run.step()
    assert loaded.done() and loaded.result().success
    run.step(3)
    assert run.engine.stats.steps == steps + 4
    assert all(len(run.output(rid)) == before[rid] + 4 for rid in cases), "every step gave every request a token"
    run.submit("on-b", cases["r2"], 6, lora_name="b")
    run.run()
    check(adapters["b"][1], cases["r2"], 6, run.result("on-b"))
    for rid, ids in cases.items():
        check(adapters["a"][1] if rid != "r2" else base[1], ids, 24, run.result(rid))


def test_an_adapter_unloaded_while_a_request_runs_on_it_serves_that_request_to_its_end_and_no_new_one(base, adapters):
    run = lora_run(base, adapters, ["a"])
    ids = prompts(53, [13], VOCAB)["r0"]
    run.submit("old", ids, 12, lora_name="a")
    run.step(3)
    unloaded = run.engine.control(UnloadAdapter(name="a"))
    run.step()
    assert unloaded.result().success and unloaded.result().loaded == []
    with pytest.raises(InvalidTokenizedRequest) as refused:
        run.submit("new", ids, 4, lora_name="a")
    assert refused.value.field == "lora_name" and refused.value.not_found
    assert "`a` does not exist" in str(refused.value)
    adapter = run.engine.scheduler.running[0].adapter
    assert any(of_adapter(ns, adapter) for ns in run.engine.kv.prefix_cache.roots)
    run.run()
    check(adapters["a"][1], ids, 12, run.result("old"))
    # Once no request holds it, its cached KV goes with it.
    assert not any(of_adapter(ns, adapter) for ns in run.engine.kv.prefix_cache.roots)


def test_an_adapter_replaced_while_serving_never_serves_kv_of_its_old_weights(base, adapters):
    run = lora_run(base, adapters)
    load(run, "x", adapters["a"][0])
    run.step()  # the load applies between two steps
    ids = prompts(54, [30], VOCAB)["r0"]
    run.submit("first", ids, 4, lora_name="x")
    run.run()
    run.submit("again", ids, 10, lora_name="x", stream_interval=1)
    run.step(2)
    assert run.finish("first").cached_tokens == 0
    replaced = load(run, "x", adapters["b"][0], replace=True)
    run.step()
    assert replaced.result().success, replaced.result().message
    run.submit("replaced", ids, 10, lora_name="x")
    run.run()
    check(adapters["a"][1], ids, 10, run.result("again"))  # ran to its end on the weights it started on
    assert run.finish("again").cached_tokens == 28  # the first request's pages, in the same adapter
    check(adapters["b"][1], ids, 10, run.result("replaced"))
    assert run.finish("replaced").cached_tokens == 0  # nothing of the old weights' KV


def test_the_prefix_cache_is_keyed_by_adapter_and_cache_namespace(base, adapters):
    run = lora_run(base, adapters, ["a", "b"])
    ids = prompts(55, [33], VOCAB)["r0"]
    order = [("base", "", ""), ("on-a", "a", ""), ("on-a-again", "a", ""), ("on-b", "b", ""),
             ("salted", "", "user-1"), ("salted-again", "", "user-1"), ("other-salt", "", "user-2"),
             ("a-salted", "a", "user-1"), ("base-again", "", "")]
    for rid, adapter, salt in order:
        run.submit(rid, ids, 3, lora_name=adapter, cache_namespace=salt)
        run.run()
    cached = {rid: run.finish(rid).cached_tokens for rid, _, _ in order}
    assert cached == {"base": 0, "on-a": 0, "on-a-again": 32, "on-b": 0, "salted": 0, "salted-again": 32,
                      "other-salt": 0, "a-salted": 0, "base-again": 32}
    for rid, adapter, _ in order:
        check(adapters[adapter][1] if adapter else base[1], ids, 3, run.result(rid))


def test_loaded_adapters_are_bounded_least_recently_used_first_never_one_in_use(base, adapters):
    run = lora_run(base, adapters, ["a", "b"], max_loras_per_batch=1, max_loaded_loras=2)
    ids = prompts(56, [8], VOCAB)["r0"]
    run.submit("on-b", ids, 2, lora_name="b")
    run.run()
    run.submit("on-a", ids, 30, lora_name="a")  # a: running, and the least recently used is b
    run.step()
    reply = load(run, "c", adapters["c"][0])
    run.step()
    assert reply.result().success and "unloaded the least recently used b" in reply.result().message
    assert {info.name for info in run.engine.adapters.loaded()} == {"a", "c"}
    with pytest.raises(InvalidTokenizedRequest):
        run.submit("on-b-again", ids, 2, lora_name="b")
    pinned = load(run, "d", adapters["d"][0], pinned=True)  # c goes (a runs); then a runs and d is pinned
    run.step()
    assert pinned.result().success
    refused = load(run, "b", adapters["b"][0])
    run.step()
    assert not refused.result().success and "pinned or running" in refused.result().message
    run.run()
    check(adapters["a"][1], ids, 30, run.result("on-a"))


def test_adapters_the_model_cannot_take_are_refused_by_name(base, adapters, tmp_path):
    path, _ = base
    run = lora_run(base, adapters, lora_target_modules=["q_proj", "v_proj"], max_lora_rank=8)
    lora = run.runner.lora

    def refusal(directory) -> str:
        with pytest.raises(AdapterRefused) as refused:
            read_adapter_dir("x", str(directory), lora.features, lora.max_rank, lora.dtype)
        return str(refused.value)

    assert "not one of this server's LoRA targets" in refusal(adapters["b"][0])  # o_proj, MLP: not targets here
    assert "exceeds --max-lora-rank 8" in refusal(peft_adapter(path, tmp_path / "big", 0, 16, 16, ["q_proj"]))
    assert "use_dora" in refusal(peft_adapter(path, tmp_path / "dora", 0, 4, 8, ["q_proj"], use_dora=True))
    assert "No adapter found" in refusal(tmp_path / "nowhere")
    assert read_adapter_dir("a", str(adapters["a"][0]), lora.features, lora.max_rank, lora.dtype).rank == 4


def test_config_takes_vllm_s_names_too():
    from services.common.config import parse_config

    config = parse_config(SchedulerConfig, ["--max-loras", "3", "--lora-modules", "x=/a,/b", "--max-cpu-loras", "5"])
    assert (config.max_loras_per_batch, config.max_loaded_loras, config.enable_lora) == (3, 5, True)
    assert config.lora_modules == [("x", "/a"), ("/b", "/b")]
    with pytest.raises(ValueError, match="--max-loaded-loras"):
        SchedulerConfig(enable_lora=True, max_loras_per_batch=4, max_loaded_loras=2)


MOE_TOP_K = 2


def small_moe():
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=MOE_TOP_K,
        max_position_embeddings=1024, eos_token_id=1, tie_word_embeddings=False))


def test_routed_experts_are_those_of_the_adapter_merged(tmp_path):
    path, _ = tiny_checkpoint(tmp_path / "moe", small_moe)
    adapter_dir = peft_adapter(path, tmp_path / "moe-adapter", 3, 8, 32, ATTENTION)
    config = SchedulerConfig(max_running_requests=4, page_size=4, max_total_tokens=2048, enable_lora=True,
                             enable_return_routed_experts=True)
    runner = ModelRunner(path, "cpu", "float32", 0, 4, 4, 2048, routed_experts=True, lora=config.lora_layers)
    run = Run(runner, slots=4, enable_lora=True, enable_return_routed_experts=True)
    run.limits = dataclasses.replace(run.limits, routed_experts=True)
    load(run, "moe", adapter_dir)
    run.step()
    ids = prompts(57, [15], VOCAB)["r0"]
    for rid, adapter in (("adapted", "moe"), ("base", "")):
        run.engine.submit(parse_request(TokenizedRequest(
            rid=rid, owner="test", input_ids=ids, lora_name=adapter, return_routed_experts=True,
            sampling=SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
            logprob=LogprobParams(return_logprob=True, top_logprobs_num=K, logprob_start_len=-1)),
            run.limits, None, run.engine.adapters))
        run.run()
    reference = merged(path, adapter_dir)
    finish = run.finish("adapted")
    experts = np.frombuffer(finish.routed_experts, dtype="<i4").reshape(finish.routed_experts_shape)
    sequence = ids + run.output("adapted")[:-1]
    with torch.no_grad():
        logits = reference(torch.tensor([sequence]), output_router_logits=True).router_logits
    expected = np.stack([layer.reshape(len(sequence), -1).topk(MOE_TOP_K, dim=-1).indices.numpy()
                         for layer in logits], axis=1)
    np.testing.assert_array_equal(np.sort(experts, axis=-1), np.sort(expected, axis=-1))
    base_finish = run.finish("base")
    base_experts = np.frombuffer(base_finish.routed_experts, dtype="<i4").reshape(base_finish.routed_experts_shape)
    assert not np.array_equal(base_experts[:len(ids)], experts[:len(ids)])  # the adapter changed the routing
    check(reference, ids, 5, run.result("adapted"))
