"""Import the committed generated code and round-trip every message it defines.

`python -m protos.roundtrip` needs only protobuf and grpcio: CI runs it in throwaway
environments at both ends of the protobuf range pyproject.toml declares (the lowest release
and the newest), besides the test environment in between. It prints the versions it ran
with and exits non-zero on the first message that does not survive serialization.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import grpc
from google.protobuf import __version__ as protobuf_version
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

GENERATED = (
    "protos.inference.grpc_service_pb2",
    "protos.offload.v1.node_pb2",
    "protos.offload.v1.broker_pb2",
)
STUBS = tuple(f"{name}_grpc" for name in GENERATED)

_SAMPLES: dict[int, object] = {
    FieldDescriptor.CPPTYPE_INT32: -7,
    FieldDescriptor.CPPTYPE_INT64: 2**40,
    FieldDescriptor.CPPTYPE_UINT32: 7,
    FieldDescriptor.CPPTYPE_UINT64: 2**40,
    FieldDescriptor.CPPTYPE_DOUBLE: 1.5,
    FieldDescriptor.CPPTYPE_FLOAT: 0.5,
    FieldDescriptor.CPPTYPE_BOOL: True,
}


def _messages(module: ModuleType) -> Iterator[Descriptor]:
    def walk(descriptor: Descriptor) -> Iterator[Descriptor]:
        if descriptor.GetOptions().map_entry:
            return
        yield descriptor
        for nested in descriptor.nested_types:
            yield from walk(nested)

    for descriptor in module.DESCRIPTOR.message_types_by_name.values():
        yield from walk(descriptor)


def populate(message: Message, depth: int = 0) -> None:
    """Set every scalar, repeated and (two levels deep) nested field to a non-default value."""
    for field in message.DESCRIPTOR.fields:
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry or depth >= 2:
                continue
            if _is_repeated(field):
                populate(getattr(message, field.name).add(), depth + 1)
            else:
                populate(getattr(message, field.name), depth + 1)
            continue
        value = _sample(field)
        if _is_repeated(field):
            getattr(message, field.name).append(value)
        elif field.containing_oneof is None or not message.WhichOneof(field.containing_oneof.name):
            setattr(message, field.name, value)


def _is_repeated(field: FieldDescriptor) -> bool:
    # `label` is deprecated in newer releases; `is_repeated` is missing in older ones.
    is_repeated = getattr(field, "is_repeated", None)
    if is_repeated is not None:
        return bool(is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def _sample(field: FieldDescriptor) -> object:
    if field.cpp_type == FieldDescriptor.CPPTYPE_STRING:
        return b"\x00\xffbytes" if field.type == FieldDescriptor.TYPE_BYTES else "text é"
    if field.cpp_type == FieldDescriptor.CPPTYPE_ENUM:
        return field.enum_type.values[-1].number
    return _SAMPLES[field.cpp_type]


def roundtrip_all() -> int:
    """Round-trip every message of every generated module; returns how many were checked."""
    checked = 0
    for name in GENERATED:
        module = importlib.import_module(name)
        for descriptor in _messages(module):
            cls = module.__dict__.get(descriptor.name) or _nested_class(module, descriptor)
            original = cls()
            populate(original)
            parsed = cls.FromString(original.SerializeToString())
            if parsed != original:
                raise AssertionError(f"{descriptor.full_name} does not round-trip")
            checked += 1
    for name in STUBS:
        importlib.import_module(name)
    return checked


def _nested_class(module: ModuleType, descriptor: Descriptor) -> type[Message]:
    path = []
    current: Descriptor | None = descriptor
    while current is not None:
        path.append(current.name)
        current = current.containing_type
    obj: object = module
    for part in reversed(path):
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]


def main() -> int:
    checked = roundtrip_all()
    print(
        f"protobuf {protobuf_version}, grpcio {grpc.__version__}: "
        f"{checked} messages round-trip, {len(STUBS)} service modules import"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
