"""A model's tensors as the Open Inference Protocol describes them: plain data over numpy.

Apart from `runtime.model` so that the device SDK (`edge_client`) reads a replica's
metadata and checks a local model against it without importing ONNX Runtime: a device
installs it only for local inference (`pip install 'edge-offload[local]'`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """An input or output of the model, as the Open Inference Protocol describes it."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    """-1 marks a dynamic dimension."""
    dim_names: tuple[str | None, ...]
    """The symbolic name of each dynamic dimension (None for fixed or unnamed ones)."""

    def describe(self) -> str:
        return f"{self.name} ({self.datatype} {list(self.shape)})"


@dataclass(frozen=True, slots=True)
class RequestTensor:
    """One input as a request carries it: raw little-endian bytes or typed values."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes | None = None
    values: np.ndarray | None = None
    """Flat array of typed contents, in the dtype of the protocol field that carried them."""
