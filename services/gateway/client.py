"""A small Python client for flatwire's public gRPC API, returning numpy arrays.

    from services.gateway.client import FlatwireClient
    with FlatwireClient("127.0.0.1:30001") as client:
        result = client.generate("Hello", max_new_tokens=16, top_logprobs_num=128)
        result.output.topk_values  # float32 [tokens, 128], -inf kept
"""

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from services.common.arrays import I32, decode_block
from services.common.pb import arrays_pb2, generate_pb2, scheduler_pb2
from services.common.rpc import message_options
from services.gateway.grpc_api import SERVICE_NAME
from services.gateway.result import FINISH_NAMES, LogprobTrack


@dataclass
class Generation:
    """One response (a stream chunk, or the whole result)."""

    rid: str
    token_ids: np.ndarray  # i4
    text: str
    output: LogprobTrack | None
    prompt: LogprobTrack | None
    finish_reason: str | None
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int


def _track(block: arrays_pb2.LogprobBlock, token_ids: np.ndarray) -> LogprobTrack | None:
    if not block.rows:
        return None
    arrays = decode_block(block)
    return LogprobTrack.of_request(arrays, token_ids, int(arrays.topk[0]), int(arrays.id_counts[0]))


def _generation(response: generate_pb2.GenerateResponsePacked, input_ids: list[int] | None) -> Generation:
    token_ids = np.frombuffer(response.token_ids, dtype=I32)
    prompt = _track(response.prompt, np.zeros(0, dtype=I32))
    if prompt is not None and input_ids is not None:
        prompt.token_ids = np.asarray(input_ids[len(input_ids) - len(prompt.token_logprobs):], dtype=I32)
    finish = FINISH_NAMES.get(response.finish_reason)
    matched: int | str | None = None
    if response.finish_reason == arrays_pb2.FINISH_REASON_STOP_TOKEN:
        matched = response.matched_token
    elif response.finish_reason == arrays_pb2.FINISH_REASON_STOP_STRING:
        matched = response.matched_stop
    return Generation(response.rid, token_ids, response.text, _track(response.output, token_ids), prompt,
                      finish, matched, response.prompt_tokens, response.completion_tokens)


class FlatwireClient:
    def __init__(self, address: str, max_message_mb: int = 1024, api_key: str | None = None):
        """api_key: the gateway's --api-key, sent as `authorization: Bearer` metadata."""
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channel = grpc.insecure_channel(address, options=message_options(max_message_mb))
        self._generate = self._channel.unary_stream(
            f"/{SERVICE_NAME}/Generate",
            request_serializer=generate_pb2.GenerateRequest.SerializeToString,
            response_deserializer=generate_pb2.GenerateResponsePacked.FromString)
        self._model_info = self._channel.unary_unary(
            f"/{SERVICE_NAME}/GetModelInfo",
            request_serializer=scheduler_pb2.ModelInfoRequest.SerializeToString,
            response_deserializer=scheduler_pb2.ModelInfo.FromString)

    def __enter__(self) -> "FlatwireClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def model_info(self) -> scheduler_pb2.ModelInfo:
        return self._model_info(scheduler_pb2.ModelInfoRequest(), metadata=self._metadata)

    def stream(self, text: str | None = None, input_ids: list[int] | None = None, **options) -> Iterator[Generation]:
        """Yield one Generation per chunk as tokens arrive."""
        request = self._request(text, input_ids, stream=True, **options)
        for response in self._generate(request, metadata=self._metadata):
            yield _generation(response, input_ids)

    def generate(self, text: str | None = None, input_ids: list[int] | None = None, **options) -> Generation:
        """The whole result. Options: max_new_tokens, temperature, top_p, top_k, min_p, seed,
        stop_token_ids, ignore_eos, return_logprob, top_logprobs_num, logprob_start_len,
        token_ids_logprob, stop, skip_special_tokens, no_stop_trim, timeout."""
        request = self._request(text, input_ids, stream=False, **options)
        *_, last = self._generate(request, timeout=options.get("timeout"), metadata=self._metadata)
        return _generation(last, input_ids)

    @staticmethod
    def _request(text, input_ids, stream: bool, *, max_new_tokens: int = 128, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                 seed: int | None = None, stop_token_ids=(), ignore_eos: bool = False, return_logprob: bool = False,
                 top_logprobs_num: int = 0, logprob_start_len: int | None = None, token_ids_logprob=(), stop=(),
                 skip_special_tokens: bool | None = None, no_stop_trim: bool = False, timeout: float | None = None):
        sampling = scheduler_pb2.SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            seed=seed, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        return generate_pb2.GenerateRequest(
            text=text or "", input_ids=input_ids or [], sampling=sampling,
            return_logprob=return_logprob or top_logprobs_num > 0 or bool(token_ids_logprob),
            top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
            token_ids_logprob=token_ids_logprob, stop=stop, skip_special_tokens=skip_special_tokens,
            no_stop_trim=no_stop_trim, stream=stream)
