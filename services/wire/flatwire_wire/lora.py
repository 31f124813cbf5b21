"""The scheduler's LoRA adapter calls (flatwire/internal/v1/scheduler.proto documents each field): what a gateway's
LoRA routes send every replica, and what a replica answers."""

from dataclasses import dataclass, field

from flatwire_wire.codec import twin
from flatwire_wire.pb import scheduler_pb2


@twin(scheduler_pb2.LoraAdapterInfo)
@dataclass
class LoraAdapterInfo:
    name: str
    path: str = ""  # "": sent as tensors
    pinned: bool = False
    rank: int = 0


@twin(scheduler_pb2.LoadLoraAdapterRequest)
@dataclass
class LoadLoraAdapterRequest:
    lora_name: str
    lora_path: str = ""  # a PEFT directory on the scheduler's machine; "": the tensors below
    safetensors: bytes = b""
    config_json: str = ""
    pinned: bool = False
    replace: bool = False  # vLLM's load_inplace


@twin(scheduler_pb2.UnloadLoraAdapterRequest)
@dataclass
class UnloadLoraAdapterRequest:
    lora_name: str


@twin(scheduler_pb2.LoraAdapterReply)
@dataclass
class LoraAdapterReply:
    success: bool
    message: str = ""
    not_found: bool = False
    loaded: list[LoraAdapterInfo] = field(default_factory=list)
