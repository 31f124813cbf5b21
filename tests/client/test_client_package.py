"""flatwire-client (clients/python): its gRPC and HTTP clients, sync and asyncio, against the live stack; and
the package installed into a fresh virtualenv with nothing of the server (no torch, no transformers)."""

import asyncio
import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from flatwire_client import AsyncFlatwireClient, AsyncHttpClient, FlatwireClient, Generation, HttpClient, HttpError
from transformers import AutoTokenizer

from harness.procs import ROOT

PROMPT = "Flat arrays for every client"
OPTIONS = {"max_new_tokens": 9, "temperature": 0, "top_logprobs_num": 6, "logprob_start_len": 0}


def _same(got: Generation, want: Generation) -> None:
    assert got.token_ids.tolist() == want.token_ids.tolist() and got.text == want.text
    for side in ("output", "prompt"):
        a, b = getattr(got, side), getattr(want, side)
        for name in ("token_ids", "null_token_ids", "token_logprobs", "topk_values", "topk_ids"):
            assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), (side, name)
    assert got.finish_reason == want.finish_reason == "length" and got.completion_tokens == 9
    assert got.weight_version == want.weight_version == "default"


def _streamed(chunks: list[Generation], want: Generation) -> None:
    """A stream's chunks are its tokens in order, each chunk at least one (a gateway that falls a step behind
    sends the tokens it has in one chunk)."""
    assert all(len(chunk.token_ids) >= 1 for chunk in chunks)
    assert np.concatenate([chunk.token_ids for chunk in chunks]).tolist() == want.token_ids.tolist()


def test_every_client_returns_the_same_arrays(stack, model_dir):
    with FlatwireClient(stack.grpc_address) as grpc_client, HttpClient(stack.http_url) as http_client:
        want = grpc_client.generate(PROMPT, **OPTIONS)
        # A text prompt: the server says which tokens its rows are for (the first, without a row, included).
        prompt_ids = AutoTokenizer.from_pretrained(model_dir).encode(PROMPT)
        assert want.prompt.null_prefix == 1 and want.prompt.null_token_ids.tolist() == prompt_ids[:1]
        assert want.prompt.token_ids.tolist() == prompt_ids[1:] and want.prompt.n == len(prompt_ids) - 1
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
        http_stream = http.stream(PROMPT, **OPTIONS)
        http_chunks = [chunk async for chunk in http_stream]
        return whole, chunks, streamed, http_whole, http_chunks, http_stream.result

    whole, chunks, streamed, http_whole, http_chunks, http_streamed = asyncio.run(asyncio_clients())
    for got in (whole, streamed, http_whole, http_streamed):
        _same(got, want)
    _streamed(chunks, want)
    _streamed(http_chunks, want)


LONG = {"max_new_tokens": 4000, "ignore_eos": True}  # runs for many seconds unless it is aborted


def _aborted(stack, before: int) -> bool:
    """The scheduler has aborted one more request than `before` and runs none."""
    stats = stack.stats()
    return stats.aborted == before + 1 and stats.running == 0


def _wait_aborted(stack, before: int) -> None:
    deadline = time.monotonic() + 30
    while not _aborted(stack, before):
        assert time.monotonic() < deadline, "the stream left early still runs"
        time.sleep(0.05)


def test_a_stream_left_early_ends_its_request(stack):
    """Leaving a stream's loop (here after two chunks) stops the request on the server, whichever client read
    it; the HTTP client's next call still works (it had kept the unread response and refused every call)."""
    with FlatwireClient(stack.grpc_address) as grpc_client, HttpClient(stack.http_url) as http_client:
        for client in (grpc_client, http_client):
            before = stack.stats().aborted
            stream = client.stream(PROMPT, **LONG)
            for index, _ in enumerate(stream):
                if index == 1:
                    break
            _wait_aborted(stack, before)  # `stream` is still referenced: leaving the loop did it
            assert client.generate(PROMPT, max_new_tokens=2).completion_tokens == 2
        before = stack.stats().aborted
        stream = grpc_client.stream(PROMPT, **LONG)
        next(iter(stream))
        stream.cancel()
        _wait_aborted(stack, before)

    async def asyncio_clients() -> None:
        async with AsyncFlatwireClient(stack.grpc_address) as grpc_client:
            for client in (grpc_client, AsyncHttpClient(stack.http_url)):
                before = await asyncio.to_thread(lambda: stack.stats().aborted)
                stream = client.stream(PROMPT, **LONG)
                async for _ in stream:
                    break
                deadline = time.monotonic() + 30
                while not await asyncio.to_thread(_aborted, stack, before):
                    assert time.monotonic() < deadline, f"{type(client).__name__}'s stream left early still runs"
                    await asyncio.sleep(0.05)

    asyncio.run(asyncio_clients())


def test_flush_cache_over_grpc(stack):
    with FlatwireClient(stack.grpc_address) as client:
        reply = client.flush_cache()
    assert reply.success and all(replica.success for replica in reply.replicas.values()), reply


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
