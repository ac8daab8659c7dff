"""Hostile requests for the chaos suite (`bench.chaos`): random field values drawn from a
method's message descriptor, random raw bytes, and strings that are not UTF-8, sent over a
generic channel method with no serializer, so that any service can be fuzzed the same way.

Random values favour what broke validation before (issue 10): NaN, infinities, 1e308, the
extremes of every integer type, unknown enum values, a 100 000-character string, control and
escape characters, path traversal. `Known` mixes real ids of the cluster into the strings so
that calls get past the first lookup.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import grpc
from google.protobuf import descriptor
from google.protobuf.message_factory import GetMessageClass

from runtime.rpc.plans import encode_varint

FD: TypeAlias = descriptor.FieldDescriptor

HUGE = "x" * 100_000
NUMBERS = (math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -1.0, 0.0, 0.5, 2.0, 99999.0)
INTEGERS_64 = (0, 1, -1, 2, 4, 99999, 2**31 - 1, -(2**31), 2**53 + 1, 2**63 - 1, -(2**63))
INTEGERS_32 = (0, 1, -1, 2, 3, 4, 100, 99999, 2**31 - 1, -(2**31))
UNSIGNED = (0, 1, 2, 99999, 2**32 - 1)
STRINGS = ("", "a", HUGE, "\x00\x1b[31mred\x1b[0m\n", "../../../etc/passwd", "é漢字🙂", " a ", "-")
NOT_UTF8 = b"\xff\xfe\xc3("
MAX_MESSAGE_BYTES = 8 * 1024 * 1024 - 1024
"""Longer generated messages are cut to this (into bytes that may not parse): the callers'
channels send at most 8 MiB, and a longer message would be refused by the client's own gRPC
(on a stream as INTERNAL, "Internal error from Core") without reaching the server."""


@dataclass(frozen=True, slots=True)
class Known:
    """Real values by field name (`deployment_id`, `sha256`, `site` ...), picked for a string
    field of that name more often than not."""

    strings: Mapping[str, Sequence[str]] = field(default_factory=dict)


def random_fields(
    message_type: descriptor.Descriptor, rng: random.Random, known: Known, depth: int = 0
) -> dict[str, Any]:
    """Keyword arguments for `message_type`: random values for a random subset of fields."""
    fields: dict[str, Any] = {}
    for f in message_type.fields:
        if rng.random() < 0.4:
            continue
        if f.is_repeated:
            size = rng.choice((0, 1, 2, 1500)) if depth < 2 else rng.choice((0, 1))
            values = [_value(f, rng, known, depth) for _ in range(min(size, 3))]
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                fields[f.name] = {
                    v["key"]: v["value"] for v in values if "key" in v and "value" in v
                }
            else:
                fields[f.name] = (values * (size // max(len(values), 1) + 1))[:size]
        else:
            fields[f.name] = _value(f, rng, known, depth)
    return fields


def _value(f: FD, rng: random.Random, known: Known, depth: int) -> Any:
    kind = f.type
    if kind in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return rng.choice(NUMBERS) if rng.random() < 0.8 else rng.uniform(-1e6, 1e6)
    if kind in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return rng.choice(INTEGERS_64)
    if kind in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32, FD.TYPE_ENUM):
        return rng.choice(INTEGERS_32)
    if kind in (FD.TYPE_UINT32, FD.TYPE_FIXED32, FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return rng.choice(UNSIGNED)
    if kind == FD.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == FD.TYPE_STRING:
        likely = known.strings.get(f.name, ())
        return rng.choice(likely if likely and rng.random() < 0.6 else STRINGS)
    if kind == FD.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 16, 4096)))
    if kind == FD.TYPE_MESSAGE:
        return random_fields(f.message_type, rng, known, depth + 1) if depth < 3 else {}
    raise ValueError(f"no generator for field {f.full_name} of type {kind}")


def _not_utf8(message_type: descriptor.Descriptor, rng: random.Random) -> bytes:
    """One string field of `message_type` holding bytes that are not UTF-8 (the Python API
    cannot build that: it is written by hand, key then length); empty when it has none."""
    strings = [f for f in message_type.fields if f.type == FD.TYPE_STRING]
    if not strings:
        return b""
    number = rng.choice(strings).number
    return encode_varint(number << 3 | 2) + encode_varint(len(NOT_UTF8)) + NOT_UTF8


def random_requests(
    method: descriptor.MethodDescriptor,
    rng: random.Random,
    known: Known,
    field_calls: int,
    byte_calls: int,
) -> list[list[bytes]]:
    """Serialized requests for `method`, one list per call (several messages for a client
    stream): `field_calls` with random fields (a third of them with a string that is not
    UTF-8 appended, which wins over the valid one; each cut to `MAX_MESSAGE_BYTES`), then
    `byte_calls` of random bytes."""
    request_type = GetMessageClass(method.input_type)
    calls: list[list[bytes]] = []
    for number in range(field_calls):
        count = rng.choice((1, 2)) if method.client_streaming else 1
        messages = [
            request_type(**random_fields(method.input_type, rng, known)).SerializeToString()
            for _ in range(count)
        ]
        if number % 3 == 2:
            messages[0] += _not_utf8(method.input_type, rng)
        calls.append([m[:MAX_MESSAGE_BYTES] for m in messages])
    for _ in range(byte_calls):
        calls.append([rng.randbytes(rng.choice((1, 7, 64, 1024)))])
    return calls


async def call_raw(
    channel: grpc.aio.Channel,
    method: descriptor.MethodDescriptor,
    messages: list[bytes],
    metadata: Sequence[tuple[str, str]],
    timeout_s: float,
) -> tuple[grpc.StatusCode, str]:
    """One call of `method` with serialized messages (one, or a client stream): its status
    and details. A server stream is read to its first message (a watch never ends).

    A bidirectional stream (one answer per message) gets each message only after the answer
    to the one before: once the server has ended the stream (refusing a message), a write
    would fail in the client's own gRPC core ("Internal error from Core", INTERNAL) and hide
    the status the server gave."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.client_streaming and method.server_streaming:
            call = channel.stream_stream(path)(metadata=metadata, timeout=timeout_s)
            for message in messages:
                await call.write(message)
                if await call.read() is grpc.aio.EOF:
                    break
            else:
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:
                    pass
            return await call.code(), await call.details() or ""
        if method.client_streaming:
            await channel.stream_unary(path)(iter(messages), metadata=metadata, timeout=timeout_s)
        elif method.server_streaming:
            call = channel.unary_stream(path)(messages[0], metadata=metadata, timeout=timeout_s)
            first = await call.read()
            call.cancel()
            if first is grpc.aio.EOF:
                return await call.code(), await call.details() or ""
        else:
            await channel.unary_unary(path)(messages[0], metadata=metadata, timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""
