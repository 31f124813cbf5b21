"""flatwire-client (clients/python): its gRPC and HTTP clients, sync and asyncio, against the live stack; and
the package installed into a fresh virtualenv with nothing of the server (no torch, no transformers)."""

import asyncio
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flatwire_client import AsyncFlatwireClient, AsyncHttpClient, FlatwireClient, Generation, HttpClient, HttpError

from harness.procs import ROOT

PROMPT = "Flat arrays for every client"
OPTIONS = {"max_new_tokens": 9, "temperature": 0, "top_logprobs_num": 6, "logprob_start_len": 0}


def _same(got: Generation, want: Generation) -> None:
    assert got.token_ids.tolist() == want.token_ids.tolist() and got.text == want.text
    for side in ("output", "prompt"):
        a, b = getattr(got, side), getattr(want, side)
        for name in ("token_logprobs", "topk_values", "topk_ids"):
            assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), (side, name)
    assert got.finish_reason == want.finish_reason == "length" and got.completion_tokens == 9
    assert got.weight_version == want.weight_version == "default"


def _streamed(chunks: list[Generation], want: Generation) -> None:
    """A stream's chunks are its tokens in order, each chunk at least one (a gateway that falls a step behind
    sends the tokens it has in one chunk)."""
    assert all(len(chunk.token_ids) >= 1 for chunk in chunks)
    assert np.concatenate([chunk.token_ids for chunk in chunks]).tolist() == want.token_ids.tolist()


def test_every_client_returns_the_same_arrays(stack):
    with FlatwireClient(stack.grpc_address) as grpc_client, HttpClient(stack.http_url) as http_client:
        want = grpc_client.generate(PROMPT, **OPTIONS)
        stream = grpc_client.stream(PROMPT, **OPTIONS)
        _streamed(list(stream), want)
        _same(stream.result, want)
        _same(http_client.generate(PROMPT, **OPTIONS), want)
        http_stream = http_client.stream(PROMPT, **OPTIONS)
        _streamed(list(http_stream), want)
        _same(http_stream.result, want)
        with pytest.raises(HttpError) as refused:
            http_client.generate(PROMPT, max_new_tokens=2, top_p=2.0)
        assert refused.value.status == 400 and "top_p" in refused.value.message

    async def asyncio_clients():
        async with AsyncFlatwireClient(stack.grpc_address) as client:
            whole = await client.generate(PROMPT, **OPTIONS)
            stream = client.stream(PROMPT, **OPTIONS)
            chunks = [chunk async for chunk in stream]
            streamed = stream.result
        http = AsyncHttpClient(stack.http_url)
        http_whole = await http.generate(PROMPT, **OPTIONS)
        http_chunks = [chunk async for chunk in http.stream(PROMPT, **OPTIONS)]
        return whole, chunks, streamed, http_whole, http_chunks

    whole, chunks, streamed, http_whole, http_chunks = asyncio.run(asyncio_clients())
    for got in (whole, streamed, http_whole):
        _same(got, want)
    _streamed(chunks, want)
    _streamed(http_chunks, want)


SCRIPT = """
import json, sys
from flatwire_client import FlatwireClient, HttpClient
grpc_address, http_url = sys.argv[1:]
with FlatwireClient(grpc_address) as grpc_client, HttpClient(http_url) as http_client:
    results = [grpc_client.generate({prompt!r}, max_new_tokens=5, temperature=0, top_logprobs_num=3),
               http_client.generate({prompt!r}, max_new_tokens=5, temperature=0, top_logprobs_num=3)]
print(json.dumps({{"modules": sorted(m for m in ("torch", "transformers", "fastapi", "services") if m in sys.modules),
                  "results": [[r.token_ids.tolist(), r.output.topk_values.tolist()] for r in results]}}))
"""


@pytest.mark.slow
def test_the_package_installs_alone_and_talks_to_the_stack(stack, tmp_path):
    """pip install ./services/wire ./clients/python into a fresh venv: the wire layer, grpcio, protobuf and numpy
    only, and it works."""
    venv, wire, source = tmp_path / "venv", tmp_path / "flatwire-wire", tmp_path / "flatwire-client"
    # pip builds in the source tree: copies, not the repository's.
    shutil.copytree(ROOT / "services" / "wire", wire, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / "clients" / "python", source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wire), str(source)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], capture_output=True,
                               text=True, check=True)
    names = {package["name"].lower() for package in json.loads(installed.stdout)}
    assert {"flatwire-client", "flatwire-wire", "grpcio", "protobuf", "numpy"} <= names
    assert not names & {"torch", "transformers", "fastapi", "flatwire", "tokenizers"}
    run = subprocess.run([str(python), "-c", SCRIPT.format(prompt=PROMPT), stack.grpc_address, stack.http_url],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["modules"] == []
    with FlatwireClient(stack.grpc_address) as client:
        want = client.generate(PROMPT, max_new_tokens=5, temperature=0, top_logprobs_num=3)
    for token_ids, values in report["results"]:
        assert token_ids == want.token_ids.tolist()
        assert np.array(values, dtype=np.float32).tobytes() == want.output.topk_values.tobytes()
