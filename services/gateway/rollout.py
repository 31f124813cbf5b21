"""Rollout control as the gateway's APIs answer it: one outcome of a call made on every scheduler replica.

The HTTP routes (http/rollout.py, SGLang's shapes) and the public gRPC methods (grpc_api.py) both
forward to every replica (SchedulerPool.control, push_weights) and answer with this summary: a
success only when every replica succeeded, each replica's reply kept.
"""

from flatwire_wire.control import ControlReply
from flatwire_wire.public import ControlResponse


def control_response(replies: dict[str, ControlReply]) -> ControlResponse:
    if not replies:
        return ControlResponse(success=False, message="no scheduler replica is known")
    if len(replies) == 1:
        message = next(iter(replies.values())).message
    else:
        message = "; ".join(f"{address}: {reply.message}" for address, reply in sorted(replies.items()))
    return ControlResponse(success=all(reply.success for reply in replies.values()), message=message, replicas=replies)
