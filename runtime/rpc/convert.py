"""Open Inference Protocol messages <-> the runtime's domain values."""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence

import numpy as np

from protos.inference import grpc_service_pb2 as pb
from runtime.datatypes import NUMPY_DTYPES, datatype_from_numpy
from runtime.errors import InvalidInput, quote
from runtime.tensors import RequestTensor, TensorSpec

_LITTLE_ENDIAN = sys.byteorder == "little"

# Which typed-contents field carries each datatype, and the dtype to read it as. FP16 has
# no typed field in the protocol: it travels as raw contents only.
_CONTENTS: dict[str, tuple[str, np.dtype]] = {
    "BOOL": ("bool_contents", np.dtype(np.bool_)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)),
    "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)),
    "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "INT8": ("int_contents", np.dtype(np.int32)),
    "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)),
    "INT64": ("int64_contents", np.dtype(np.int64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)),
    "FP64": ("fp64_contents", np.dtype(np.float64)),
}


def request_tensors(request: pb.ModelInferRequest) -> list[RequestTensor]:
    """The request's inputs as domain values; InvalidInput when the message is inconsistent."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"the request has {len(raw)} raw_input_contents for {len(request.inputs)} inputs; "
            "send one raw entry per input, in the order of inputs"
        )
    tensors = []
    for index, tensor in enumerate(request.inputs):
        shape = tuple(tensor.shape)
        if raw:
            if tensor.HasField("contents"):
                raise InvalidInput(
                    f"input {quote(tensor.name)} has typed contents although the request uses "
                    "raw_input_contents; use one or the other for all inputs"
                )
            tensors.append(RequestTensor(tensor.name, tensor.datatype, shape, raw=raw[index]))
            continue
        field = _CONTENTS.get(tensor.datatype)
        if field is None:
            if tensor.datatype in NUMPY_DTYPES:
                raise InvalidInput(
                    f"input {quote(tensor.name)}: {tensor.datatype} has no typed contents field; "
                    "send it as raw_input_contents"
                )
            raise InvalidInput(
                f"input {quote(tensor.name)} has unknown datatype {quote(tensor.datatype)}; "
                f"use one of {', '.join(NUMPY_DTYPES)}"
            )
        values = np.asarray(getattr(tensor.contents, field[0]), dtype=field[1])
        tensors.append(RequestTensor(tensor.name, tensor.datatype, shape, values=values))
    return tensors


def response_header(
    model_name: str, request_id: str, names: Sequence[str], arrays: Sequence[np.ndarray]
) -> pb.ModelInferResponse:
    """A response naming every output (datatype, shape), in the order of `names`, without
    their contents."""
    response = pb.ModelInferResponse(model_name=model_name, model_version="1", id=request_id)
    for name, array in zip(names, arrays, strict=True):
        response.outputs.add(
            name=name, datatype=datatype_from_numpy(array.dtype), shape=array.shape
        )
    return response


def infer_response(
    model_name: str, request_id: str, names: Sequence[str], arrays: Sequence[np.ndarray]
) -> pb.ModelInferResponse:
    """A response with every output as raw contents, in the order of `names`."""
    response = response_header(model_name, request_id, names, arrays)
    response.raw_output_contents.extend(raw_bytes(array) for array in arrays)
    return response


def raw_bytes(array: np.ndarray) -> bytes:
    """An output's raw contents: little-endian, C order; the protocol's layout for BYTES."""
    if array.dtype.kind in "OSU":
        # The protocol's raw BYTES layout: each element as a 4-byte little-endian length
        # followed by its bytes.
        items = (v if isinstance(v, bytes) else str(v).encode() for v in array.flat)
        return b"".join(struct.pack("<I", len(item)) + item for item in items)
    if array.dtype.isnative and _LITTLE_ENDIAN:
        return array.tobytes()  # C order whatever the array's layout
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def tensor_metadata(
    specs: Sequence[TensorSpec],
) -> list[pb.ModelMetadataResponse.TensorMetadata]:
    return [
        pb.ModelMetadataResponse.TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape)
        for s in specs
    ]
