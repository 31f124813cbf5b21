"""Twins that the public API (generate.proto) and the internal one (scheduler.proto) share: rollout control for
RL trainers, which the public API takes and the gateway forwards to every scheduler replica, and the messages
without fields. Public and internal messages have the same fields today, so one twin serves both; the twin check
fails the day they differ."""

import enum
from dataclasses import dataclass, field

from flatwire_wire.codec import twin
from flatwire_wire.pb import generate_pb2, scheduler_pb2


class PauseMode(enum.IntEnum):
    UNSPECIFIED = 0  # ABORT, SGLang's default
    ABORT = 1  # abort every running and waiting request, then pause
    IN_PLACE = 2  # keep running requests and their KV cache; no step runs until continue
    RETRACT = 3  # running requests drop their KV and wait; on continue each is prefilled again
    WAIT = 4  # vLLM's: nothing new is admitted while the running requests finish; then paused


class WeightsRelease(enum.IntEnum):
    """What a memory release keeps of the weights for resume (generate.proto says what each does)."""

    UNSPECIFIED = 0  # SGLang's: a host copy on CUDA; on CPU read again from their checkpoint (zeros otherwise)
    OFFLOAD = 1  # vLLM's sleep level 1: resume brings back the weights served before
    DISCARD = 2  # vLLM's sleep level 2: nothing kept; zeros on resume until an update brings every tensor


@twin(scheduler_pb2.SubmitReply, scheduler_pb2.AbortReply, scheduler_pb2.StreamStepsRequest,
      scheduler_pb2.ModelInfoRequest, scheduler_pb2.StatsRequest, generate_pb2.ModelInfoRequest,
      generate_pb2.FlushCacheRequest)
@dataclass
class Empty:
    """The twin of the messages without fields."""


EMPTY = Empty()


@twin(scheduler_pb2.UpdateWeightsFromDiskRequest, generate_pb2.UpdateWeightsFromDiskRequest)
@dataclass
class UpdateWeightsFromDiskRequest:
    model_path: str
    load_format: str = ""  # "", "auto" or "safetensors"
    abort_all_requests: bool = False
    weight_version: str | None = None  # set on success; None: the version stays


@twin(scheduler_pb2.WeightsChunk, generate_pb2.WeightsChunk)
@dataclass
class WeightsChunk:
    safetensors: bytes
    abort_all_requests: bool = False  # read from the first chunk
    weight_version: str | None = None


@twin(scheduler_pb2.PauseGenerationRequest, generate_pb2.PauseGenerationRequest)
@dataclass
class PauseGenerationRequest:
    mode: PauseMode = PauseMode.UNSPECIFIED


@twin(scheduler_pb2.ContinueGenerationRequest, generate_pb2.ContinueGenerationRequest)
@dataclass
class ContinueGenerationRequest:
    pass


@twin(scheduler_pb2.AbortAllRequest, generate_pb2.AbortAllRequest)
@dataclass
class AbortAllRequest:
    pass


@twin(scheduler_pb2.FlushCacheRequest)
@dataclass
class FlushCacheRequest:
    """The scheduler's FlushCache: None is SGLang's flush_cache; a bool, vLLM's reset_prefix_cache (the public
    API's FlushCache is SGLang's, with no field)."""

    reset_running_requests: bool | None = None


SGLANG_FLUSH = FlushCacheRequest()


@twin(scheduler_pb2.UpdateWeightVersionRequest, generate_pb2.UpdateWeightVersionRequest)
@dataclass
class UpdateWeightVersionRequest:
    new_version: str
    abort_all_requests: bool | None = None  # None: true (SGLang's default)


DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
# SGLang's tags of the memory a scheduler releases (sglang/srt/constants.py), in the order a resume takes them back:
# the captured decode graphs, and a draft model's weights, of which none is served here.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph", "weights_drafter")


@twin(scheduler_pb2.InitWeightsUpdateGroupRequest, generate_pb2.InitWeightsUpdateGroupRequest)
@dataclass
class InitWeightsUpdateGroupRequest:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = ""  # "": DEFAULT_GROUP
    backend: str = ""  # nccl or gloo; "": nccl on CUDA, gloo on CPU


@twin(scheduler_pb2.TensorShape, generate_pb2.TensorShape)
@dataclass
class TensorShape:
    dims: list[int] = field(default_factory=list)


@twin(scheduler_pb2.UpdateWeightsFromDistributedRequest, generate_pb2.UpdateWeightsFromDistributedRequest)
@dataclass
class UpdateWeightsFromDistributedRequest:
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)  # torch's names: bfloat16, float32, ...
    shapes: list[TensorShape] = field(default_factory=list)
    group_name: str = ""
    load_format: str = ""  # "" (a broadcast per tensor) or "flattened_bucket" (one of them all)
    abort_all_requests: bool = False
    weight_version: str | None = None


@twin(scheduler_pb2.DestroyWeightsUpdateGroupRequest, generate_pb2.DestroyWeightsUpdateGroupRequest)
@dataclass
class DestroyWeightsUpdateGroupRequest:
    group_name: str = ""


@twin(scheduler_pb2.ReleaseMemoryOccupationRequest, generate_pb2.ReleaseMemoryOccupationRequest)
@dataclass
class ReleaseMemoryOccupationRequest:
    tags: list[str] = field(default_factory=list)  # of MEMORY_TAGS; none: all
    weights: WeightsRelease = WeightsRelease.UNSPECIFIED


@twin(scheduler_pb2.ResumeMemoryOccupationRequest, generate_pb2.ResumeMemoryOccupationRequest)
@dataclass
class ResumeMemoryOccupationRequest:
    tags: list[str] = field(default_factory=list)


# The control calls RL trainers make beyond SGLang's core set: method -> request twin (replies: ControlReply).
RL_CONTROL = {"InitWeightsUpdateGroup": InitWeightsUpdateGroupRequest,
              "UpdateWeightsFromDistributed": UpdateWeightsFromDistributedRequest,
              "DestroyWeightsUpdateGroup": DestroyWeightsUpdateGroupRequest,
              "ReleaseMemoryOccupation": ReleaseMemoryOccupationRequest,
              "ResumeMemoryOccupation": ResumeMemoryOccupationRequest}


@twin(scheduler_pb2.ControlReply, generate_pb2.ReplicaReply)
@dataclass
class ControlReply:
    """What a control call did on one scheduler replica (SGLang's {success, message})."""

    success: bool
    message: str = ""
    num_paused_requests: int = 0  # weight updates: running requests kept paused in place across it
    weight_version: str = ""  # in force after the call
    aborted_requests: int = 0
