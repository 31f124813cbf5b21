"""What a tool call costs the gateway: a chat round trip with tools against the same chat without them.

The default model on the real scheduler, detokenizer and a gateway started with --tool-call-parser qwen25 and
--reasoning-parser qwen3. Every request asks for the same output, forced by SGLang's `regex` field: a
reasoning block and one `<tool_call>` block (about 40 tokens), so the two kinds of request differ only in
what the gateway does: without tools the text is content (the reasoning still split out); with tools the
template also renders the tools' signatures (a longer prompt to tokenize) and the parser reads the call.
Measured: the gateway's CPU seconds per request (its /proc counters around R requests, C at a time), unary
and streamed, and the parse alone in this process (AssistantTurn over the same text, fed token-sized pieces).

    python -m bench.tool_calls              # writes bench/out/tool_calls.{md,json}
"""

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from bench.common import OUT_DIR, Progress, Table, measure, write_results
from bench.e2e import cpu_seconds
from harness.http import exact_regex
from harness.stack import running
from services.common.model_store import resolve_model
from services.gateway.agents.reasoning import ReasoningParserName, ThinkBlock
from services.gateway.agents.tool_calls import TaggedCalls
from services.gateway.agents.turn import AssistantTurn

OUTPUT = ('<think>\nThe user asks for the weather; the tool has it.\n</think>\n\n<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PIECE_CHARS = 4  # about a token's text


def parse_alone(stream: bool) -> None:
    turn = AssistantTurn(ThinkBlock(ReasoningParserName.QWEN3), TaggedCalls(frozenset({"get_weather"}), stream))
    for i in range(0, len(OUTPUT), PIECE_CHARS):
        turn.feed(OUTPUT[i:i + PIECE_CHARS])
    turn.end()


def round_trips(url: str, model: str, tools: bool, stream: bool, requests: int, concurrency: int) -> None:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 128, "temperature": 0, "stream": stream,
            "regex": exact_regex(OUTPUT), **({"tools": TOOLS} if tools else {})}

    def one(_: int) -> None:
        with httpx.Client(timeout=300) as http:
            if stream:
                with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                    response.raise_for_status()
                    text = "".join(response.iter_text())
                    expected = '"tool_calls"' if tools else '"finish_reason":"stop"'
                    if expected not in text:
                        raise RuntimeError(f"unexpected stream: {text[-300:]}")
            else:
                reply = http.post(f"{url}/v1/chat/completions", json=body)
                reply.raise_for_status()
                message = reply.json()["choices"][0]["message"]
                if bool(message.get("tool_calls")) != tools:
                    raise RuntimeError(f"unexpected message: {message}")

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tool_calls", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="requests of each kind per round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the four kinds in turn; a kind's cost is its median over the rounds (this "
                             "host's speed drifts more than the differences measured)")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    log_dir = OUT_DIR / "tool_calls-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(args.rounds + 1, "tool_calls")
    cases = [(tools, stream) for stream in (False, True) for tools in (False, True)]
    results: dict[str, Any] = {}
    costs: dict[str, list[float]] = {}
    with running(resolve_model(None), log_dir, scheduler_args=("--max-running-requests", "16"),
                 gateway_args=("--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3")) as stack:
        stack.wait_ready()
        stack.wait_warm()
        url = stack.http_url
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        gateway = stack.procs["gateway"].proc.pid
        round_trips(url, model, True, False, 2, 1)  # the regex's grammar compiled once, the routes warm
        for round_ in range(args.rounds):
            progress.step(f"round {round_ + 1}")
            for tools, stream in cases:
                before = cpu_seconds(gateway)
                round_trips(url, model, tools, stream, args.requests, args.concurrency)
                key = f"{'tools' if tools else 'plain'}_{'stream' if stream else 'unary'}"
                costs.setdefault(key, []).append((cpu_seconds(gateway) - before) / args.requests)
    for key, each in costs.items():
        results[f"{key}_cpu_s"] = statistics.median(each)
        results[f"{key}_cpu_s_rounds"] = each
    progress.step("the parse alone")
    parses = {stream: measure(lambda stream=stream: parse_alone(stream)) for stream in (False, True)}
    results["parse_unary_s"], results["parse_stream_s"] = parses[False].median, parses[True].median
    table = Table(f"Gateway CPU per chat round trip: median of {args.rounds} rounds of {args.requests} requests "
                  f"of each kind, at concurrency {args.concurrency}",
                  ["mode", "without tools", "with tools (auto, qwen25)", "difference", "the parse alone"])
    for stream in (False, True):
        mode = "streamed" if stream else "unary"
        plain = results[f"plain_{'stream' if stream else 'unary'}_cpu_s"]
        tools = results[f"tools_{'stream' if stream else 'unary'}_cpu_s"]
        table.add(mode, f"{plain * 1e3:.2f} ms", f"{tools * 1e3:.2f} ms", f"{(tools - plain) * 1e3:+.2f} ms",
                  f"{parses[stream].us:.0f} us")
    notes = ("Each request: the same ~40-token output (a reasoning block and one tool call, forced by `regex`); "
             "with tools the prompt also carries the tools' signatures (about 120 more tokens to render and "
             "tokenize). The parse alone: the reasoning and tool-call parsers over the output, 4 characters a piece "
             "(streamed: the call's arguments streamed from a partial JSON parse of the call so far, every 16 "
             "characters).")
    print(write_results("tool_calls", "python -m bench.tool_calls", [table], results, notes))


if __name__ == "__main__":
    main()
