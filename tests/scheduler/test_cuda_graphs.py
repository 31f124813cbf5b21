"""Decode graphs (model/cuda_graphs.py) without CUDA: the capture ladder, and the static-buffer forward they
capture, run eagerly (the Triton kernel interpreted): the engine's greedy outputs and logprobs with
--enable-cuda-graph equal transformers', batches padded to the ladder's sizes, larger ones eager; a weight
update or a memory release drops what was captured. The replay itself needs a GPU (bench/gpu)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("triton")  # CI installs it (pyproject's test extra); an x86-64 Linux wheel only

from services.scheduler.engine.control import ReleaseMemory, ResumeMemory, UpdateWeights  # noqa: E402
from services.scheduler.model import triton_attention  # noqa: E402
from services.scheduler.model.attention import check_backend  # noqa: E402
from services.scheduler.model.cuda_graphs import capture_sizes, padded_size  # noqa: E402
from services.scheduler.model.occupation import MemoryOccupation  # noqa: E402
from services.scheduler.model.weights import ServedWeights, StagedWeights  # noqa: E402
from tests.scheduler.engine_run import Run, check, prompt  # noqa: E402


def test_the_ladder_covers_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(300)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-4:] == [256, 272, 288, 300]
    assert [padded_size(sizes, b) for b in (1, 3, 9, 255, 257, 300)] == [1, 4, 16, 256, 272, 300]
    assert padded_size(sizes, 301) is None


def graph_run(path, **options) -> Run:
    return Run(path, attention_backend="triton", enable_cuda_graph=True, own_runner=True, **options)


def test_graph_decodes_equal_transformers(gqa):
    """Five requests decoding together (padded to 8), then fewer as they finish (4, 2, 1), prompts across page
    boundaries; a cap of 4 rows runs the five-row steps eagerly."""
    path, reference_model = gqa
    cases = {f"r{n}": (prompt(n, 3 + 2 * n), 4 + 2 * n) for n in range(5)}
    for cap in (256, 4):
        run = graph_run(path, cuda_graph_max_bs=cap)
        for rid, (ids, new_tokens) in cases.items():
            run.submit(rid, ids, new_tokens)
        run.run()
        for rid, (ids, new_tokens) in cases.items():
            check(reference_model, ids, new_tokens, run.result(rid))
        graphs = run.runner.graphs
        assert graphs is not None and graphs.replays > 0
        assert sorted(graphs._captured) == ([1, 2, 4, 8] if cap == 256 else [1, 2, 4])


def test_an_update_or_a_memory_release_drops_the_captures(gqa_model):
    run = graph_run(gqa_model)
    run.submit("a", prompt(1, 5), 4)
    run.run()
    graphs = run.runner.graphs
    assert graphs._captured
    new_model = AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.float32).eval()
    new, served = new_model.state_dict(), run.runner.model.state_dict(keep_vars=True)
    update = UpdateWeights(staged=StagedWeights([(t, new[name]) for name, t in served.items()], "same"),
                           abort_all_requests=False, weight_version="v2")
    run.engine.control(update)
    run.run()
    assert update.done.result().success and not graphs._captured
    run.submit("b", prompt(2, 5), 4)
    run.run()
    assert graphs._captured
    runner = run.runner
    weights = ServedWeights(runner.model, gqa_model, runner.eos_token_ids)
    run.engine.rollout.occupation = MemoryOccupation(runner.kv, weights, runner.device, gqa_model)
    for command in (ReleaseMemory(tags=["kv_cache"]), ResumeMemory(tags=["kv_cache"])):
        run.engine.control(command)
        run.run()
        assert command.done.result().success, command.done.result().message
        assert not graphs._captured
    run.submit("c", prompt(3, 5), 4)
    run.run()
    check(new_model, prompt(3, 5), 4, run.result("c"))


def test_the_cuda_graph_tag_drops_the_captures_and_holds_requests_until_resumed(gqa):
    """slime releases every tag and resumes weights, then kv_cache with cuda_graph: a released cuda_graph keeps
    requests out until it is resumed by name (the graphs would be captured again into the trainer's memory);
    weights_drafter names memory no scheduler here holds (no draft model)."""
    path, reference_model = gqa
    run = graph_run(path)
    run.submit("a", prompt(1, 5), 4)
    run.run()
    graphs, runner = run.runner.graphs, run.runner
    assert graphs is not None and graphs._captured
    weights = ServedWeights(runner.model, path, runner.eos_token_ids)
    occupation = MemoryOccupation(runner.kv, weights, runner.device, path, graphs=True)
    run.engine.rollout.occupation = occupation
    released = ReleaseMemory(tags=["cuda_graph", "weights_drafter"])
    run.engine.control(released)
    run.run()
    assert released.done.result().message == "released cuda_graph (weights_drafter: none held here)"
    assert not graphs._captured and "released (cuda_graph)" in (occupation.refusal or "")
    kv_only = ResumeMemory(tags=["kv_cache"])
    run.engine.control(kv_only)
    run.run()
    assert kv_only.done.result().message == "nothing to resume: not released" and occupation.refusal is not None
    resumed = ResumeMemory(tags=["kv_cache", "cuda_graph"])
    run.engine.control(resumed)
    run.run()
    assert resumed.done.result().message == "resumed cuda_graph (captured again when next used)"
    assert occupation.refusal is None
    run.submit("b", prompt(2, 5), 4)
    run.run()
    check(reference_model, prompt(2, 5), 4, run.result("b"))
    assert graphs._captured


def test_graphs_and_the_kernel_refuse_what_they_cannot_run(gqa_model, monkeypatch):
    with pytest.raises(ValueError, match="--attention-backend triton"):
        Run(gqa_model, enable_cuda_graph=True)
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)  # as on a CPU host outside the tests
    with pytest.raises(ValueError, match="runs on CUDA, not cpu"):
        check_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="expected one of torch, triton"):
        check_backend("flashinfer", torch.device("cpu"))
