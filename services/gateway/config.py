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
    health_interval_s: float = option(1.0, "seconds between health checks of schedulers")
