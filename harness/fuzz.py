"""Fuzz every public and internal surface beside a good request.

The three services run as separate processes (a harness.stack.Stack). While a
monitor sends a good /generate every few tenths of a second (its output must never
change, and it must never fail), three kinds of bad input are sent:

- a hostile HTTP corpus: for each endpoint, every field given wrong types, extreme
  numbers, huge and empty values, plus malformed bodies (generated from one table of
  bad values, 100+ cases);
- schema fuzzing: bodies drawn by hypothesis-jsonschema from each endpoint's request
  model (valid and near-valid; generation lengths clamped so that accepted requests
  stay short);
- raw gRPC bytes: random and mutated payloads to every method of every service.

Each case is counted as: accepted (2xx / OK), refused naming the field (4xx with
`error.param`, or INVALID_ARGUMENT and friends whose message starts with the field),
refused otherwise, 5xx or UNKNOWN/INTERNAL, hung (no answer within CASE_TIMEOUT_S),
crashed (a service exited). Target: 0 in the last three.

Needs hypothesis and hypothesis-jsonschema (`pip install -e '.[test]'`). `python -m bench.fuzz` runs the
full counts and writes RELIABILITY.md's fuzzing section; tests/reliability/test_fuzz.py runs it in small.
"""

import json
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx
import orjson
from flatwire_wire.control import EMPTY
from flatwire_wire.detokenizer import DETOKENIZER, StreamOutputsRequest
from flatwire_wire.public import GENERATION, GenerateRequest
from flatwire_wire.public import SamplingParams as PublicSamplingParams
from flatwire_wire.rpc import ServiceSpec
from flatwire_wire.scheduler import SCHEDULER, AbortRequest, SamplingParams, TokenizedRequest

from harness.stack import Stack

CASE_TIMEOUT_S = 30.0
OUTCOMES = ("accepted", "refused naming the field", "refused otherwise", "5xx or UNKNOWN", "hung", "crashed")
GOOD = {"text": "The good request", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
ENDPOINTS = ("/generate", "/v1/chat/completions", "/v1/completions")
# Fields whose value sets how much work an accepted request is: kept small.
WORK_FIELDS = {"max_new_tokens": 2, "max_tokens": 2, "max_completion_tokens": 2, "n": 2}
CORPUS_CLIENTS = 8  # the hostile corpus's concurrent senders
GRPC_FIELD = re.compile(r"^[a-z_][a-z_.\[\]0-9]*: ")


@dataclass
class Tally:
    name: str
    counts: Counter = field(default_factory=lambda: Counter({outcome: 0 for outcome in OUTCOMES}))
    examples: dict[str, str] = field(default_factory=dict)
    _adding: threading.Lock = field(default_factory=threading.Lock, repr=False)  # the corpus's clients share one

    def add(self, outcome: str, example: str) -> None:
        with self._adding:
            self.counts[outcome] += 1
            if outcome not in ("accepted", "refused naming the field"):
                self.examples.setdefault(outcome, example[:160])


class GoodRequests:
    """A good /generate in a loop: every answer must be 200 and the same."""

    def __init__(self, url: str, headers: dict):
        self.url, self.headers = url, headers
        self.answers: Counter = Counter()
        self.slowest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=CASE_TIMEOUT_S, headers=self.headers) as client:
            self._once(client)
            while not self._stop.wait(0.3):
                self._once(client)

    def _once(self, client: httpx.Client) -> None:
        started = time.monotonic()
        try:
            reply = client.post(f"{self.url}/generate", json=GOOD)
            answer = (reply.status_code, reply.json().get("text") if reply.status_code == 200 else None)
        except httpx.HTTPError as exc:
            answer = (type(exc).__name__, None)
        self.slowest = max(self.slowest, time.monotonic() - started)
        self.answers[answer] += 1

    def verdict(self) -> str:
        self._stop.set()
        self._thread.join()
        total = sum(self.answers.values())
        intact = len(self.answers) == 1 and next(iter(self.answers))[0] == 200
        return (f"{'yes' if intact else 'NO'}: {total} good requests, slowest {self.slowest:.2f}s"
                + ("" if intact else f", answers {dict(self.answers)}"))


def classify_http(status: int, body: bytes) -> str:
    if status < 300:
        return "accepted"
    if status >= 500:
        return "5xx or UNKNOWN"
    try:
        return "refused naming the field" if orjson.loads(body)["error"]["param"] else "refused otherwise"
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "refused otherwise"


def send_http(client: httpx.Client, tally: Tally, path: str, content: bytes) -> None:
    try:
        reply = client.post(path, content=content, headers={"content-type": "application/json"})
        outcome = classify_http(reply.status_code, reply.content)
        tally.add(outcome, f"{path} {content[:80]!r} -> {reply.status_code} {reply.content[:80]!r}")
    except httpx.TimeoutException:
        tally.add("hung", f"{path} {content[:80]!r}")
    except httpx.HTTPError as exc:
        tally.add("5xx or UNKNOWN", f"{path} {content[:80]!r} -> {exc!r}")


# -- the hostile corpus ----------------------------------------------------------------------------

BAD_VALUES = [None, True, -1, 0, 2**31, 2**63, -2**63, 10**30, 1e308, -1e308, 1e-45, 0.5, "", "x", "9" * 400,
              [], [None], [[]], [-1], [2**40], {}, {"a": 1}, "\ud800", "x" * 100_000]
VALID_BODIES = {
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                  "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                             "logprobs": True, "top_logprobs": 2},
    "/v1/completions": {"model": "m", "prompt": "Hi", "max_tokens": 2, "logprobs": 2, "echo": True},
}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n",
                   "frequency_penalty", "presence_penalty", "ignore_eos", "skip_special_tokens")
MALFORMED = [b"", b"{", b"[]", b"null", b"1", b'"x"', b"{\"text\": }", b"\xff\xfe", b"{" * 10_000 + b"}" * 10_000,
             b'{"text": "a", "text": 5}', b'{"text": NaN}', b'{"text": Infinity}', b"[" * 100_000]


def _dumps(body) -> bytes:
    """JSON as a client may send it: integers of any size, lone surrogates as escapes (orjson refuses both)."""
    return json.dumps(body).encode()


def hostile_corpus(model: str) -> list[tuple[str, bytes]]:
    cases = []
    for path in VALID_BODIES:
        valid = valid_body(path, model)
        top_fields = list(valid) + ["stream", "n", "input_ids", "token_ids_logprob", "logprob_start_len", "stop"]
        for name in dict.fromkeys(top_fields):
            for value in BAD_VALUES:
                if not (name in WORK_FIELDS and value is None):  # null max_tokens: up to the context, legitimately
                    cases.append((path, _dumps({**valid, name: value})))
        for name in SAMPLING_FIELDS:
            for value in BAD_VALUES[:14]:
                body = dict(valid)
                if path == "/generate":
                    body["sampling_params"] = {**valid["sampling_params"], name: value}
                else:
                    body[name] = value
                cases.append((path, _dumps(body)))
        cases += [(path, raw) for raw in MALFORMED]
    return cases


# -- schema fuzzing --------------------------------------------------------------------------------


def request_schemas() -> dict[str, dict]:
    from services.gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
    from services.gateway.protocol.sglang import GenerateRequest

    return {"/generate": GenerateRequest.model_json_schema(),
            "/v1/chat/completions": ChatCompletionRequest.model_json_schema(),
            "/v1/completions": CompletionRequest.model_json_schema()}


def clamp_work(value):
    """The drawn body with generation lengths and counts kept small (the rest as drawn)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            limit = WORK_FIELDS.get(key)
            if limit and (item is None or (isinstance(item, int) and not isinstance(item, bool))):
                out[key] = limit if item is None else min(item, limit)  # null: up to the context, legitimately
            else:
                out[key] = clamp_work(item)
        return out
    if isinstance(value, list):
        return [clamp_work(item) for item in value[:4]]
    return value


def valid_body(path: str, model: str) -> dict:
    valid = VALID_BODIES[path]
    return {**valid, "model": model} if "model" in valid else dict(valid)


def schema_fuzz(client: httpx.Client, path: str, schema: dict, cases: int, tally: Tally, model: str) -> None:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis_jsonschema import from_schema

    @settings(max_examples=cases, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(from_schema(schema))
    def run(drawn):
        # Over a valid body, so that most cases get past the required fields to the checks behind them;
        # `model` stays the served one (any other name is just a 404).
        body = {**valid_body(path, model), **drawn}
        if "model" in body:
            body["model"] = model
        send_http(client, tally, path, _dumps(clamp_work(body)))

    run()


# -- raw gRPC --------------------------------------------------------------------------------------


def grpc_methods(stack: Stack) -> dict[str, list[tuple[str, str, bytes]]]:
    """service -> [(address, method path, a valid request)]."""
    submit = TokenizedRequest(rid="fuzz", owner="fuzz", input_ids=[9707], sampling=SamplingParams(max_new_tokens=1))

    def valid(spec: ServiceSpec, name: str, request) -> tuple[str, bytes]:
        return spec.methods[name].path, spec.methods[name].encode_request(request)

    scheduler = [valid(SCHEDULER, "Submit", submit), valid(SCHEDULER, "Abort", AbortRequest(rid="x")),
                 *(valid(SCHEDULER, name, EMPTY) for name in ("StreamSteps", "GetModelInfo", "GetStats"))]
    generate = GenerateRequest(text="Hi", sampling=PublicSamplingParams(max_new_tokens=1))
    gateway = [valid(GENERATION, "Generate", generate), valid(GENERATION, "GetModelInfo", EMPTY)]
    return {
        "scheduler": [(stack.scheduler_address, path, data) for path, data in scheduler],
        "detokenizer": [(stack.detokenizer_address, *valid(DETOKENIZER, "StreamOutputs",
                                                      StreamOutputsRequest(owner="fuzz")))],
        "gateway": [(stack.grpc_address, path, data) for path, data in gateway],
    }


def payloads(valid: bytes, count: int, rng: random.Random) -> list[bytes]:
    out = []
    for n in range(count):
        if n % 2 or not valid:
            out.append(rng.randbytes(rng.randrange(0, 300)))
        else:
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            out.append(bytes(data))
    return out


def grpc_fuzz(address: str, method: str, valid: bytes, cases: int, tally: Tally, rng: random.Random,
              metadata: tuple) -> None:
    streaming = method.endswith(("StreamSteps", "StreamOutputs", "Generate"))
    with grpc.insecure_channel(address) as channel:
        call = (channel.unary_stream if streaming else channel.unary_unary)(method)
        for payload in payloads(valid, cases, rng):
            example = f"{method} {payload[:40]!r}"
            try:
                result = call(payload, timeout=0.5 if streaming else CASE_TIMEOUT_S, metadata=metadata)
                if streaming:
                    next(iter(result), None)
                    result.cancel()
                tally.add("accepted", example)
            except grpc.RpcError as exc:
                code = exc.code()
                if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                    tally.add("5xx or UNKNOWN", f"{example} -> {code.name} {exc.details()}")
                elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    tally.add("accepted" if streaming else "hung", example)  # a stream that opened and waits
                elif code == grpc.StatusCode.CANCELLED and streaming:
                    tally.add("accepted", example)
                elif GRPC_FIELD.match(exc.details() or ""):
                    tally.add("refused naming the field", example)
                else:
                    tally.add("refused otherwise", f"{example} -> {code.name} {exc.details()}")


# -- the run ---------------------------------------------------------------------------------------


def check_alive(stack: Stack, tally: Tally) -> None:
    for name, proc in stack.procs.items():
        if proc.proc.poll() is not None:
            tally.add("crashed", f"{name} exited with {proc.proc.returncode}")
            stack.start(name)


def run(stack: Stack, cases: int, seed: int = 0, api_key: str = "", secret: str = "") -> list[tuple]:
    """Every section against a running stack; returns (tally, good-request verdict) rows."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    rows = []
    with httpx.Client(base_url=stack.http_url, timeout=CASE_TIMEOUT_S, headers=headers) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        def corpus(tally: Tally) -> None:  # concurrently, as clients send (and the engine batches them)
            with ThreadPoolExecutor(CORPUS_CLIENTS) as pool:
                list(pool.map(lambda case: send_http(client, tally, *case), hostile_corpus(model)))

        sections = [("HTTP hostile corpus", corpus)]
        for path, schema in request_schemas().items():
            sections.append((f"HTTP schema fuzz {path}",
                             lambda tally, p=path, s=schema: schema_fuzz(client, p, s, cases, tally, model)))
        for service, methods in grpc_methods(stack).items():
            metadata = (("authorization", f"Bearer {api_key}"),) if service == "gateway" and api_key else ()
            metadata += (("x-flatwire-secret", secret),) if service != "gateway" and secret else ()
            per_method = max(cases // len(methods), 20)
            sections.append((f"gRPC raw bytes, {service}", lambda tally, ms=methods, md=metadata, n=per_method: [
                grpc_fuzz(address, method, valid, n, tally, rng, md) for address, method, valid in ms]))
        for name, section in sections:
            print(f"{name} ...", flush=True)
            stack.wait_ready()
            good = GoodRequests(stack.http_url, headers)
            tally = Tally(name)
            section(tally)
            check_alive(stack, tally)
            rows.append((tally, good.verdict()))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def table(rows: list[tuple]) -> str:
    lines = ["| surface | cases | " + " | ".join(OUTCOMES) + " | good request intact | examples |",
             "|---" * (len(OUTCOMES) + 4) + "|"]
    for tally, verdict in rows:
        examples = "; ".join(f"{k}: `{v}`" for k, v in tally.examples.items()).replace("|", "\\|")
        lines.append(f"| {tally.name} | {sum(tally.counts.values())} | "
                     + " | ".join(str(tally.counts[o]) for o in OUTCOMES) + f" | {verdict} | {examples} |")
    return "\n".join(lines)
