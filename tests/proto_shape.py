"""The wire shape of an Open Inference Protocol file descriptor: names and field numbers.

Imports no generated code, so a subprocess can describe tritonclient's copy with it.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FileDescriptor


def _fields(descriptor: Descriptor, prefix: str = "") -> dict[str, list]:
    name = prefix + descriptor.name
    table = {name: sorted([f.name, f.number, f.type, f.is_repeated] for f in descriptor.fields)}
    for nested in descriptor.nested_types:
        table.update(_fields(nested, name + "."))
    return table


def describe(file: FileDescriptor) -> dict[str, object]:
    messages: dict[str, list] = {}
    for message in file.message_types_by_name.values():
        messages.update(_fields(message))
    service = file.services_by_name["GRPCInferenceService"]
    return {
        "package": file.package,
        "service": service.full_name,
        "methods": {
            m.name: [m.input_type.full_name, m.output_type.full_name] for m in service.methods
        },
        "messages": messages,
    }
