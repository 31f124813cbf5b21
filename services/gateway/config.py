"""The gateway's configuration (flags and FLATWIRE_* environment variables)."""

from dataclasses import dataclass

from services.common.config import ServiceConfig, env_flag, option, require_ports, require_positive
from services.common.event_loop import EventLoop
from services.gateway.agents.reasoning import ReasoningParserName
from services.gateway.agents.tool_calls import ToolCallParserName
from services.gateway.http.parsers import HttpParser
from services.gateway.routing import RoutingPolicy

SGLANG_ORIGINAL_LOGPROB = "SGLANG_RETURN_ORIGINAL_LOGPROB"


@dataclass
class GatewayConfig(ServiceConfig):
    """flatwire gateway: HTTP (SGLang- and OpenAI-compatible) and public gRPC."""

    port: int = option(30000, "HTTP port")
    grpc_port: int = option(30001, "public gRPC port")
    reuse_port: bool = option(False, "bind the HTTP and public gRPC ports with SO_REUSEPORT, so that several gateway "
                              "processes on one host share them and the kernel spreads connections across them "
                              "(flatwire up --gateway-workers); each is an ordinary gateway, with its own admission "
                              "limits, that listens once its path to a scheduler works (30 s at most). Off, a second "
                              "server on a taken port fails to start")
    schedulers: list[str] = option(["127.0.0.1:30010"], "scheduler addresses host:port; a DNS name that resolves "
                                   "to several addresses counts as one replica each")
    detokenizers: list[str] = option(["127.0.0.1:30020"], "detokenizer addresses host:port; a DNS name that "
                                     "resolves to several addresses counts as one detokenizer each (a Kubernetes "
                                     "headless Service of pods that each run a scheduler and its detokenizer)")
    served_model_name: str | None = option(None, "model name in the OpenAI API (default: the model dir's name)")
    api_key: str | None = option(None, "require `Authorization: Bearer KEY` on every HTTP route but /health, and "
                                 "`authorization: Bearer KEY` metadata on the public gRPC API (health open); "
                                 "default: none (open); prefer the environment variable to the flag (visible in ps)")
    admin_api_key: str | None = option(None, "the only key that opens the admin operations (weight updates and "
                                       "weight-sync groups, pause and continue, abort_all, update_weight_version, "
                                       "flush_cache, memory release and resume; HTTP and public gRPC; vLLM's "
                                       "pause, resume, sleep, wake_up, reset_prefix_cache and is_ routes), as "
                                       "SGLang's --admin-api-key; unset: they need --api-key like the rest")
    routing_policy: RoutingPolicy = option(
        RoutingPolicy.CACHE_AWARE, "which scheduler replica takes a request: cache_aware, the one its session "
        "(X-SMG-Routing-Key or X-Session-ID header, or gRPC metadata) or the longest prefix of its prompt last went "
        "to, unless it is much busier than the least loaded (routing.py); least_loaded, the one with the fewest "
        "requests outstanding")
    owner_id: str | None = option(None, "this gateway's routing id (default: random)")
    health_interval_s: float = option(1.0, "seconds between checks of each scheduler's path (scheduler, detokenizer)")
    health_timeout_s: float = option(2.0, "how long one such check waits for an answer")
    health_failure_threshold: int = option(
        3, "checks (or submits) in a row that get no answer within their timeout before a scheduler leaves rotation "
        "(SGLang's router: --health-failure-threshold); a refused connection, a restart or a detokenizer that no "
        "longer follows it takes it out at once")
    hop_timeout_s: float = option(5.0, "a request whose path (scheduler, detokenizer, or this gateway's stream "
                                  "from it) stays broken this long fails with an error naming the hop")
    tool_call_parser: ToolCallParserName | None = option(
        None, "how tool calls are read out of the model's text with tool_choice auto (SGLang's --tool-call-parser): "
        "qwen25 (also qwen, hermes: <tool_call> JSON blocks), llama3 (Llama 3's JSON calls) or qwen3_coder (also "
        "qwen3_xml: Qwen3.5's, Qwen3-Next's and Qwen3-Coder's <tool_call> blocks of <function=...> XML); unset: "
        "qwen3_coder where the model's chat template writes calls in that XML, else requests with tools need "
        "tool_choice required, a named function or none")
    reasoning_parser: ReasoningParserName | None = option(
        None, "split the model's <think> reasoning into the chat message's reasoning_content (SGLang's "
        "--reasoning-parser): qwen3 (the model opens the block) or deepseek-r1 (the prompt opens it)")
    stream_interval: int = option(1, "output tokens per message of a streaming request (SGLang's --stream-interval): "
                                  "1 sends each token as it is generated; more sends fewer, larger chunks")
    stream_coalesce_ms: float = option(
        50.0, "a streaming request whose tokens this gateway got to more than 5 ms late (it is behind: more streams "
              "than it renders an event per token for) waits as long again, at most this long, before its next event, "
              "which then carries several steps' tokens: under load events grow instead of latency; 0: never")
    incremental_streaming_output: bool = option(
        False, "/generate streams send each event's new text, output_ids and output logprobs only (SGLang's "
               "--incremental-streaming-output), not everything so far: linear bytes for long streams")
    return_original_logprob: bool = option(
        False, "/generate and the public gRPC API return the model's own logprobs (raw_logprobs: before temperature, "
               "logit_bias, penalties and the grammar) where a request names no logprobs_mode, instead of SGLang's "
               "(sglang_logprobs: at the temperature, before top-k/p and min-p); also on when SGLang's "
               "SGLANG_RETURN_ORIGINAL_LOGPROB is true. The OpenAI routes follow the scheduler's --logprobs-mode")
    max_batch_size: int = option(4096, "most generations one HTTP request may ask for (a /generate batch's prompts, "
                                 "a completion's prompts x n, a chat's n); more is refused with 400")
    max_concurrent_submits: int = option(256, "Submit and Abort RPCs in flight to the schedulers at once; the rest "
                                         "wait their turn (a gRPC server cancels calls past its backlog)")
    max_outstanding_requests: int = option(0, "generations this gateway holds at once (a batch counts each and is "
                                           "admitted whole); past it HTTP 429 with Retry-After, gRPC "
                                           "RESOURCE_EXHAUSTED; 0: 8 x the schedulers' max_running_requests, at "
                                           "least twice --max-batch-size (so that one request never holds all of "
                                           "it)")
    max_stop_strings: int = option(32, "most stop strings one request may give (stop); more is refused with 400")
    max_stop_length: int = option(256, "longest stop string in characters; longer is refused with 400")
    max_logprob_elements: int = option(4 * 1024 * 1024, "most logprob values one request may ask for: positions "
                                       "(max_new_tokens, plus prompt tokens from logprob_start_len) x "
                                       "(top_logprobs_num + len(token_ids_logprob)), summed over its generations; "
                                       "more is refused with 400")
    http_header_timeout_s: float = option(10.0, "seconds a client has to send a request's headers (on a new "
                                          "connection, or after the previous response); then the connection closes")
    http_body_timeout_s: float = option(30.0, "seconds a client has to send a request's whole body once its "
                                        "headers arrived; then 408 and the connection closes")
    http: HttpParser = option(HttpParser.HTTPTOOLS, "uvicorn's HTTP/1.1 parser (its --http): httptools (C) or h11 "
                              "(pure Python, about a fifth more gateway CPU per request)")
    loop: EventLoop = option(EventLoop.UVLOOP, "the event loop (uvicorn's --loop): uvloop (libuv, less CPU per event "
                             "and per request) or Python's asyncio")
    http_write_timeout_s: float = option(30.0, "seconds a client may read nothing while the server has response "
                                         "bytes waiting for it (its send buffer full); then the connection is cut "
                                         "and a stream still running aborted, so that a client that never reads "
                                         "cannot pin its response in memory; one that reads slowly is never cut")
    control_timeout_s: float = option(600.0, "most seconds a rollout control call waits for a scheduler replica "
                                      "(a weight update waits for the running requests to finish first); then that "
                                      "replica's answer is a failure")
    drain_timeout_s: float = option(25.0, "on SIGTERM or SIGINT, seconds to finish the requests in flight while "
                                    "refusing new ones (503, /health included) before exiting; what still runs then "
                                    "fails (503) as at a second signal; keep it below the pod's "
                                    "terminationGracePeriodSeconds")

    def __post_init__(self):
        super().__post_init__()
        # SGLang's switch, which trainers set in the environment they launch the server in
        self.return_original_logprob = self.return_original_logprob or env_flag(SGLANG_ORIGINAL_LOGPROB)
        require_ports(self, ("grpc_port",))
        require_positive(self, ("stream_interval", "max_batch_size", "max_concurrent_submits", "hop_timeout_s",
                                "health_interval_s", "health_timeout_s", "max_stop_strings", "max_stop_length",
                                "max_logprob_elements", "http_header_timeout_s", "http_body_timeout_s",
                                "control_timeout_s", "health_failure_threshold", "http_write_timeout_s"))
        for name in ("drain_timeout_s", "stream_coalesce_ms"):
            if not getattr(self, name) >= 0:  # also refuses nan
                raise ValueError(f"--{name.replace('_', '-')}: must not be negative")
        if self.max_outstanding_requests < 0:
            raise ValueError("--max-outstanding-requests: must be 0 (automatic) or positive")
        if 0 < self.max_outstanding_requests < self.max_batch_size:
            raise ValueError(f"--max-outstanding-requests: {self.max_outstanding_requests} is below --max-batch-size "
                             f"{self.max_batch_size}: a batch that large could never be admitted")
