"""--linear-attention-backend fla: the flash-linear-attention Triton kernels (model/gated_delta_kernels.py), run by
Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET), equal the torch rules they replace in
float32 and float16, each computation on its own (sequences laid end to end across fla's 64-token chunks, from given
states, and one token each), and in the engine equal transformers' forward on a tiny Qwen3.5 checkpoint: chunked
prompts whose page boundaries split a chunk in two waves, decoding, and a prefix-cache hit that resumes from a
checkpoint. Without CUDA (or the interpreter) or without the package, the scheduler refuses the flag at start, in
one line.

Two things the interpreter lacks are stood in for here, around fla's kernels only (`interpreted_fla`): it cannot time
an autotuned kernel's configurations (no driver), so each kernel runs its first one; and its loop counters are
Python ints, where compiled Triton's are tensors (fla calls `i_t.to(tl.int64)` on them), so fla's modules count
with ints that take `.to()`. What the kernels compute is untouched; that they compile and run on a GPU is not
tested here (no GPU)."""

import builtins
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from harness.procs import ROOT
from services.scheduler.model.attention import BackendUnavailable
from services.scheduler.model.gated_delta_kernels import TorchKernels, gated_delta_kernels
from tests.scheduler.engine_run import Run, check, run_and_check, tiny_checkpoint
from tests.scheduler.test_linear_attention import FAMILIES, prompts

CPU = torch.device("cpu")
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None,
                               reason="flash-linear-attention is not installed (pyproject's test extra)")


class _Counter(int):
    """A loop counter as compiled Triton's: `.to(dtype)` (an int is already wide enough)."""

    def to(self, *args, **kwargs) -> "_Counter":
        return self


def _counting_range(*bounds):
    return (_Counter(i) for i in builtins.range(*(int(bound) for bound in bounds)))


@pytest.fixture(scope="module")
def interpreted_fla():
    """fla's kernels, runnable in the interpreter (the module's docstring): its modules imported, their `range` and
    the autotuner stood in for while this module's tests run."""
    from triton.runtime.autotuner import Autotuner

    kernels = gated_delta_kernels("fla", CPU)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Autotuner, "prune_configs", lambda self, kwargs: self.configs[:1])
        for name, module in list(sys.modules.items()):
            if name.startswith("fla.") and module is not None:
                patch.setattr(module, "range", _counting_range, raising=False)
        yield kernels


@pytest.fixture(scope="module")
def kernels(interpreted_fla):
    """(fla's, torch's)."""
    return interpreted_fla, TorchKernels()


# float16: fla computes in float32 from half-precision inputs, as torch's rules do, rounding where they do not.
# bfloat16 is not tried: Triton's interpreter (3.9) multiplies bfloat16 tiles in tl.dot as raw integers (see
# model/triton_attention.py), so fla's chunked rule gives nonsense there; compiled kernels do not.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3}


def assert_same(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_convolution_equals_torchs(kernels, dtype):
    """Sequences of 1, 5 and 70 tokens (fla's conv works in tiles of 64) from given last inputs, and one token each
    of four sequences; silu fused in the kernel, another activation applied after it."""
    fla, torch_ = kernels
    generator = torch.Generator().manual_seed(0)
    dim, width = 24, 4
    bounds = [0, 1, 6, 76]
    x, weight, bias, states = (torch.randn(*shape, generator=generator).to(dtype)
                               for shape in ((bounds[-1], dim), (dim, width), (dim,), (3, dim, width - 1)))
    for activation in ("silu", "gelu", None):
        assert_same(fla.conv_chunks(x, states.clone(), bounds, weight, None, activation),
                    torch_.conv_chunks(x, states.clone(), bounds, weight, None, activation), dtype)
        assert_same(fla.conv_step(x[:3], states.clone(), weight, bias, activation),
                    torch_.conv_step(x[:3], states.clone(), weight, bias, activation), dtype)


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lengths", [[1, 5, 17], [63, 1, 66]])
def test_the_delta_rules_equal_torchs(kernels, lengths, dtype):
    """The chunked rule over sequences laid end to end (across fla's 64-token chunks), each from its own state, and
    the recurrent rule for one token of each; two value heads per key head, as Qwen3.5's."""
    fla, torch_ = kernels
    generator = torch.Generator().manual_seed(len(lengths) + sum(lengths))
    tokens, key_heads, value_heads, key_dim, value_dim = sum(lengths), 2, 4, 8, 8
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    query, key = (torch.randn(1, tokens, key_heads, key_dim, generator=generator).to(dtype) for _ in range(2))
    value = torch.randn(1, tokens, value_heads, value_dim, generator=generator).to(dtype)
    g = -torch.rand(1, tokens, value_heads, generator=generator)  # float32, as the layer computes it
    beta = torch.rand(1, tokens, value_heads, generator=generator).to(dtype)
    states = (torch.randn(len(lengths), value_heads, key_dim, value_dim, generator=generator) * 0.1).to(dtype)
    assert_same(fla.chunked_rule(query, key, value, g, beta, states, bounds),
                torch_.chunked_rule(query, key, value, g, beta, states, bounds), dtype)
    each = [x[0, :len(lengths), None] for x in (query, key, value, g, beta)]  # [N, 1, ...]: one token of each
    assert_same(fla.recurrent_rule(*each, states), torch_.recurrent_rule(*each, states), dtype)


@needs_fla
def test_the_engine_on_the_kernels_equals_transformers(interpreted_fla, tmp_path):
    """Qwen3.5 (two value heads per key head): a one-token prompt and one of ten in chunks of 5 tokens (pages of 4:
    the chunk that crosses a page's end runs in two waves, a checkpoint kept between), decoded together, then the
    longer one asked again: it resumes from a checkpoint of the prefix cache. Greedy tokens and logprobs equal
    transformers'. (Qwen3-Next differs only in its projections, outside the kernels: one model keeps the
    interpreter's time down.)"""
    path, reference = tiny_checkpoint(tmp_path, FAMILIES["qwen3_5"])
    run = Run(path, chunked_prefill_size=5, linear_attention_backend="fla", own_runner=True)
    cases = prompts(0, [1, 10])
    run_and_check(run, reference, cases, 4)
    run.submit("again", cases["r1"], 2)
    run.run()
    check(reference, cases["r1"], 2, run.result("again"))
    assert run.result("again")["finish"].cached_tokens == 8


def test_the_flag_is_refused_without_cuda_or_the_package(monkeypatch):
    with pytest.raises(BackendUnavailable, match="expected one of torch, fla, not 'flashinfer'"):
        gated_delta_kernels("flashinfer", CPU)
    triton_attention = pytest.importorskip("services.scheduler.model.triton_attention")  # the rest needs Triton
    for name in ("fla", "fla.ops.gated_delta_rule", "fla.modules.causal_conv1d"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails, as when it is not installed
    with pytest.raises(BackendUnavailable, match="flash-linear-attention package is not installed"):
        gated_delta_kernels("fla", CPU)
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)  # as on a CPU host outside the tests
    with pytest.raises(BackendUnavailable, match="--linear-attention-backend fla runs on CUDA, not cpu"):
        gated_delta_kernels("fla", CPU)


@pytest.mark.slow
def test_the_scheduler_refuses_the_flag_on_a_cpu_in_one_line(tmp_path):
    """Before it reads the checkpoint."""
    pytest.importorskip("triton")  # without it, the line says Triton is not installed
    path, _ = tiny_checkpoint(tmp_path / "qwen3_5", FAMILIES["qwen3_5"])
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "services", "scheduler", "--model", str(path), "--port", "0",
                           "--device", "cpu", "--linear-attention-backend", "fla"], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("flatwire scheduler: --linear-attention-backend fla runs on CUDA, not cpu"), \
        done.stderr[-2000:]


@needs_fla
def test_the_device_check_runs_its_smoke_shapes(interpreted_fla):
    """bench/gpu/linear_attention.py, prepared for a GPU, runs every part on tiny shapes in the interpreter: the fla
    kernels within its bound of the torch rules."""
    from bench.gpu.linear_attention import main

    report = main(["--smoke"])
    assert report.count("| yes |") == 4 and "NO" not in report, report
