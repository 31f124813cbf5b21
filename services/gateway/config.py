"""The gateway's configuration (flags and FLATWIRE_* environment variables)."""

from dataclasses import dataclass

from services.common.config import ServiceConfig, option


@dataclass
class GatewayConfig(ServiceConfig):
    """flatwire gateway: HTTP (SGLang- and OpenAI-compatible) and public gRPC."""

    port: int = option(30000, "HTTP port")
    grpc_port: int = option(30001, "public gRPC port")
    schedulers: list[str] = option(["127.0.0.1:30010"], "scheduler addresses host:port; a DNS name that resolves "
                                   "to several addresses counts as one replica each")
    detokenizers: list[str] = option(["127.0.0.1:30020"], "detokenizer addresses host:port")
    served_model_name: str | None = option(None, "model name in the OpenAI API (default: the model dir's name)")
    owner_id: str | None = option(None, "this gateway's routing id (default: random)")
    health_interval_s: float = option(1.0, "seconds between checks of each scheduler's path (scheduler, detokenizer)")
    health_timeout_s: float = option(2.0, "how long one such check waits for an answer")
    hop_timeout_s: float = option(5.0, "a request whose path (scheduler, detokenizer, or this gateway's stream "
                                  "from it) stays broken this long fails with an error naming the hop")
    max_batch_size: int = option(4096, "most generations one HTTP request may ask for (a /generate batch's prompts, "
                                 "a completion's prompts x n, a chat's n); more is refused with 400")
    max_concurrent_submits: int = option(256, "Submit and Abort RPCs in flight to the schedulers at once; the rest "
                                         "wait their turn (a gRPC server cancels calls past its backlog)")

    def __post_init__(self):
        for name in ("max_batch_size", "max_concurrent_submits", "hop_timeout_s", "health_interval_s",
                     "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be positive")
