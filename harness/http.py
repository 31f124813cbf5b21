"""HTTP helpers of the tests and benchmarks: POST to a gateway, /generate that must succeed, a stream's events.

`http` is an httpx.Client whose base_url is the gateway (its own timeout applies unless one is given), or the
gateway's base URL itself ("http://127.0.0.1:P": URL_TIMEOUT_S unless one is given).
"""

import httpx
import orjson

URL_TIMEOUT_S = 120.0


def post(http: httpx.Client | str, path: str, body=None, *, timeout: float | None = None,
         **kwargs) -> httpx.Response:
    """POST `body` to `path`: a dict or list as JSON, bytes as they are (as JSON content); `kwargs` go to httpx
    (headers, ...)."""
    if isinstance(body, bytes):
        kwargs["content"] = body
        kwargs["headers"] = {"content-type": "application/json", **kwargs.get("headers", {})}
    elif body is not None:
        kwargs["json"] = body
    if isinstance(http, str):
        return httpx.post(http + path, timeout=timeout or URL_TIMEOUT_S, **kwargs)
    if timeout is not None:
        kwargs["timeout"] = timeout
    return http.post(path, **kwargs)


def generate(http: httpx.Client | str, /, **body) -> dict:
    """POST /generate with `body`; asserts 200; the JSON reply (a list, for a batch)."""
    response = post(http, "/generate", body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(http: httpx.Client | str, /, **body) -> list[dict]:
    """POST /generate with `body` and stream true; asserts 200 and an event stream that ends with [DONE]: the
    events before it, parsed."""
    client = httpx.Client(base_url=http, timeout=URL_TIMEOUT_S) if isinstance(http, str) else http
    try:
        with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        if client is not http:
            client.close()
    assert events and events[-1] == "[DONE]", events[-3:]
    return [orjson.loads(event) for event in events[:-1]]


def exact_regex(text: str) -> str:
    """A regex (xgrammar's syntax) that matches `text` alone: for SGLang's `regex` field, to make a model
    write exactly `text`."""
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}" else c for c in text)
