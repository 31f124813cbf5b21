"""The prefix cache as clients see it: SGLang's meta_info.cached_tokens, OpenAI's
usage.prompt_tokens_details.cached_tokens, the public gRPC response's cached_tokens, and /flush_cache.

The cache holds whole pages of a prompt (16 tokens, the default --page-size), never its last token (whose
logits the request needs): a repeated prompt of P tokens finds (P - 1) // 16 * 16 of them."""

import time
import uuid

import pytest
from flatwire_client import FlatwireClient

PAGE = 16


def fresh_prompt() -> str:
    """A prompt no earlier test sent (the cache is the session stack's), some pages long."""
    return f"Session {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog, " * 12


def cacheable(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // PAGE * PAGE


def generate(http, text: str, **body) -> dict:
    response = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                                            **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_reports_the_cached_prefix(http):
    prompt = fresh_prompt()
    first = generate(http, prompt)
    again = generate(http, prompt)
    extended = generate(http, prompt + " And then the dog woke up.")
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == cacheable(first["meta_info"]["prompt_tokens"]) > 0
    assert extended["meta_info"]["cached_tokens"] == again["meta_info"]["cached_tokens"]  # the shared pages
    assert again["output_ids"] == first["output_ids"]  # greedy: cached KV gives the same tokens


def test_openai_usage_counts_a_prompt_once(openai_client, served_model):
    """n choices share their prompt: the first computes it, and usage reports the cache as it found it."""
    prompt = fresh_prompt()
    first = openai_client.completions.create(model=served_model, prompt=prompt, max_tokens=3, n=3)
    again = openai_client.completions.create(model=served_model, prompt=prompt, max_tokens=3, n=3)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == cacheable(first.usage.prompt_tokens)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens  # once, not per choice

    messages = [{"role": "user", "content": prompt}]
    chat = [openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=3)
            for _ in range(2)]
    assert chat[0].usage.prompt_tokens_details.cached_tokens == 0
    assert chat[1].usage.prompt_tokens_details.cached_tokens == cacheable(chat[0].usage.prompt_tokens)

    stream = openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=3,
                                                   stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == cacheable(chat[0].usage.prompt_tokens)


def test_grpc_response_carries_cached_tokens(stack):
    prompt = fresh_prompt()
    with FlatwireClient(stack.grpc_address) as client:
        first = client.generate(prompt, max_new_tokens=3, temperature=0)
        again = client.generate(prompt, max_new_tokens=3, temperature=0)
        streamed = list(client.stream(prompt, max_new_tokens=3, temperature=0))
    assert first.cached_tokens == 0
    assert again.cached_tokens == cacheable(first.prompt_tokens) > 0
    assert streamed[-1].cached_tokens == again.cached_tokens


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_flush_cache_empties_it(http, method):
    prompt = fresh_prompt()
    generate(http, prompt)
    response = http.request(method, "/flush_cache")
    assert response.status_code == 200 and response.text.startswith("Cache flushed.")
    assert generate(http, prompt)["meta_info"]["cached_tokens"] == 0
    assert generate(http, prompt)["meta_info"]["cached_tokens"] > 0


def test_flush_cache_is_refused_while_a_request_runs(http):
    """As SGLang: the cache empties only when no request holds its pages; the client hears why, with 400."""
    body = {"text": fresh_prompt(), "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as stream:
        lines = stream.iter_lines()  # kept: a collected iterator closes the stream, which aborts the request
        next(lines)
        refused = http.post("/flush_cache")
    assert refused.status_code == 400 and refused.text.startswith("Cache not flushed."), refused.text
    deadline = time.monotonic() + 30  # the closed stream's request is aborted in its scheduler
    while (response := http.post("/flush_cache")).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert response.status_code == 200, response.text


def test_metrics_show_each_replica_kv_memory(http, stack):
    """/metrics: per replica, KV pages (total, in use, cached) and the prefill tokens computed and found
    cached, as of the gateway's last health round."""
    label = f'{{replica="{stack.scheduler_address}"}}'

    def replica_metrics() -> dict[str, float]:
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in http.get("/metrics").text.splitlines()
                if label in line and not line.startswith("#")}

    counted = f"flatwire_cached_prompt_tokens_total{label}"
    # The scheduler's own count, not /metrics': that is as of the last health round, which may predate an
    # earlier test's requests (and a flushed cache), and would let the wait below end before this test's.
    before = stack.stats().cached_prompt_tokens
    prompt = fresh_prompt()
    generate(http, prompt)
    cached = cacheable(generate(http, prompt)["meta_info"]["prompt_tokens"])
    deadline = time.monotonic() + 30
    while (values := replica_metrics()).get(counted, 0) < before + cached and time.monotonic() < deadline:
        time.sleep(0.2)  # until a health round has fetched the replica's stats since
    assert values[counted] >= before + cached, values
    assert values[f"flatwire_prefill_tokens_total{label}"] > 0
    assert values[f"flatwire_kv_pages{label}"] == 8192  # the default 131072 tokens on CPU, in pages of 16
    assert values[f"flatwire_kv_pages_cached{label}"] > 0
    assert values[f"flatwire_retractions_total{label}"] == 0
