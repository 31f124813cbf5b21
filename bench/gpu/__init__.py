"""The GPU benchmark (issue 22): one prepared run on a CUDA device, a few minutes long.

On random-weight models of real shapes (Qwen3-0.6B and Qwen3-8B layers, bf16, the default model's 248k
vocabulary, as Qwen3.5's; `--load-format dummy`, so no weights travel), it reports in one run:

- the device's own rates, measured first: copy bandwidth and the bf16 matrix rate;
- decode tokens/s of the engine's step (policy, forward, sampling, logprobs, host copy) at B in {1, 32, 128,
  256}, k=0 and k=128, for the torch attention path, the Triton kernel, and the kernel with CUDA graphs;
  each against the bandwidth floor (the weights and the batch's KV read once per step, at the copy bandwidth);
- prefill tokens/s against the matrix rate;
- transformers' own `generate` with a static cache on the same model and GPU, the baseline a user tries first;
- the seeds' table through `flatwire up` on the 8B shape: 160 and 1000 output tokens, k=0 vs k=128 flat
  base64, one request and 32 concurrent, wall time and the services' CPU (bench/e2e.py's measurement).

    bash bench/gpu/wheels.sh                  # here, once: the packages the device lacks, into .whl/
    bash bench/gpu/device.sh                  # there: installs them, runs python -m bench.gpu, copies to $OUT
    python -m bench.gpu --smoke               # here, on the CPU: tiny shapes, every part once (the CI test)

On this workplace's device tool, from the session's own checkout: `run(command="bash bench/gpu/device.sh",
carry=[".whl"], timeout_s=600)`. It is sized for 5 to 7 minutes by estimate (it has never run on a GPU): two
shapes' loads with random weights, 24 decode rows each, the serving table's 1000-token requests; `--rounds 1`
or `--shapes qwen3-8b` trim it. Results go to bench/out/gpu.{md,json} (and to
$OUT there); bench/gpu/RESULTS.md takes them, with the date and the device, and BENCHMARKS.md includes it.
"""
