"""ModelInfer without parsing a request shape seen before: the runtime's fast path.

A client sends the same request again and again with only its tensors' bytes changed: the
same model, input names, datatypes and shapes, the same outputs asked for. In the Open
Inference Protocol's wire format those bytes are the `raw_input_contents` entries (field
7), which protobuf writes after every other field, so the rest of the message, the
*header*, is the same bytes each time. `split_request` cuts a serialized ModelInferRequest
into its header and its raw entries without parsing either. A `Plan`, made by the full path
from a request it parsed and checked, turns the raw entries of a request with the same
header into the session's feeds, and the outputs into the serialized response, which is
the same bytes the full path would send.

The fast path answers only requests the full path would answer alike: the header decides
everything the full path checks except the raw entries' count and lengths, which the plan
checks. A request whose header has no plan, whose layout is unusual (a field after the raw
entries, a wire type ModelInferRequest never uses, a truncated field), or whose raw
entries do not fit the plan takes the full path, which says what is wrong with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from protos.inference import grpc_service_pb2 as pb
from runtime.rpc import convert

RAW_INPUT_FIELD = 7
"""`ModelInferRequest.raw_input_contents`."""
RAW_OUTPUT_TAG = bytes([6 << 3 | 2])
"""`ModelInferResponse.raw_output_contents`, length-delimited."""
LENGTH_DELIMITED = 2
MAX_HEADER_BYTES = 4096
"""Longer headers (a large parameters map, long names) are not kept as plans."""
MAX_PLANS = 64
"""Plans kept per server; a header seen once the cache is full takes the full path."""


def split_request(raw: bytes) -> tuple[bytes, list[memoryview]] | None:
    """The header (every field before the first raw input entry) and the raw input entries
    of a serialized ModelInferRequest, the entries as views of `raw` (no copy); None when it
    has no raw entries or is not laid out as protobuf writes it."""
    view = memoryview(raw)
    size = len(raw)
    position = 0
    header_end = -1
    entries: list[memoryview] = []
    while position < size:
        start = position
        tag, position = _varint(raw, position)
        if tag & 7 != LENGTH_DELIMITED:  # every field of ModelInferRequest is
            return None
        length, position = _varint(raw, position)
        end = position + length
        if end > size or position < 0:
            return None
        if tag >> 3 == RAW_INPUT_FIELD:
            if header_end < 0:
                header_end = start
            entries.append(view[position:end])
        elif header_end >= 0:
            return None
        position = end
    if header_end < 0 or header_end > MAX_HEADER_BYTES:
        return None
    return raw[:header_end], entries


def _varint(data: bytes, position: int) -> tuple[int, int]:
    """The varint at `position` and the position after it; (0, -1) when it runs past the
    end or past 64 bits."""
    value = 0
    shift = 0
    size = len(data)
    while position < size and shift < 64:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
    return 0, -1


@dataclass(frozen=True)
class _Input:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int


class Plan:
    """How to answer requests with one header: made from the feeds the full path built for
    one of them and the outputs it computed."""

    def __init__(
        self,
        request: pb.ModelInferRequest,
        feeds: Mapping[str, np.ndarray],
        names: Sequence[str],
        arrays: Sequence[np.ndarray],
    ) -> None:
        """`feeds` in the order of the request's inputs (as the full path builds them)."""
        self._inputs = tuple(
            _Input(name, array.dtype, array.shape, array.nbytes) for name, array in feeds.items()
        )
        self.names = tuple(names)
        self._model_name = request.model_name
        self._id = request.id
        self._outputs = self._output_key(arrays)
        self._header = convert.response_header(
            self._model_name, self._id, self.names, arrays
        ).SerializeToString()

    def feeds(self, entries: Sequence[memoryview]) -> dict[str, np.ndarray] | None:
        """The session's feeds from a request's raw entries; None when they do not fit."""
        if len(entries) != len(self._inputs):
            return None
        feeds = {}
        for spec, entry in zip(self._inputs, entries, strict=True):
            if len(entry) != spec.nbytes:
                return None
            array = np.ndarray(spec.shape, spec.dtype, entry)  # a view: no copy
            # Where the entry starts in the message decides its alignment; ONNX Runtime is
            # given aligned data, as from a parsed message's own bytes.
            feeds[spec.name] = array if array.flags.aligned else array.copy()
        return feeds

    def response(self, arrays: Sequence[np.ndarray]) -> bytes:
        """The serialized ModelInferResponse for these outputs."""
        if self._output_key(arrays) != self._outputs:  # a data-dependent output shape
            return convert.infer_response(
                self._model_name, self._id, self.names, arrays
            ).SerializeToString()
        parts = [self._header]
        for array in arrays:
            data = convert.raw_bytes(array)
            parts += (RAW_OUTPUT_TAG, encode_varint(len(data)), data)
        return b"".join(parts)

    @staticmethod
    def _output_key(arrays: Sequence[np.ndarray]) -> tuple[tuple[np.dtype, tuple[int, ...]], ...]:
        return tuple((a.dtype, a.shape) for a in arrays)


def encode_varint(value: int) -> bytes:
    """`value` (non-negative) as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class Plans:
    """The plans of one server, by header; at most `capacity`, kept until the server stops
    (one model per server: a header's plan never goes stale)."""

    def __init__(self, capacity: int = MAX_PLANS) -> None:
        self._plans: dict[bytes, Plan] = {}
        self._capacity = capacity

    def get(self, header: bytes) -> Plan | None:
        return self._plans.get(header)

    @property
    def full(self) -> bool:
        """No room for another plan: the caller need not make one."""
        return len(self._plans) >= self._capacity

    def add(self, header: bytes, plan: Plan) -> None:
        if not self.full:
            self._plans[header] = plan
