"""Open Inference Protocol datatype names and their numpy and ONNX Runtime equivalents."""

from __future__ import annotations

import numpy as np

# Open Inference Protocol datatype -> numpy dtype (little-endian, as raw contents are).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}

# ONNX Runtime's type strings (NodeArg.type) -> Open Inference Protocol datatype.
_ORT_TYPES: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def datatype_from_ort(ort_type: str) -> str:
    """The protocol datatype for an ONNX Runtime type string; ValueError if it has none."""
    try:
        return _ORT_TYPES[ort_type]
    except KeyError:
        raise ValueError(f"ONNX type {ort_type} has no Open Inference Protocol datatype") from None


# (kind, itemsize) -> datatype: a dict lookup on every response output.
_BY_KIND_SIZE: dict[tuple[str, int], str] = {
    (d.kind, d.itemsize): name for name, d in reversed(NUMPY_DTYPES.items())
}


def datatype_from_numpy(dtype: np.dtype) -> str:
    """The protocol datatype for a numpy dtype (byte order ignored); ValueError if none."""
    found = _BY_KIND_SIZE.get((dtype.kind, dtype.itemsize))
    if found is not None:
        return found
    for name, candidate in NUMPY_DTYPES.items():
        if candidate.kind == dtype.kind and candidate.itemsize == dtype.itemsize:
            return name
    if dtype.kind in ("U", "S", "O"):
        return "BYTES"
    raise ValueError(f"numpy dtype {dtype} has no Open Inference Protocol datatype")
