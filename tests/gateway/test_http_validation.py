"""Bad input at every HTTP endpoint: a 4xx naming the field, while good requests carry on."""

import threading

import pytest

from tests.gateway.bodies import CHAT, COMPLETION

TOO_MANY = 1_000_000  # above any server's top-k maximum

# (endpoint, body (dict, or raw bytes), expected status, the field the error must name)
CASES = [
    ("/generate", b'{"text": "hi",', 400, "body"),
    ("/generate", b"[1, 2]", 400, "body"),
    ("/generate", {"text": 5}, 400, "text"),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, "text"),
    ("/generate", {"input_ids": []}, 400, "input_ids"),
    ("/generate", {"input_ids": [1, -4]}, 400, "input_ids"),
    ("/generate", {"input_ids": [[1], [2, 10**9]]}, 400, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "many"}}, 400,
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**7}}, 400,
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, 400, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 0}}, 400, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [10**9]}}, 400,
     "sampling_params.stop_token_ids"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
    # In a batch, the element that is wrong (not the union's other branch: "should be a dictionary").
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"temperature": -1}]}, 400,
     "sampling_params[1].temperature"),
    ("/generate", {"text": ["a", 5]}, 400, "text[1]"),
    ("/generate", {"input_ids": [[1], 2]}, 400, "input_ids[1]"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": TOO_MANY}, 400, "top_logprobs_num"),
    ("/generate", {"text": "hi", "return_logprob": True, "token_ids_logprob": [10**9]}, 400, "token_ids_logprob"),
    ("/generate", {"text": "hi", "logprob_start_len": -2}, 400, "logprob_start_len"),
    ("/generate", {"text": "hi", "return_flat_raw_top_logprobs_b64": True}, 400, "return_flat_raw_top_logprobs_b64"),
    ("/v1/chat/completions", b"{nope", 400, "body"),
    ("/v1/chat/completions", {**CHAT, "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "model"}, 400, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True, "usage": 1}}, 400,
     "stream_options.usage"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "two"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": TOO_MANY}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "return_flat_raw_output_top_logprobs": True}, 400,
     "return_flat_raw_output_top_logprobs"),
    ("/v1/completions", b'{"model": ', 400, "body"),
    ("/v1/completions", {**COMPLETION, "model": "no-such-model"}, 404, "model"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "logprobs": TOO_MANY}, 400, "logprobs"),
    ("/v1/completions", {**COMPLETION, "logprobs": "some"}, 400, "logprobs"),
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 10**7}, 400, "max_tokens"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "field"), CASES,
                         ids=[f"{c[0]}:{c[3]}:{i}" for i, c in enumerate(CASES)])
def test_bad_input_names_the_field(send, endpoint, body, status, field):
    response = send(endpoint, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert field.split(".")[-1].split("[")[0] in error["message"] or field == "body"
    assert set(error) == {"message", "type", "param", "code"}


def test_unknown_paths_and_methods_get_the_error_shape(http):
    missing = http.post("/v1/no-such-route", json={})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    wrong = http.get("/generate")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}


def test_bad_input_leaves_a_concurrent_request_and_the_services_alone(stack, http, send):
    good = {"text": "A long story about gRPC", "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                                                 "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 4}
    alone = http.post("/generate", json=good).json()
    result = {}

    def run_good():
        result["body"] = http.post("/generate", json=good).json()

    thread = threading.Thread(target=run_good)
    thread.start()
    statuses = [send(endpoint, body).status_code for endpoint, body, _, _ in CASES]
    thread.join(timeout=120)
    assert all(400 <= s < 500 for s in statuses)
    assert result["body"]["output_ids"] == alone["output_ids"]
    assert result["body"]["meta_info"]["finish_reason"] == {"type": "length", "length": 48}
    assert http.get("/health").status_code == 200
    assert stack.procs["gateway"].proc.poll() is None
    metrics = http.get("/metrics").text
    assert 'flatwire_request_errors_total{endpoint="/generate",status="400"}' in metrics
