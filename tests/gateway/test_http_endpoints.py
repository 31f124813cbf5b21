"""GET /health, /v1/models and /metrics."""

from harness.http import stream_events


def test_health(http):
    assert http.get("/health").status_code == 200


def test_models(http, model_dir):
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    [model] = body["data"]
    assert model["object"] == "model" and model["id"] in (str(model_dir), model_dir.name)


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_metrics_count_requests_tokens_and_bytes_by_format(http):
    # A streamed request first (a token per event): inter-token gaps exist however many tests ran before.
    stream_events(http, text="count me", sampling_params={"max_new_tokens": 3})
    before = http.get("/metrics").text
    body = {"text": "count me", "sampling_params": {"max_new_tokens": 3}, "return_logprob": True,
            "top_logprobs_num": 4, "return_flat_raw_output_top_logprobs": True,
            "return_flat_raw_top_logprobs_b64": True}
    sent = len(http.post("/generate", json=body).content)
    after = http.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    text = after.text
    assert metric(text, 'flatwire_requests_total{endpoint="/generate"}') == \
        metric(before, 'flatwire_requests_total{endpoint="/generate"}') + 1
    assert metric(text, "flatwire_generated_tokens_total") >= metric(before, "flatwire_generated_tokens_total") + 3
    assert metric(text, 'flatwire_response_bytes_total{format="flat_b64"}') == \
        metric(before, 'flatwire_response_bytes_total{format="flat_b64"}') + sent
    assert metric(text, 'flatwire_time_to_first_token_seconds_count{endpoint="/generate"}') >= 1
    assert "flatwire_inter_token_latency_seconds_bucket" in text
