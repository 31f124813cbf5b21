"""What every route needs: the engine, metrics, the model's limits, the token text table."""

import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from fastapi import Request
from flatwire_wire.logprobs import F32, I32, RequestLogprobs

from services.common.auth import AccessKeys
from services.common.memory import freeze_heap
from services.gateway.config import GatewayConfig
from services.gateway.engine_client import EngineClient
from services.gateway.metrics import GatewayMetrics
from services.gateway.prompt_bound import bytes_per_token
from services.gateway.protocol.parse import ModelLimits, model_limits
from services.gateway.render.openai_chat import chat_logprobs
from services.gateway.render.openai_completions import completion_logprobs
from services.gateway.render.sglang_meta import LogprobFormat, logprob_meta_info
from services.gateway.reply import Output
from services.gateway.token_table import TokenTable

# What smg (sglang-router's successor) writes as a /generate body's `model` when its client named none (its
# UNKNOWN_MODEL_ID): the request asks for no model in particular.
ROUTER_UNNAMED_MODEL = "unknown"


@dataclass
class Gateway:
    engine: EngineClient
    config: GatewayConfig
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    renderers_ready: bool = False  # warm_up has run (/server_info says so)

    @cached_property
    def access(self) -> AccessKeys:
        return AccessKeys(self.config.api_key, self.config.admin_api_key)

    @cached_property
    def limits(self) -> ModelLimits:
        return model_limits(self.engine.model_info, self.config)  # the gRPC API's too

    @cached_property
    def table(self) -> TokenTable:
        return TokenTable(self.engine.tokenizer, self.limits.vocab_size)

    @property
    def model_names(self) -> list[str]:
        """The names the served model answers to, as GET /v1/models lists them."""
        return [self.engine.model_name]

    def model_named(self, name: str) -> str | None:
        """What a request's `model` selects, by any name /v1/models lists: the served model (its name); None when
        nothing served is called so. The one lookup of a model name, on every route."""
        return self.engine.model_name if name in self.model_names else None

    def warm_up(self) -> None:
        """Build what the first requests would otherwise build (seconds of CPU for a 250k vocabulary): the
        token table and every renderer's per-id pieces, by rendering one row in each format, and the prompt
        length bound; run it in a thread at startup so that no request stalls the event loop doing it."""
        bytes_per_token(self.engine.tokenizer)
        row = RequestLogprobs(token_ids=np.zeros(1, I32), token_logprobs=np.zeros(1, F32),
                           topk_values=np.zeros((1, 1), F32), topk_ids=np.zeros((1, 1), I32),
                           ids_logprobs=np.zeros((1, 1), F32))
        chat_logprobs(row, self.table)
        completion_logprobs([row], self.table)
        one_row = Output(token_ids=[0], text="", output=row, token_ids_logprob=[0])
        for with_text in (False, True):
            logprob_meta_info(one_row, LogprobFormat(return_text_in_logprobs=with_text), self.table)
        freeze_heap()  # the table and the pieces stay for the process's life
        self.renderers_ready = True


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway
