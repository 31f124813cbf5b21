"""The gateway's public gRPC API, through the project's Python client, against the real pipeline."""

import grpc
import httpx
import numpy as np
import pybase64
import pytest
from flatwire_client import FlatwireClient
from flatwire_wire import public
from flatwire_wire.logprobs import LogprobBlock, RequestLogprobs
from flatwire_wire.pb import generate_pb2  # the published messages, as a client in another language reads them
from flatwire_wire.steps import FinishReason

PROMPT = "gRPC clients get the arrays raw"
K = 8


@pytest.fixture(scope="module")
def client(stack):
    with FlatwireClient(stack.grpc_address) as c:
        yield c


def test_model_info(client):
    info = client.model_info()
    assert info.vocab_size == 248077 and info.max_top_logprobs >= 256 and info.model


def test_arrays_match_http_flat_base64(client, stack):
    """The same greedy request: gRPC's raw arrays equal /generate's base64 arrays bit for bit."""
    result = client.generate(PROMPT, max_new_tokens=10, temperature=0, top_logprobs_num=K, logprob_start_len=0)
    body = httpx.post(f"{stack.http_url}/generate", timeout=120, json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 0}, "return_logprob": True,
        "top_logprobs_num": K, "logprob_start_len": 0, "return_flat_raw_top_logprobs": True,
        "return_flat_raw_output_top_logprobs": True, "return_flat_raw_top_logprobs_b64": True}).json()
    meta = body["meta_info"]
    assert result.token_ids.tolist() == body["output_ids"]
    assert result.text == body["text"]
    assert result.finish_reason == "length" and result.completion_tokens == 10
    for track, side in ((result.output, "output"), (result.prompt, "input")):
        values = np.frombuffer(pybase64.b64decode(meta[f"{side}_top_logprobs_val_flat_b64"]), dtype="<f4")
        ids = np.frombuffer(pybase64.b64decode(meta[f"{side}_top_logprobs_idx_flat_b64"]), dtype="<i4")
        assert track.topk_values.tobytes() == values.tobytes()
        assert track.topk_ids.tobytes() == ids.tobytes()
        assert track.topk_values.shape[1] == K
    assert result.prompt.null_prefix == 1
    assert len(result.prompt.token_logprobs) == result.prompt_tokens - 1
    # The selected token's logprob is the top-1 candidate's under greedy decoding.
    assert np.array_equal(result.output.topk_ids[:, 0], result.token_ids)
    assert np.array_equal(result.output.topk_values[:, 0], result.output.token_logprobs)


def test_stream_chunks_add_up_to_the_whole(client):
    whole = client.generate(PROMPT, max_new_tokens=12, temperature=0, top_logprobs_num=4)
    chunks = list(client.stream(PROMPT, max_new_tokens=12, temperature=0, top_logprobs_num=4))
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert np.concatenate([c.token_ids for c in chunks]).tolist() == whole.token_ids.tolist()
    assert "".join(c.text for c in chunks) == whole.text
    assert np.concatenate([c.output.topk_ids for c in chunks if c.output]).tobytes() == whole.output.topk_ids.tobytes()


def test_stop_string_and_ids(client, stack):
    ids = client.generate(input_ids=[9707, 11, 1879], max_new_tokens=6, temperature=0)
    assert ids.prompt_tokens == 3 and len(ids.token_ids) == 6
    stop = ids.text[2:5]
    if stop:
        stopped = client.generate(input_ids=[9707, 11, 1879], max_new_tokens=6, temperature=0, stop=[stop])
        assert stopped.finish_reason == "stop" and stopped.matched_stop == stop
        assert stopped.text == ids.text[:ids.text.index(stop)]


@pytest.mark.parametrize("options, field", [
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": "a", "top_logprobs_num": 100000}, "top_logprobs_num"),
    ({"input_ids": [10**9]}, "input_ids"),
])
def test_bad_requests_are_invalid_argument(client, options, field):
    with pytest.raises(grpc.RpcError) as caught:
        client.generate(**options, max_new_tokens=2)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()
    assert len(client.generate("still fine", max_new_tokens=2).token_ids) == 2


def test_minus_inf_survives_the_public_message():
    """-inf candidates (masked ids) reach gRPC clients as -inf, in both views."""
    values = np.array([[-0.5, -np.inf], [-1.0, -np.inf]], dtype=np.float32)
    track = RequestLogprobs(token_ids=np.array([3, 4], dtype=np.int32), token_logprobs=values[:, 0].copy(),
                            topk_values=values, topk_ids=np.array([[3, 7], [4, 8]], dtype=np.int32),
                            ids_logprobs=np.zeros((2, 0), dtype=np.float32))
    wire = public.GenerateResponse(output=LogprobBlock.of_request(track)).to_bytes()
    typed = generate_pb2.GenerateResponse.FromString(wire)
    assert np.array(typed.output.topk_values, dtype=np.float32).tobytes() == values.tobytes()
    assert list(typed.output.topk_ids) == [3, 7, 4, 8]


def _delimited(data: bytes) -> list[generate_pb2.GenerateResponsePacked]:
    """Length-delimited messages: each after its size as a base-128 varint."""
    messages, at = [], 0
    while at < len(data):
        size = shift = 0
        while True:
            byte, at = data[at], at + 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        messages.append(generate_pb2.GenerateResponsePacked.FromString(data[at:at + size]))
        at += size
    return messages


def test_generate_answers_protobuf_to_a_client_that_accepts_it(client, stack):
    """Accept: application/x-protobuf on /generate: the gRPC API's packed message (raw arrays, no JSON), a
    length-delimited message per event when streaming; the arrays equal the gRPC API's bit for bit."""
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": K}
    accept = {"accept": "application/x-protobuf"}
    want = client.generate(PROMPT, max_new_tokens=10, temperature=0, top_logprobs_num=K)
    reply = httpx.post(f"{stack.http_url}/generate", json=body, headers=accept, timeout=120)
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/x-protobuf"
    whole = generate_pb2.GenerateResponsePacked.FromString(reply.content)
    assert np.frombuffer(whole.token_ids, "<i4").tolist() == want.token_ids.tolist()
    assert whole.output.topk_values == want.output.topk_values.tobytes()
    assert whole.output.topk_ids == want.output.topk_ids.tobytes()
    assert whole.finish_reason == FinishReason.LENGTH and whole.completion_tokens == 10
    typed = generate_pb2.GenerateResponse.FromString(reply.content)  # the typed twin reads the same bytes
    assert list(typed.token_ids) == want.token_ids.tolist()

    streamed = httpx.post(f"{stack.http_url}/generate", json={**body, "stream": True}, headers=accept, timeout=120)
    messages = _delimited(streamed.content)
    # A message per token, or fewer carrying several when the gateway runs behind (stream coalescing).
    assert 1 < len(messages) <= 10 and messages[-1].finish_reason == FinishReason.LENGTH
    assert all(m.finish_reason == FinishReason.UNSPECIFIED for m in messages[:-1])
    assert b"".join(m.token_ids for m in messages) == whole.token_ids
    assert b"".join(m.output.topk_values for m in messages) == whole.output.topk_values
    assert "".join(m.text for m in messages) == whole.text

    batch = httpx.post(f"{stack.http_url}/generate", json={**body, "text": [PROMPT, PROMPT]}, headers=accept)
    assert batch.status_code == 400 and batch.json()["error"]["param"] == "text"
    # Accept's q-values: protobuf only when it is preferred to JSON.
    for header, media_type in [("application/x-protobuf;q=0", "application/json"),
                               ("application/json, application/x-protobuf;q=0.5", "application/json"),
                               ("*/*", "application/json"),
                               ("application/x-protobuf, */*;q=0.1", "application/x-protobuf")]:
        reply = httpx.post(f"{stack.http_url}/generate", json=body, headers={"accept": header}, timeout=120)
        assert reply.headers["content-type"] == media_type, header
