#!/usr/bin/env bash
# There (the device machine, from the repository root, with .whl/ carried): the wheels installed beside its own
# packages, the project's two local distributions on the path, then the benchmark; its results and the
# services' logs copied to $OUT. One command of at most 10 minutes:
#   bash bench/gpu/device.sh [python -m bench.gpu options]
#   BENCH=bench.gpu.linear_attention bash bench/gpu/device.sh    # the flash-linear-attention kernels' check
#   BENCH=bench.tensor_parallel bash bench/gpu/device.sh --device cuda --tp N --shape qwen3-8b   # N GPUs: TP=1 vs N
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH="/tmp/site:$PWD/services/wire:$PWD/clients/python:$PWD" PYTHONUNBUFFERED=1
export FLATWIRE_CACHE_DIR=/tmp/flatwire-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
python3 -m "${BENCH:-bench.gpu}" "$@" 2>&1 | tee "$OUT/gpu.log"
status=${PIPESTATUS[0]}
cp bench/out/gpu*.md bench/out/gpu*.json "$OUT/" 2>/dev/null
tail -n 200 -q bench/out/e2e-logs/*.log > "$OUT/services.log" 2>/dev/null
exit "$status"
