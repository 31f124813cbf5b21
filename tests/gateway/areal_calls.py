"""What AReaL's RemoteSGLangEngine (the `areal` package, 1.0.4) sends an SGLang server, in the shape of its sources
(the package pins torch < 2.11 and transformers <= 5.3, so it cannot be installed beside flatwire's; with it
importable, tests/gateway/test_areal_client.py also drives the unmodified engine):

- areal/engine/sglang_remote.py, SGLangBackend: `build_generation_request` (the /generate body: `image_data` is
  the request's, [] unless it has images), `parse_generation_response`, `get_pause_request`, `get_resume_request`,
  `get_health_check_request`, `build_disk_weight_update_requests`.
- areal/infra/remote_inf_engine.py, RemoteInfEngine.agenerate: the loop that sends a request again, prompt and
  output so far, after an abort (a pause), until it stops or reaches max_new_tokens; `pause_generation` and
  `continue_generation` send the pause and resume requests to every server.
- areal/api/cli_args.py, GenerationHyperparameters: the defaults of its sampling options.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

PAUSE = ("/pause_generation", {})  # SGLangBackend.get_pause_request
CONTINUE = ("/continue_generation", {})  # SGLangBackend.get_resume_request
HEALTH = "/health"  # SGLangBackend.get_health_check_request (GET)


@dataclass
class GenerationHyperparameters:
    """AReaL's defaults (top_k int(1e8): no limit), but a max_new_tokens a test can afford."""

    max_new_tokens: int = 16
    max_tokens: int = 32768
    greedy: bool = False
    top_p: float = 1.0
    top_k: int = int(1e8)
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop: list[str] | None = None
    frequency_penalty: float = 0.0


def generation_request(input_ids: list[int], gconfig: GenerationHyperparameters,
                       image_data: list[str] | None = None) -> dict:
    """SGLangBackend.build_generation_request (no LoRA, no routed experts); ModelRequest.image_data defaults to []."""
    sample_params = {
        "top_p": gconfig.top_p,
        "top_k": gconfig.top_k,
        "max_new_tokens": gconfig.max_new_tokens,
        "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
        "stop_token_ids": gconfig.stop_token_ids,
        "ignore_eos": gconfig.ignore_eos,
        "skip_special_tokens": gconfig.skip_special_tokens,
        "frequency_penalty": gconfig.frequency_penalty,
    }
    if gconfig.stop:
        sample_params["stop"] = gconfig.stop
    return {"input_ids": input_ids.copy(), "image_data": [] if image_data is None else image_data,
            "sampling_params": sample_params, "return_logprob": True, "stream": False}


def parse_generation_response(response: dict) -> tuple[list[int], list[float], str]:
    """SGLangBackend.parse_generation_response: (output tokens, their logprobs, stop reason)."""
    meta_info = response["meta_info"]
    finish_reason = meta_info["finish_reason"]
    stop_reason = finish_reason["type"]
    if stop_reason == "abort" and finish_reason.get("message", "").startswith("Abort before prefill"):
        return [], [], stop_reason
    output_tokens = [x[1] for x in meta_info["output_token_logprobs"]]
    output_logprobs = [x[0] for x in meta_info["output_token_logprobs"]]
    return output_tokens, output_logprobs, stop_reason


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    responses: list[dict]  # each /generate answer, in order


def agenerate(url: str, input_ids: list[int], gconfig: GenerationHyperparameters,
              is_paused: Callable[[], bool] = lambda: False, on_answer: Callable[[dict], None] = lambda _: None
              ) -> Generation:
    """RemoteInfEngine.agenerate's loop (synchronous here): resend prompt + output so far after each abort, waiting
    while the rollout is paused (`is_paused`, its WorkflowExecutor's flag), until the output stops or is long
    enough; an abort at the end counts as length."""
    max_new_tokens = min(gconfig.max_tokens - len(input_ids), gconfig.max_new_tokens)
    gconfig.max_new_tokens = max_new_tokens
    input_ids = input_ids.copy()
    tokens, logprobs, responses = [], [], []
    stop_reason = None
    while stop_reason not in ["stop", "tool_calls", "length"] and len(tokens) < max_new_tokens:
        while is_paused():
            time.sleep(0.05)  # AReaL sleeps 0.5 s
        response = httpx.post(url + "/generate", json=generation_request(input_ids, gconfig), timeout=300)
        response.raise_for_status()
        result = response.json()
        responses.append(result)
        on_answer(result)
        new_tokens, new_logprobs, stop_reason = parse_generation_response(result)
        tokens += new_tokens
        logprobs += new_logprobs
        input_ids += new_tokens
        gconfig.max_new_tokens -= len(new_tokens)
    if stop_reason == "abort":
        stop_reason = "length"
    return Generation(tokens, logprobs, stop_reason, responses)


def disk_update(model_path: str) -> tuple[str, dict]:
    """SGLangBackend.build_disk_weight_update_requests (no LoRA)."""
    return "/update_weights_from_disk", {"model_path": model_path, "abort_all_requests": True}
