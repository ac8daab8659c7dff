"""Deterministic random inputs for an ONNX model, shaped from the model's own input metadata."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

BATCH = "batch"
"""Placeholder in :attr:`InputHint.shape` for the ``batch`` argument of :func:`random_inputs`."""

DEFAULT_INT_RANGE = (0, 2)
"""Half-open range of integer inputs that have no hint: 0 and 1 are valid ids, flags and masks."""


@dataclass(frozen=True, slots=True)
class InputHint:
    """What a model needs for one input that its metadata alone does not say.

    ``shape`` replaces the declared shape (``BATCH`` entries become the requested batch size);
    ``value_range`` is a half-open ``[low, high)`` range to draw uniformly from (integers for
    integer inputs); ``constant`` fills the whole tensor with one value and wins over the range.
    """

    name: str
    shape: tuple[int | str, ...] | None = None
    value_range: tuple[float, float] | None = None
    constant: float | None = None


def random_inputs(
    path: Path, hints: Iterable[InputHint] = (), seed: int = 0, batch: int = 1
) -> dict[str, np.ndarray]:
    """Return one array per graph input of the model at ``path``, keyed by input name.

    The dtype is the declared element type. Without a hint, each dimension is its fixed size if
    it has one; otherwise the first dimension is ``batch`` and any other is 1. Floats without a
    hint are standard normal; integers are drawn from ``DEFAULT_INT_RANGE``; booleans are fair
    coin flips. The same (model, hints, seed, batch) always gives the same arrays.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    by_name = {hint.name: hint for hint in hints}
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for value in graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        hint = by_name.get(value.name, InputHint(value.name))
        if hint.shape is not None:
            shape = tuple(batch if dim == BATCH else int(dim) for dim in hint.shape)
        else:
            shape = tuple(
                dim.dim_value if dim.HasField("dim_value") else (batch if axis == 0 else 1)
                for axis, dim in enumerate(tensor_type.shape.dim)
            )
        arrays[value.name] = _draw(rng, dtype, shape, hint)
    return arrays


def _draw(
    rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...], hint: InputHint
) -> np.ndarray:
    if hint.constant is not None:
        return np.full(shape, hint.constant, dtype=dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        low, high = hint.value_range or DEFAULT_INT_RANGE
        return rng.integers(int(low), int(high), size=shape).astype(dtype)
    if hint.value_range is not None:
        low, high = hint.value_range
        return rng.uniform(low, high, size=shape).astype(dtype)
    return rng.standard_normal(size=shape).astype(dtype)
