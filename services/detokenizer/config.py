"""Detokenizer options (every field is a flag and a FLATWIRE_* environment variable)."""

from dataclasses import dataclass

from services.common.config import ServiceConfig, option


@dataclass
class DetokenizerConfig(ServiceConfig):
    """flatwire detokenizer: turns scheduler steps into text deltas, applies stop strings, routes to gateways."""

    port: int = option(30020, "gRPC port")
    schedulers: list[str] = option(["127.0.0.1:30010"], "scheduler addresses host:port; a DNS name that resolves "
                                   "to several addresses counts as one replica each")
    resolve_interval_s: float = option(5.0, "seconds between re-resolving scheduler names (replicas come and go)")
    reconnect_max_s: float = option(2.0, "longest wait between reconnection attempts to a scheduler")
    owner_grace_s: float = option(10.0, "seconds a gateway may stay unsubscribed before its running requests are "
                                  "aborted (it died, or lost its connection for good); its outputs wait meanwhile")
    scheduler_grace_s: float = option(30.0, "seconds a scheduler's step stream may stay broken before its requests "
                                      "here are failed (within it, resubscribing replays what was missed)")
    max_outbox_messages: int = option(4, "messages waiting for one connected gateway before this detokenizer stops "
                                      "reading scheduler steps until it catches up (back-pressure): the steps then "
                                      "wait in the scheduler, whose streaming output coalesces into fewer entries "
                                      "while they do (--stream-coalesce-tokens)")
    stall_timeout_s: float = option(10.0, "a gateway that stays past --max-outbox-messages this long has its stream "
                                    "ended and what waits for it dropped (it fails those requests)")
