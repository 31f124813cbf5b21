"""The prepared GPU benchmark (bench/gpu) runs, on the CPU with tiny shapes: every part of the one device run,
so that it cannot rot between the runs a GPU is lent for. Its figures mean nothing here."""

import json
import subprocess
import sys

import pytest

from bench.common import OUT_DIR

pytest.importorskip("triton")


def test_the_gpu_benchmark_runs_every_part_on_the_cpu():
    # tests/conftest.py's TRITON_INTERPRET=1 reaches the benchmark and the scheduler it starts: interpreted kernels
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((OUT_DIR / "gpu-smoke.json").read_text())["results"]
    modes = {(row["batch"], row["k"], row["mode"]) for row in results["decode"]}
    assert modes == {(b, k, m) for b in (1, 3) for k in (0, 128) for m in ("torch", "triton", "triton + graphs")}
    assert all(row["step_s"] > 0 and row["floor_s"] > 0 for row in results["decode"])
    assert [(row["batch"], row["overlap"]) for row in results["overlap"]] == [(3, False), (3, True)]
    assert {row["mode"] for row in results["prefill"]} == {"torch", "triton"}
    assert [row["batch"] for row in results["generate"]] == [2]
    served = {(row["concurrency"], row["mode"]) for row in results["serving"]["rows"]}
    assert served == {(c, m) for c in (1, 2) for m in ("k=0", "k=128 flat base64")}
