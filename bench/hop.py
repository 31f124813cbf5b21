"""Hop benchmark (issue 4, item 2): one StepOutput across a real gRPC hop.

For B requests x k top-k per step: encode (numpy -> LogprobBlock.of_rows ->
StepMessage -> bytes, as the scheduler does), transport (Scheduler/StreamSteps
server-streaming on loopback from a child process, many messages, amortised per
message) and decode (bytes -> StepMessage -> per-request views of its block, as
the gateway does). Beside it, the same data as SGLang's nested Python lists through
pickle (what its ZMQ hops carried; ZMQ itself is not installed here, so only
serialization is compared), and the prompt-side case of 32768 positions x k=2.

    python -m bench.hop            # writes bench/out/hop.md and bench/out/hop.json
"""

import argparse
import asyncio
import dataclasses
import multiprocessing
import pickle
import signal
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np
from flatwire_wire.control import EMPTY
from flatwire_wire.logprobs import F32, I32, LogprobBlock, LogprobRows
from flatwire_wire.scheduler import SCHEDULER
from flatwire_wire.steps import StepMessage
from flatwire_wire.steps import decode_step as decode_message

from bench.common import Interleaved, Progress, Table, Timing, fmt_bytes, fmt_ratio, fmt_time, write_results
from services.common.rpc import DEFAULT_MAX_MESSAGE_MB, create_channel, create_server

VOCAB = 248077  # the Qwen3.5 vocabulary of the default model
STREAM = SCHEDULER.methods["StreamSteps"]
STREAM_SECONDS = 0.15  # target length of one streamed run; sets the message count


@dataclass(frozen=True)
class Shape:
    """One step's logprob payload: `requests` x `rows` positions x `k` top-k."""

    requests: int
    k: int
    rows: int = 1
    prompt: bool = False  # on the prompt side (prefill finished) instead of one output token each

    @property
    def label(self) -> str:
        return f"prompt {self.rows} x k={self.k}" if self.prompt else f"B={self.requests} k={self.k}"


@dataclass
class StepArrays:
    """What the scheduler holds after its one device-to-host copy of a step."""

    rids: list[str]
    token_ids: np.ndarray  # [B*rows] i4
    token_logprobs: np.ndarray  # [B*rows] f4
    topk_values: np.ndarray  # [B*rows, k] f4
    topk_ids: np.ndarray  # [B*rows, k] i4
    shape: Shape


def make_step(shape: Shape, seed: int = 0) -> StepArrays:
    rng = np.random.default_rng(seed)
    n = shape.requests * shape.rows
    values = -np.sort(rng.exponential(2.0, size=(n, shape.k)).astype(F32), axis=1)
    return StepArrays(
        rids=[f"{i:032x}" for i in range(shape.requests)],  # uuid4().hex-sized ids
        token_ids=rng.integers(0, VOCAB, size=n, dtype=I32),
        token_logprobs=-rng.exponential(2.0, size=n).astype(F32),
        topk_values=values,
        topk_ids=rng.integers(0, VOCAB, size=(n, shape.k), dtype=I32),
        shape=shape,
    )


# ---- flatwire: the struct-of-arrays message ----

def encode_step(step: StepArrays, number: int = 0) -> bytes:
    shape = step.shape
    no_ids = np.zeros((shape.rows, 0), dtype=F32)
    block = LogprobBlock.of_rows([
        LogprobRows(step.token_logprobs[at:at + shape.rows], step.topk_values[at:at + shape.rows],
                    step.topk_ids[at:at + shape.rows], no_ids)
        for at in range(0, shape.requests * shape.rows, shape.rows)])
    if shape.prompt:
        message = StepMessage(step=number, prompt_rids=step.rids, prompt=block)
    else:
        message = StepMessage(step=number, rids=step.rids, token_ids=step.token_ids.tolist(),
                              positions=[number] * len(step.rids), counts=[1] * len(step.rids), output=block)
    return message.encoded


def decode_step(data: bytes) -> list:
    """Parse and split per request, as the gateway's dispatch does (numpy views of the block per entry)."""
    message = decode_message(data)
    if message.prompt is not None:
        return [(rid, message.prompt.request(i)) for i, rid in enumerate(message.prompt_rids)]
    assert message.output is not None
    return [(rid, message.token_ids[i], message.output.request(i)) for i, rid in enumerate(message.rids)]


# ---- SGLang: nested Python lists of (logprob, token_id, text) through pickle ----

def nested_step(step: StepArrays, top_k_only: bool = False):
    """The same data as SGLang's hops carried it: per position a (logprob, id, None)
    triple for the chosen token and a list of k triples for the candidates."""
    top = [[(v, i, None) for v, i in zip(vals, ids)]
           for vals, ids in zip(step.topk_values.tolist(), step.topk_ids.tolist())]
    if top_k_only:
        return top
    chosen = [(v, i, None) for v, i in zip(step.token_logprobs.tolist(), step.token_ids.tolist())]
    rows = step.shape.rows
    return {
        "rids": step.rids,
        "token_logprobs": [chosen[r * rows:(r + 1) * rows] for r in range(step.shape.requests)],
        "top_logprobs": [top[r * rows:(r + 1) * rows] for r in range(step.shape.requests)],
    }


def pickle_dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  # what pyzmq's send_pyobj uses


# ---- the hop: a Scheduler/StreamSteps server in a child process ----

def _metadata(shape: Shape, count: int, mode: str) -> tuple:
    return (("requests", str(shape.requests)), ("k", str(shape.k)), ("rows", str(shape.rows)),
            ("prompt", str(int(shape.prompt))), ("count", str(count)), ("mode", mode))


async def _stream_steps(request, context):
    """Streams `count` StepOutputs: pre-serialized ("bytes": transport alone) or
    encoded from the step's numpy arrays per message ("encode": as the scheduler)."""
    meta = dict(context.invocation_metadata())
    shape = Shape(int(meta["requests"]), int(meta["k"]), int(meta["rows"]), meta["prompt"] == "1")
    step, count = make_step(shape), int(meta["count"])
    data = encode_step(step)
    for number in range(count):
        yield data if meta["mode"] == "bytes" else encode_step(step, number)


async def _serve(conn) -> None:
    server = create_server(DEFAULT_MAX_MESSAGE_MB)
    # Bytes out (no response serializer): the handler chooses when encoding happens.
    handler = grpc.unary_stream_rpc_method_handler(_stream_steps, request_deserializer=STREAM.decode_request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SCHEDULER.name, {"StreamSteps": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.stop(0)))
    conn.send(port)
    await server.wait_for_termination()


def serve(conn) -> None:
    asyncio.run(_serve(conn))


async def stream_once(channel: grpc.aio.Channel, shape: Shape, count: int, mode: str) -> float:
    """Seconds per message, first to last arrival (call setup excluded)."""
    call = channel.unary_stream(STREAM.path, request_serializer=STREAM.encode_request)(
        EMPTY, metadata=_metadata(shape, count, mode))
    first = last = 0.0
    received = 0
    async for data in call:
        if mode == "encode":
            decode_step(data)
        last = time.perf_counter()
        if received == 0:
            first = last
        received += 1
    assert received == count, (received, count)
    return (last - first) / (count - 1)


def stream_count(message_bytes: int) -> int:
    """Messages per streamed run: ~STREAM_SECONDS at ~100 us + 2.4 ns/byte each."""
    estimate = 100e-6 + message_bytes * 2.4e-9
    return int(np.clip(STREAM_SECONDS / estimate, 50, 1500))


# ---- the run ----

@dataclass
class HopResult:
    shape: Shape
    message_bytes: int
    topk_elements: int
    encode: Timing
    decode: Timing
    transport: Timing  # pre-serialized messages, per message, amortised
    streamed: Timing  # encode in the server + decode in the client, pipelined, per message
    pickle_bytes: int
    nested_build: Timing
    pickle_dumps: Timing
    pickle_loads: Timing

    @property
    def hop(self) -> float:
        """encode + transport + decode, one after the other (no overlap credited)."""
        return self.encode.median + self.transport.median + self.decode.median

    @property
    def flat_serialize(self) -> float:
        return self.encode.median + self.decode.median

    @property
    def nested_total(self) -> float:
        return self.nested_build.median + self.pickle_dumps.median + self.pickle_loads.median


def step_cases(step: StepArrays) -> dict[str, Callable[[], object]]:
    data = encode_step(step)
    nested = nested_step(step)
    pickled = pickle_dumps(nested)
    return {
        "encode": lambda: encode_step(step),
        "decode": lambda: decode_step(data),
        "nested_build": lambda: nested_step(step),
        "pickle_dumps": lambda: pickle_dumps(nested),
        "pickle_loads": lambda: pickle.loads(pickled),
    }


def prompt_cases(step: StepArrays) -> dict[tuple[str, str], tuple[int, Callable[[], object]]]:
    """32768 x 2 on the prompt side: (format, encode|decode) -> (bytes, call)."""
    cases = {}
    for name, obj in (("nested pickle (with token logprobs)", nested_step(step)),
                      ("nested pickle (top-k only)", nested_step(step, top_k_only=True))):
        pickled = pickle_dumps(obj)
        cases[name, "encode"] = (len(pickled), lambda obj=obj: pickle_dumps(obj))
        cases[name, "decode"] = (len(pickled), lambda pickled=pickled: pickle.loads(pickled))
    data = encode_step(step)
    cases["flat StepOutput (with token logprobs)", "encode"] = (len(data), lambda: encode_step(step))
    cases["flat StepOutput (with token logprobs)", "decode"] = (len(data), lambda: decode_step(data))
    topk = step.topk_values.tobytes() + step.topk_ids.tobytes()
    cases["flat arrays (top-k only)", "encode"] = (
        len(topk), lambda: step.topk_values.tobytes() + step.topk_ids.tobytes())
    cases["flat arrays (top-k only)", "decode"] = (
        len(topk), lambda: (np.frombuffer(topk, F32, step.topk_values.size),
                            np.frombuffer(topk, I32, offset=step.topk_values.nbytes)))
    return cases


def breakdown_cases(shape: Shape) -> dict[str, Callable[[], object]]:
    """The gateway side of one hop, step by step (where decode + slice goes)."""
    data = encode_step(make_step(shape))
    message = decode_message(data)
    assert message.output is not None
    block = message.output
    return {
        "bytes -> StepMessage": lambda: decode_message(data),
        "first entry (numpy views, offsets)": lambda: dataclasses.replace(block).request(0),
        f"entry views x {shape.requests}": lambda: [block.request(i) for i in range(shape.requests)],
    }


@dataclass
class Run:
    results: list[HopResult]
    prompt: dict[str, dict]
    breakdown: dict[str, Timing]


async def run(shapes: list[Shape], prompt: Shape, target: Shape, repeats: int) -> Run:
    """Every timing in interleaved rounds (see bench.common.Interleaved), streams included."""
    bench = Interleaved()
    steps = {shape: make_step(shape) for shape in shapes}
    for shape, step in steps.items():
        for name, fn in step_cases(step).items():
            bench.add((shape, name), fn)
    sizes = {}
    for key, (size, fn) in prompt_cases(make_step(prompt)).items():
        bench.add(("prompt", *key), fn)
        sizes[key[0]] = size
    breakdown = breakdown_cases(target)
    for name, fn in breakdown.items():
        bench.add(("breakdown", name), fn)
    progress = Progress(repeats + 1, "hop")
    progress.step(f"calibrated {len(bench.cases)} cases")

    conn, child_conn = multiprocessing.Pipe()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(child_conn,), daemon=True)
    server.start()
    try:
        if not conn.poll(60):
            raise RuntimeError("hop server did not start")
        channel = create_channel(f"127.0.0.1:{conn.recv()}", DEFAULT_MAX_MESSAGE_MB)
        await channel.channel_ready()
        await stream_once(channel, Shape(1, 0), 50, "encode")  # warm the connection
        counts = {shape: stream_count(len(encode_step(step))) for shape, step in steps.items()}
        for round_number in range(repeats):
            for shape, count in counts.items():
                bench.record((shape, "transport"), await stream_once(channel, shape, count, "bytes"), count)
                bench.record((shape, "streamed"), await stream_once(channel, shape, count, "encode"), count)
            bench.round()
            so_far = sum(bench.timing((target, part)).median for part in ("encode", "transport", "decode"))
            progress.step(f"round {round_number + 1}/{repeats}: {target.label} hop {fmt_time(so_far)} so far")
        await channel.close()
    finally:
        server.terminate()
        server.join(10)

    results = [HopResult(
        shape=shape, message_bytes=len(encode_step(step)), topk_elements=step.topk_ids.size,
        pickle_bytes=len(pickle_dumps(nested_step(step))),
        **{name: bench.timing((shape, name)) for name in
           ("encode", "decode", "transport", "streamed", "nested_build", "pickle_dumps", "pickle_loads")},
    ) for shape, step in steps.items()]
    prompt_rows = {name: {"bytes": size, "encode": bench.timing(("prompt", name, "encode")),
                          "decode": bench.timing(("prompt", name, "decode"))} for name, size in sizes.items()}
    return Run(results, prompt_rows, {name: bench.timing(("breakdown", name)) for name in breakdown})


def marginal(results: list[HopResult], requests: int, low_k: int, high_k: int) -> dict:
    """Added cost per added top-k element (8 bytes) from low_k to high_k at B=requests.

    From the fastest repeat of each timing: a difference of two medians on a busy
    2-core machine is mostly the other processes' noise.
    """
    by_k = {r.shape.k: r for r in results if r.shape.requests == requests and not r.shape.prompt}
    low, high = by_k[low_k], by_k[high_k]

    def added(name: str) -> float:
        return getattr(high, name).low - getattr(low, name).low

    parts = {name: added(name) for name in ("encode", "decode", "transport")}
    parts["hop"] = sum(parts.values())
    parts["nested build + dumps + loads"] = added("nested_build") + added("pickle_dumps") + added("pickle_loads")
    elements = high.topk_elements - low.topk_elements
    return {"requests": requests, "elements": elements, "bytes": high.message_bytes - low.message_bytes,
            "ns_per_element": {name: seconds / elements * 1e9 for name, seconds in parts.items()}}


def tables(results: list[HopResult], prompt: dict, slopes: list[dict], target: HopResult,
           breakdown: dict[str, Timing]) -> list[Table]:
    hop = Table("One step across a gRPC hop (Scheduler/StreamSteps, loopback, child process)",
                ["B", "k", "message", "encode", "transport", "decode + slice", "hop (sum)", "streamed (pipelined)"],
                "encode: numpy -> LogprobBlock.of_rows -> StepMessage bytes. transport: pre-serialized messages "
                "streamed back to back, per message (first to last arrival). decode + slice: bytes -> "
                "StepMessage -> numpy views per entry, as the gateway dispatches. "
                "hop (sum) = encode + transport + decode, no overlap credited. streamed: the server encodes "
                "each message from numpy and the client decodes and slices each, per message; server and "
                "client overlap on the two cores.")
    nested = Table("The same step as SGLang-style nested lists through pickle (serialization only)",
                   ["B", "k", "pickle", "flat", "build lists", "pickle.dumps", "pickle.loads",
                    "nested total", "flat encode + decode", "nested / flat time", "nested / flat bytes"],
                   "ZMQ is not installed here, so transport is not compared: pickle's bytes would ride ZMQ "
                   "where flatwire's ride gRPC. Per position: (logprob, id, None) for the chosen token and k "
                   "such triples for the candidates, plus the rids. nested total = build lists from numpy "
                   "(.tolist(), as SGLang's scheduler does) + dumps + loads; flat encode + decode also starts "
                   "from numpy and ends with per-request arrays.")
    for r in results:
        hop.add(r.shape.requests if not r.shape.prompt else f"1 ({r.shape.rows} rows)", r.shape.k,
                fmt_bytes(r.message_bytes), fmt_time(r.encode.median), fmt_time(r.transport.median),
                fmt_time(r.decode.median), fmt_time(r.hop), fmt_time(r.streamed.median))
        if not r.shape.prompt:
            nested.add(r.shape.requests, r.shape.k, fmt_bytes(r.pickle_bytes), fmt_bytes(r.message_bytes),
                       fmt_time(r.nested_build.median), fmt_time(r.pickle_dumps.median),
                       fmt_time(r.pickle_loads.median), fmt_time(r.nested_total),
                       fmt_time(r.flat_serialize), fmt_ratio(r.nested_total / r.flat_serialize),
                       fmt_ratio(r.pickle_bytes / r.message_bytes))
    side = Table("Prompt side: one request, 32768 positions x k=2",
                 ["format", "bytes", "encode / dumps", "decode / loads", "total"],
                 "Reference (issue 4): nested pickle 15.3 ms and 1.12 MB; flat arrays 0.06 ms and 0.53 MB "
                 "(top-k only). The flat StepOutput also carries each position's own logprob; its decode "
                 "includes the request slice.")
    for name, row in prompt.items():
        side.add(name, fmt_bytes(row["bytes"]), fmt_time(row["encode"].median), fmt_time(row["decode"].median),
                 fmt_time(row["encode"].median + row["decode"].median))
    slope = Table("Added cost per added top-k element (8 bytes), k=20 -> k=128",
                  ["B", "elements added", "encode", "decode", "transport", "hop (sum)", "nested build + dumps + loads"],
                  "Nanoseconds per element, from the fastest repeat of each timing (differences of medians "
                  "on a shared 2-core machine are mostly noise; at B=1 even the fastest are). Python work "
                  "per element costs tens of ns (see nested); copying bytes costs about one.")
    for s in slopes:
        ns = s["ns_per_element"]
        slope.add(s["requests"], s["elements"], *(f"{ns[c]:.2f}" for c in
                  ("encode", "decode", "transport", "hop", "nested build + dumps + loads")))
    parts = Table(f"Where the {target.shape.label} hop goes",
                  ["part", "median"], "The decode side split up (each part timed alone).")
    parts.add("encode", fmt_time(target.encode.median))
    parts.add("transport", fmt_time(target.transport.median))
    for name, timing in breakdown.items():
        parts.add(name, fmt_time(timing.median))
    checks = Table("Targets", ["target", "measured", "verdict"])
    fastest = target.encode.low + target.transport.low + target.decode.low
    checks.add("B=32 k=128 step: under 0.5 ms per hop end to end",
               f"{fmt_time(target.hop)} (sum of medians; fastest rounds {fmt_time(fastest)})",
               "met" if target.hop < 0.5e-3 else "missed")
    big = max(slopes, key=lambda s: s["elements"])
    ns = big["ns_per_element"]
    flat_ns = ns["encode"] + ns["decode"]
    checks.add("k=20 -> 128: per-hop cost grows with bytes only (no per-element Python work; "
               "flat encode + decode under a tenth of nested's added cost per element)",
               f"B={big['requests']}: encode + decode {flat_ns:.2f} ns/element, transport {ns['transport']:.2f}; "
               f"nested {ns['nested build + dumps + loads']:.1f}",
               # A ratio from the same run, so load from other processes hits both sides alike.
               "met" if flat_ns * 10 < ns["nested build + dumps + loads"] else "missed")
    return [hop, nested, side, slope, parts, checks]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians are reported")
    args = parser.parse_args(argv)
    prompt = Shape(1, 2, rows=32768, prompt=True)
    target = Shape(32, 128)
    shapes = [Shape(b, k) for b in (1, 32, 256) for k in (0, 20, 128)] + [prompt]
    result = asyncio.run(run(shapes, prompt, target, args.repeats))
    slopes = [marginal(result.results, b, 20, 128) for b in (1, 32, 256)]
    target_result = next(r for r in result.results if r.shape == target)
    data = {"hops": result.results, "prompt_side": result.prompt, "marginal_k20_to_k128": slopes,
            "target_decode_breakdown": result.breakdown}
    command = "python -m bench.hop" + (f" --repeats {args.repeats}" if args.repeats != 5 else "")
    print(write_results("hop", command, tables(result.results, result.prompt, slopes, target_result,
                                               result.breakdown), _plain(data)))


def _plain(value):
    """Dataclasses to dicts for the JSON (Timing stays for write_results to expand)."""
    if isinstance(value, HopResult):
        fields = {name: _plain(getattr(value, name)) for name in value.__dataclass_fields__}
        return {**fields, "hop": value.hop, "flat_serialize": value.flat_serialize,
                "nested_total": value.nested_total}
    if isinstance(value, Shape):
        return {"requests": value.requests, "k": value.k, "rows": value.rows, "prompt": value.prompt}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


if __name__ == "__main__":
    main()
