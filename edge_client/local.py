"""The device's own copy of a model: an ONNX Runtime session on the CPU, checked exactly as
the replica checks a request (it is `runtime.model.OnnxModel`, the replica's own class).

Loading and running are blocking: the client calls them through `asyncio.to_thread`.
ONNX Runtime is imported by `LocalModel.load` only: a device without local inference does
not install it (`pip install 'edge-offload[local]'` does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edge_client.errors import InvalidInput, ServerError
from runtime import errors as runtime_errors
from runtime.datatypes import datatype_from_numpy
from runtime.tensors import RequestTensor, TensorSpec

if TYPE_CHECKING:
    from runtime.model import OnnxModel

logger = logging.getLogger(__name__)


class LocalModel:
    """An ONNX model run in this process. Thread-safe (ONNX Runtime sessions are)."""

    def __init__(self, model: OnnxModel, path: Path) -> None:
        self.path = path
        self._model = model

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._model.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._model.outputs

    @classmethod
    def load(cls, path: Path, threads: int = 0) -> LocalModel:
        """Load `path` on the CPU and warm it up: one inference on zeros, as a replica does
        (`OnnxModel.warm_up`), so the first request's figure is not ONNX Runtime's lazy
        set-up, which `fastest` would read as a slow device. A model zeros do not suit loads
        all the same (logged); its first request pays that set-up. Blocking.
        `threads`: ONNX Runtime's intra-op threads; 0: the CPUs this process may use
        (`usable_cpus`: a container's CPU limit, not the host's core count ONNX Runtime
        would count). InvalidInput when the file is missing or is not a model ONNX Runtime
        can run, or when ONNX Runtime is not installed (the message says how to install it)."""
        if not path.is_file():
            raise InvalidInput(f"local model {path}: no such file")
        try:
            from runtime.model import OnnxModel
        except ModuleNotFoundError as err:
            if err.name is None or err.name.partition(".")[0] != "onnxruntime":
                raise
            raise InvalidInput(
                f"local model {path}: local inference needs ONNX Runtime: "
                "pip install 'edge-offload[local]'"
            ) from err
        threads = threads or usable_cpus()
        try:
            model = OnnxModel.load(path, path.stem, device="cpu", intra_op_threads=threads)
        except runtime_errors.ModelLoadError as err:
            raise InvalidInput(f"local model {path} cannot be loaded: {err}") from err
        try:
            model.warm_up(timed_runs=0)
        except runtime_errors.ModelLoadError as err:
            logger.info(
                "local model %s not warmed up on zeros (its first request pays the set-up): %s",
                path.name,
                err,
            )
        return cls(model, path)

    def run(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] = ()
    ) -> dict[str, np.ndarray]:
        """The outputs by name (`outputs` empty: all). Blocking. InvalidInput for inputs the
        model refuses (the replica's own checks and messages); ServerError when ONNX Runtime
        fails on inputs it accepted."""
        try:
            tensors = [
                RequestTensor(
                    name,
                    datatype_from_numpy(array.dtype),
                    array.shape,
                    raw=np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes(),
                )
                for name, array in inputs.items()
            ]
        except ValueError as err:
            raise InvalidInput(f"inputs cannot be encoded: {err}") from err
        try:
            feeds = self._model.prepare(tensors)
            names = self._model.output_names(outputs)
            arrays = self._model.run(feeds, names)
        except runtime_errors.InvalidInput as err:
            raise InvalidInput(f"local model {self.path.name}: {err}") from err
        except runtime_errors.InferenceFailed as err:
            raise ServerError(f"local model {self.path.name}: {err}") from err
        return dict(zip(names, arrays, strict=True))

    def check_stands_in_for(
        self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], what: str
    ) -> None:
        """InvalidInput unless this model takes the same inputs as `what` (names, datatypes,
        shapes: a fixed dimension must match a fixed one) and gives each of its outputs
        (name and datatype), so a request and its answer read the same on either side."""
        problems = [
            *_differences("input", self.inputs, inputs, exact_names=True),
            *_differences("output", self.outputs, outputs, exact_names=False),
        ]
        if problems:
            raise InvalidInput(
                f"local model {self.path.name} cannot stand in for {what}: " + "; ".join(problems)
            )


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Whole CPUs this process may use: the cores it may run on, capped by its cgroup's CPU
    quota (cgroup v2 `cpu.max`, as `docker run --cpus` sets it), at least 1.

    ONNX Runtime sizes its thread pool by the cores it sees; in a container limited to a
    quarter of a CPU on a 2-core host that is two threads taking turns at a quarter's quota.
    """
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return max(1, cores)
    if quota == "max":
        return max(1, cores)
    try:
        limit = int(quota) // max(1, int(period))
    except ValueError:
        return max(1, cores)
    return max(1, min(cores, limit))


def _differences(
    kind: str, ours: Sequence[TensorSpec], theirs: Sequence[TensorSpec], exact_names: bool
) -> list[str]:
    mine = {s.name: s for s in ours}
    problems = []
    for spec in theirs:
        local = mine.get(spec.name)
        if local is None:
            problems.append(f"no {kind} {spec.describe()}")
            continue
        if local.datatype != spec.datatype:
            problems.append(f"{kind} {spec.name!r} is {local.datatype}, not {spec.datatype}")
        elif kind == "input" and not _shapes_agree(local.shape, spec.shape):
            problems.append(
                f"{kind} {spec.name!r} has shape {list(local.shape)}, not {list(spec.shape)}"
            )
    if exact_names:
        extra = sorted(set(mine) - {s.name for s in theirs})
        problems.extend(f"{kind} {name!r} is not the deployment's" for name in extra)
    return problems


def _shapes_agree(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) == len(b) and all(x == y or x < 0 or y < 0 for x, y in zip(a, b, strict=True))
