"""python -m bench.gpu.linear_attention [--smoke]: the device check that --linear-attention-backend fla waits for.

One Gated DeltaNet layer of Qwen3.5-9B's shape (16 key heads and 32 value heads of 128, conv kernel 4) on a CUDA
device in bfloat16: each computation of model/gated_delta_kernels.py on the flash-linear-attention kernels against
transformers' torch rules (the torch backend): a step's prefill chunks (several sequences laid end to end, each from
its own state) and its decoding rows (one token each). It reports the largest difference of the outputs and the new
states, against the torch rules' largest value, and each computation's time on both. The flag has run only in
Triton's interpreter on the CPU (float32 and float16) until this runs on a GPU.

    bash bench/gpu/wheels.sh                                    # here: the wheels, flash-linear-attention's too
    BENCH=bench.gpu.linear_attention bash bench/gpu/device.sh   # there, with .whl carried: a minute or two
    python -m pytest tests/scheduler/test_linear_attention_fla.py -k bench    # --smoke, in the interpreter

The reference is the torch rules run on the CPU in float32 (transformers' torch code, as the tests run it): on a
device, with the package installed, transformers' own rules call fla's kernels themselves.
"""

import argparse
import functools
import sys
import time
from collections.abc import Callable

import torch

from bench.common import Table, write_results
from services.scheduler.model.gated_delta_kernels import TorchKernels, gated_delta_kernels

SHAPES = {"qwen3.5-9b": dict(key_heads=16, value_heads=32, head_dim=128, width=4, prompts=8, prompt_tokens=2048,
                             decoding=256),
          "smoke": dict(key_heads=2, value_heads=4, head_dim=8, width=4, prompts=2, prompt_tokens=70, decoding=3)}
CLOSE = 2e-2  # of the torch rules' largest value: a few bfloat16 roundings of a long sum


def seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median time of `fn`, waited for on the device."""
    fn()  # compiles and autotunes the kernels once
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.linear_attention", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, float32, on the CPU in Triton's "
                        "interpreter (the test): every part runs once, no figure means anything")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shape = SHAPES["smoke" if args.smoke else "qwen3.5-9b"]
    repeats = 1 if args.smoke else args.repeats
    fla, reference = gated_delta_kernels("fla", device), TorchKernels()
    generator = torch.Generator(device).manual_seed(0)

    def random(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=generator, device=device) * scale).to(dtype)

    hk, hv, d, width = shape["key_heads"], shape["value_heads"], shape["head_dim"], shape["width"]
    conv_dim = (2 * hk + hv) * d
    weight = random(conv_dim, width, scale=0.5)
    cases: dict[str, tuple[int, str, tuple]] = {}  # name: (tokens, the kernels' method, its arguments)
    for kind, rows, tokens in (("prefill", shape["prompts"], shape["prompts"] * shape["prompt_tokens"]),
                               ("decode", shape["decoding"], shape["decoding"])):
        bounds = [i * tokens // rows for i in range(rows + 1)]
        x, conv_states = random(tokens, conv_dim), random(rows, conv_dim, width - 1)
        q, k = random(1, tokens, hk, d), random(1, tokens, hk, d)
        v, beta = random(1, tokens, hv, d), torch.rand(1, tokens, hv, generator=generator, device=device).to(dtype)
        g = -torch.rand(1, tokens, hv, generator=generator, device=device)  # float32, as the layer computes it
        states = random(rows, hv, d, d, scale=0.1)
        if kind == "prefill":
            cases["conv, prefill chunks"] = (tokens, "conv_chunks", (x, conv_states, bounds, weight, None, "silu"))
            cases["chunked rule, prefill chunks"] = (tokens, "chunked_rule", (q, k, v, g, beta, states, bounds))
        else:
            one = [t.transpose(0, 1) for t in (q, k, v, g, beta)]  # [rows, 1, ...]: one token of each
            cases["conv, decoding rows"] = (tokens, "conv_step", (x, conv_states, weight, None, "silu"))
            cases["recurrent rule, decoding rows"] = (tokens, "recurrent_rule", (*one, states))
    table = Table(f"fla kernels against transformers' torch rules ({'smoke' if args.smoke else 'qwen3.5-9b'} "
                  f"layer, {str(dtype).removeprefix('torch.')})",
                  ["computation", "tokens", "output diff", "state diff", f"within {CLOSE:g}", "torch backend ms",
                   "fla ms", "torch / fla"],
                  "Differences: the largest absolute one from the torch rules run on the CPU in float32 (transformers' "
                  "torch code, as the tests run it), over their largest absolute value. Times: both backends on the "
                  "device (on CUDA, transformers' rules in the torch backend call fla's kernels one sequence at a "
                  "time when the package is installed; its convolution stays torch's).")
    data = []
    for name, (tokens, method, arguments) in cases.items():
        got = getattr(fla, method)(*arguments)
        expected = getattr(reference, method)(*(a.float().cpu() if isinstance(a, torch.Tensor) else a
                                                for a in arguments))
        diffs = [((a.float().cpu() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, expected)]
        torch_s, fla_s = (seconds(functools.partial(getattr(kernels, method), *arguments), device, repeats)
                          for kernels in (reference, fla))
        table.add(name, tokens, f"{diffs[0]:.2e}", f"{diffs[1]:.2e}", "yes" if max(diffs) <= CLOSE else "NO",
                  f"{torch_s * 1e3:.2f}", f"{fla_s * 1e3:.2f}", f"{torch_s / fla_s:.1f}x")
        data.append(dict(computation=name, tokens=tokens, output_diff=diffs[0], state_diff=diffs[1],
                         torch_s=torch_s, fla_s=fla_s))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU, interpreted)"
    command = " ".join(["python -m bench.gpu.linear_attention", *(sys.argv[1:] if argv is None else argv)])
    return write_results("gpu-linear-attention-smoke" if args.smoke else "gpu-linear-attention", command, [table],
                         {"rows": data}, f"Device: {device_name}.")


if __name__ == "__main__":
    print(main())
