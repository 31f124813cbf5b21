"""Typed twins of the protobuf messages, and the one converter between the two.

Every message a flatwire process sends or receives has a dataclass twin in this package, named as
its .proto message and with the same fields; the services handle only the twins. `@twin(pb.X, ...)`
declares a dataclass the twin of one or more messages and checks, when the module is imported, that
their fields match name for name (presence, repetition and kind included): a field added to a .proto
without its twin, or the reverse, fails at once rather than being dropped on the way.

How a field is converted follows from its annotation:
- `int`, `float`, `str`, `bool`, `bytes`: as is; `X | None`: a field with presence (proto3
  `optional`, a oneof member, a message), None when unset (a message field annotated without None reads
  as its empty twin when unset);
- an IntEnum: its value, checked (an unknown number is refused as undecodable);
- `list[...]` and `dict[...]`: repeated and map fields, of scalars, enums or twins;
- another twin: the nested message; a type with a codec of its own (`register_codec`: the logprob
  block's bytes) goes through that codec.
"""

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

T = TypeVar("T")
_SCALARS = (int, float, str, bool, bytes)
_CODECS: dict[type, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {}  # type -> (decode, encode)


class WireValueError(ValueError):
    """A message whose content its twin cannot hold (an unknown enum number); the message names the field."""


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    decode: Callable[[Message], Any]  # the protobuf message -> this field's value
    encode: Callable[[Any], Any]  # the value -> what the protobuf constructor takes (None: leave unset)


def register_codec(kind: type, decode: Callable[[Any], Any], encode: Callable[[Any], Any]) -> None:
    """Fields annotated `kind` convert through decode(protobuf value) and encode(value) -> protobuf value."""
    _CODECS[kind] = (decode, encode)


def _optional_of(annotation: Any) -> Any | None:
    """X for `X | None`, else None."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0]
    return None


def _value_codec(kind: Any, where: str,
                 message: Descriptor | None) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """(decode, encode) of one value (not repeated) of type `kind`; `message`: the field's message type, if any."""
    if kind in _CODECS:
        return _CODECS[kind]
    if isinstance(kind, type) and issubclass(kind, enum.IntEnum):
        def decode_enum(number: int, kind=kind) -> Any:
            try:
                return kind(number)
            except ValueError:
                raise WireValueError(f"{where}: unknown {kind.__name__} {number}") from None
        return decode_enum, int
    if isinstance(kind, type) and dataclasses.is_dataclass(kind) and hasattr(kind, "_wire_fields"):
        assert message is not None, f"{where}: a twin for a field that is not a message"
        # As the fields' values: the parent's constructor builds the message of its own field, so that a twin
        # of several messages nests in each of its parents' protos.
        return (lambda value, kind=kind: from_proto(kind, value)), _field_values
    if kind in _SCALARS:
        return (lambda value: value), (lambda value: value)
    raise TypeError(f"{where}: no wire conversion for {kind!r}")


def _field(name: str, annotation: Any, descriptor: FieldDescriptor, owner: str) -> _Field:
    where = f"{owner}.{name}"
    repeated = descriptor.is_repeated
    origin = typing.get_origin(annotation)
    if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
        if origin is not dict:
            raise TypeError(f"{where}: a map field needs a dict annotation, not {annotation!r}")
        decode_value, encode_value = _value_codec(typing.get_args(annotation)[1], where,
                                                  descriptor.message_type.fields_by_name["value"].message_type)
        return _Field(name, lambda m: {k: decode_value(v) for k, v in getattr(m, name).items()},
                      lambda value: {k: encode_value(v) for k, v in value.items()})
    if repeated:
        if origin is not list:
            raise TypeError(f"{where}: a repeated field needs a list annotation, not {annotation!r}")
        (item,) = typing.get_args(annotation)
        decode_item, encode_item = _value_codec(item, where, descriptor.message_type)
        if item in _SCALARS:  # the common case, at C speed
            return _Field(name, lambda m: list(getattr(m, name)), lambda value: value)
        return _Field(name, lambda m: [decode_item(v) for v in getattr(m, name)],
                      lambda value: [encode_item(v) for v in value])
    inner = _optional_of(annotation)
    # A message field always has presence; annotated without None, an unset one reads as its empty twin.
    if (inner is not None) != descriptor.has_presence and (inner is not None or descriptor.message_type is None):
        raise TypeError(f"{where}: annotate {'X | None' if descriptor.has_presence else 'a plain type'} for a "
                        f"field {'with' if descriptor.has_presence else 'without'} presence, not {annotation!r}")
    decode_value, encode_value = _value_codec(inner if inner is not None else annotation, where,
                                              descriptor.message_type)
    if inner is not None:
        return _Field(name, lambda m: decode_value(getattr(m, name)) if m.HasField(name) else None,
                      lambda value: None if value is None else encode_value(value))
    return _Field(name, lambda m: decode_value(getattr(m, name)), encode_value)


def twin(*protos: type[Message]) -> Callable[[type[T]], type[T]]:
    """Class decorator: the dataclass is the twin of each of `protos` (the same fields in each)."""

    def declare(cls: type[T]) -> type[T]:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        for proto in protos:
            descriptor = proto.DESCRIPTOR
            declared = set(descriptor.fields_by_name)
            if set(names) != declared:
                raise TypeError(f"{cls.__name__} is not the twin of {descriptor.full_name}: fields "
                                f"{sorted(declared - set(names))} missing, {sorted(set(names) - declared)} extra")
            fields = [_field(n, hints[n], descriptor.fields_by_name[n], cls.__name__) for n in names]
        cls._wire_fields = fields  # type: ignore[attr-defined]  # the same conversions serve every twin
        cls._wire_proto = protos[0]  # type: ignore[attr-defined]
        return cls

    return declare


def from_proto(cls: type[T], message: Message) -> T:
    """The twin `cls` of a protobuf message."""
    return cls(**{f.name: f.decode(message) for f in cls._wire_fields})  # type: ignore[attr-defined]


def _field_values(value: Any) -> dict[str, Any]:
    """A twin's set fields, encoded: what its message's constructor takes."""
    kwargs = {}
    for f in type(value)._wire_fields:
        encoded = f.encode(getattr(value, f.name))
        if encoded is not None:
            kwargs[f.name] = encoded
    return kwargs


def to_proto(value: Any, proto: type[Message] | None = None) -> Any:
    """The protobuf message of a twin; `proto` chooses among several it twins (default: the first declared)."""
    return (proto or type(value)._wire_proto)(**_field_values(value))


def decoder(cls: type[T], proto: type[Message]) -> Callable[[bytes], T]:
    """bytes -> the twin, for gRPC's request/response deserializers."""
    return _Decoder(cls, proto).decode


def encoder(proto: type[Message]) -> Callable[[Any], bytes]:
    """A twin -> bytes of `proto`, for gRPC's serializers."""
    return lambda value: to_proto(value, proto).SerializeToString()


class _Decoder:
    """A bound method with the message's DESCRIPTOR at hand, so that a refusal can name the message."""

    def __init__(self, cls: type, proto: type[Message]):
        self.cls = cls
        self.proto = proto
        self.DESCRIPTOR = proto.DESCRIPTOR

    def decode(self, data: bytes) -> Any:
        return from_proto(self.cls, self.proto.FromString(data))
