"""One ONNX model in one ONNX Runtime session: its metadata, input checks, and inference.

Plain Python over onnxruntime and numpy; nothing here knows about gRPC. `OnnxModel.run` and
`OnnxModel.load` block (they run the session): call them from a worker thread.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from runtime.datatypes import NUMPY_DTYPES, datatype_from_numpy, datatype_from_ort
from runtime.errors import InferenceFailed, InvalidInput, ModelLoadError, quote
from runtime.tensors import RequestTensor, TensorSpec

logger = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
DEVICES = ("auto", "cpu", "cuda", "tensorrt")
ON_GPU = (CUDA, TENSORRT)
"""The providers that compute on the GPU, with their inputs in device memory."""
MAX_BOUND_BUFFERS = 64
"""Device input buffers one session keeps with IO binding (one per input and batch shape)."""


def _spec(arg: ort.NodeArg) -> TensorSpec:
    dims = tuple(arg.shape or ())
    return TensorSpec(
        name=arg.name,
        datatype=datatype_from_ort(arg.type),
        shape=tuple(d if isinstance(d, int) and d >= 0 else -1 for d in dims),
        dim_names=tuple(d if isinstance(d, str) else None for d in dims),
    )


def _gpu_visible() -> bool:
    # The NVIDIA container runtime (or a bare-metal driver) exposes /dev/nvidia<N> per GPU.
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def choose_providers(device: str, gpu_mem_limit_mib: int = 0) -> list[str | tuple[str, dict]]:
    """The execution providers for `device` ("auto", "cpu", "cuda" or "tensorrt"), best
    first.

    "auto" takes CUDA when this onnxruntime build has it and a GPU is visible, else the CPU
    (never TensorRT: its engines take long to build at load, and its libraries are in no
    image of ours). "cuda" and "tensorrt" insist: ModelLoadError, naming the providers this
    onnxruntime has, when it lacks the one asked for. "tensorrt" falls back to CUDA, then
    the CPU, for the nodes TensorRT cannot run (ONNX Runtime splits the graph).
    """
    if device not in DEVICES:
        raise ModelLoadError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
    available = ort.get_available_providers()
    cuda_built = CUDA in available
    if device == "cpu" or (device == "auto" and not (cuda_built and _gpu_visible())):
        return [CPU]
    if device == "tensorrt" and TENSORRT not in available:
        raise ModelLoadError(
            "device 'tensorrt' asked for, but this onnxruntime has no TensorRT execution "
            f"provider; it has {', '.join(available)} (install onnxruntime-gpu and TensorRT's "
            "libraries, or use --device cuda)"
        )
    if not cuda_built:
        raise ModelLoadError(
            f"device {device!r} asked for, but this onnxruntime has no CUDA execution provider; "
            f"it has {', '.join(available)} (install onnxruntime-gpu, or use the runtime "
            "image's cuda variant)"
        )
    options: dict[str, int] = {"device_id": 0}
    if gpu_mem_limit_mib > 0:
        options["gpu_mem_limit"] = gpu_mem_limit_mib * 1024 * 1024
    if device == "tensorrt":
        trt_options: dict[str, int] = {"device_id": 0}
        if gpu_mem_limit_mib > 0:
            # TensorRT's scratch space while it builds and runs its engines, out of the
            # share (its default is 1 GiB): half, the rest for the engines and CUDA's arena.
            trt_options["trt_max_workspace_size"] = gpu_mem_limit_mib * 1024 * 1024 // 2
        return [(TENSORRT, trt_options), (CUDA, options), CPU]
    return [(CUDA, options), CPU]


class OnnxModel:
    """A loaded model. Thread-safe: ONNX Runtime sessions may run concurrently."""

    def __init__(self, session: ort.InferenceSession, name: str) -> None:
        self.name = name
        self._session = session
        self.inputs = tuple(_spec(a) for a in session.get_inputs())
        self.outputs = tuple(_spec(a) for a in session.get_outputs())
        self._inputs_by_name = {s.name: s for s in self.inputs}
        self._shared_dims = _shared_dims(self.inputs)
        """(dimension name, [(input, axis), ...]) for each symbolic dimension that more
        than one input axis carries: the only ones `prepare` must compare."""
        self._output_names = tuple(s.name for s in self.outputs)
        self.provider: str = session.get_providers()[0]
        self.intra_op_threads: int = session.get_session_options().intra_op_num_threads
        self._binding: ort.IOBinding | None = None
        """Set by `bind_io`: runs go through it."""
        self._device_inputs: dict[tuple[str, tuple[int, ...], str], ort.OrtValue] = {}
        """ONNX Runtime's threads per inference (`load` always sets it)."""

    @classmethod
    def load(
        cls,
        path: Path,
        name: str,
        device: str = "auto",
        gpu_mem_limit_mib: int = 0,
        intra_op_threads: int = 0,
    ) -> OnnxModel:
        """Load `path` into a session. Blocking. ModelLoadError when it cannot be loaded.

        ONNX Runtime's intra-op threads do not spin while they wait for work: spinning made
        each idle thread burn a core between requests (the MLP's replica used 850 µs of CPU
        per 20 µs inference on 2 cores, 370 µs without spinning, in an ad-hoc A/B: docs/
        BENCHMARKS.md, "Our runtime beside KServe's ModelServer"), which a node with several
        replicas and its clients pay in latency.

        `intra_op_threads` 0 means one per CPU this process may run on (its affinity: a
        node's `--cpuset`, a container's cpuset), always set explicitly. Left to choose,
        ONNX Runtime starts one per physical core of the machine and pins each to its core,
        outside the CPUs the process was given: a process replica of a node pinned to CPU 0
        computed on CPU 1 too, beside the other node's work. The quota is not counted: the
        node's resource manager changes it while the replica runs.
        """
        providers = choose_providers(device, gpu_mem_limit_mib)
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads or len(os.sched_getaffinity(0))
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        try:
            session = ort.InferenceSession(str(path), options, providers=providers)
        except (ort_state.Fail, ort_state.InvalidGraph, ort_state.InvalidProtobuf) as err:
            raise ModelLoadError(f"cannot load {path} as an ONNX model: {err}") from err
        except ort_state.NoSuchFile as err:
            raise ModelLoadError(f"model file {path} does not exist") from err
        model = cls(session, name)
        wanted = providers[0] if isinstance(providers[0], str) else providers[0][0]
        if device == "cuda" and model.provider != CUDA:
            raise ModelLoadError(
                "device 'cuda' asked for, but ONNX Runtime could not start its CUDA provider "
                "(see the log above: driver, CUDA or cuDNN libraries missing?)"
            )
        if device == "tensorrt" and model.provider != TENSORRT:
            raise ModelLoadError(
                "device 'tensorrt' asked for, but ONNX Runtime could not start its TensorRT "
                f"provider and fell back to {model.provider} (see the log above: TensorRT's "
                "libraries, libnvinfer, missing?); use --device cuda to run on CUDA"
            )
        if model.provider != wanted:
            logger.warning("model=%s wanted %s, fell back to %s", name, wanted, model.provider)
        logger.info(
            "model=%s loaded from %s provider=%s inputs=%s outputs=%s",
            name,
            path,
            model.provider,
            ", ".join(s.describe() for s in model.inputs),
            ", ".join(s.describe() for s in model.outputs),
        )
        return model

    def prepare(self, tensors: Sequence[RequestTensor]) -> dict[str, np.ndarray]:
        """Check each tensor against the model's inputs and return the session's feeds.

        InvalidInput names the input and what was expected: unknown, duplicate or missing
        names, wrong datatype, wrong shape (dynamic dimensions take any size, but a symbolic
        dimension shared by several inputs must agree), wrong byte length or value count.
        """
        feeds: dict[str, np.ndarray] = {}
        for tensor in tensors:
            spec = self._inputs_by_name.get(tensor.name)
            if spec is None:
                raise InvalidInput(
                    f"unknown input {quote(tensor.name)}; the model's inputs are "
                    f"{self._describe(self.inputs)}"
                )
            if tensor.name in feeds:
                raise InvalidInput(f"input {quote(tensor.name)} is given more than once")
            feeds[tensor.name] = _to_array(tensor, spec)
        if len(feeds) != len(self.inputs):
            missing = [s.describe() for s in self.inputs if s.name not in feeds]
            raise InvalidInput(f"missing input(s): {', '.join(missing)}")
        if self._shared_dims:
            self._check_shared_dims(feeds)
        return feeds

    def output_names(self, requested: Sequence[str]) -> tuple[str, ...]:
        """The outputs to compute: the requested ones in order, or all when none is asked."""
        if not requested:
            return self._output_names
        for name in requested:
            if name not in self._output_names:
                raise InvalidInput(
                    f"unknown output {quote(name)}; the model's outputs are "
                    f"{self._describe(self.outputs)}"
                )
        if len(set(requested)) != len(requested):
            raise InvalidInput("an output is requested more than once")
        return tuple(requested)

    def bind_io(self) -> bool:
        """From now on run through IO binding with device input buffers kept per shape and
        refilled in place (`_run_bound`), when the session runs on the GPU (CUDA or
        TensorRT); whether it does. After this, `run` must have one caller at a time (a
        batcher's instance)."""
        if self.provider not in ON_GPU:
            return False
        self._binding = self._session.io_binding()
        return True

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> list[np.ndarray]:
        """Run the session. Blocking. InvalidInput when ONNX Runtime rejects the feeds."""
        try:
            if self._binding is not None:
                return self._run_bound(self._binding, feeds, outputs)
            return self._session.run(outputs, feeds)
        except ort_state.InvalidArgument as err:
            raise InvalidInput(f"ONNX Runtime rejected the inputs: {err}") from err
        except (ort_state.Fail, ort_state.RuntimeException) as err:
            raise InferenceFailed(f"inference failed: {err}") from err

    def _run_bound(
        self, binding: ort.IOBinding, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]
    ) -> list[np.ndarray]:
        """One run with IO binding: each input is copied into a device buffer kept for its
        name, shape and dtype (at most `MAX_BOUND_BUFFERS`, then forgotten and made anew);
        the outputs come from ONNX Runtime's device arena and are copied back."""
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        for name, array in feeds.items():
            contiguous = np.ascontiguousarray(array)
            key = (name, contiguous.shape, contiguous.dtype.str)
            buffer = self._device_inputs.get(key)
            if buffer is None:
                if len(self._device_inputs) >= MAX_BOUND_BUFFERS:
                    self._device_inputs.clear()
                buffer = ort.OrtValue.ortvalue_from_numpy(contiguous, "cuda", 0)
                self._device_inputs[key] = buffer
            else:
                buffer.update_inplace(contiguous)
            binding.bind_ortvalue_input(name, buffer)
        for name in outputs:
            binding.bind_output(name, "cuda", 0)
        self._session.run_with_iobinding(binding)
        return list(binding.copy_outputs_to_cpu())

    def warm_up(
        self,
        inputs: Mapping[str, np.ndarray] | None = None,
        timed_runs: int = 5,
        budget_s: float = 0.1,
    ) -> float:
        """One inference, so the first real request does not pay for lazy set-up, then up to
        `timed_runs` more within `budget_s` to measure the model's compute time. Returns the
        median of the timed runs in ms (the first run's time when none fit the budget).

        `inputs` (every input of the model, checked like a request's) when given; otherwise
        zeros with each dynamic dimension 1 for the first axis (batch) and 64 elsewhere.
        ModelLoadError when the inputs are wrong or the inference fails.
        """
        feeds = self.warmup_feeds(inputs)
        try:
            times = [_timed(self._session, feeds)]
        except (ort_state.InvalidArgument, ort_state.Fail, ort_state.RuntimeException) as err:
            given = ", ".join(f"{k}={list(v.shape)}" for k, v in feeds.items())
            raise ModelLoadError(
                f"warm-up inference failed with inputs {given}: {err}. Give inputs this "
                "model accepts with --warmup-inputs FILE.npz"
            ) from err
        deadline = time.monotonic() + budget_s
        timed: list[float] = []
        while len(timed) < timed_runs and time.monotonic() < deadline:
            timed.append(_timed(self._session, feeds))
        return statistics.median(timed or times) * 1000

    def warmup_feeds(self, inputs: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """`inputs` checked like a request's, or zeros with each dynamic dimension 1 for the
        first axis (batch) and 64 elsewhere when None. ModelLoadError when they do not fit."""
        if inputs is None:
            return {s.name: _zeros(s) for s in self.inputs}
        tensors = [
            RequestTensor(name, datatype_from_numpy(a.dtype), a.shape, raw=a.tobytes())
            for name, a in inputs.items()
        ]
        try:
            return self.prepare(tensors)
        except InvalidInput as err:
            raise ModelLoadError(f"warm-up inputs do not fit the model: {err}") from err

    def why_not_batched(self, feeds: Mapping[str, np.ndarray]) -> str | None:
        """Why requests to this model cannot be merged on their first axis; None when they
        can. Blocking: runs the session.

        They can when every input and output has a dynamic first dimension (one symbolic
        name across the inputs, where they name it) and a two-row batch of `feeds` (its
        second row changed, for floating-point inputs) gives, in its first row, what `feeds`
        alone give. A model that mixes rows fails that check; one whose rows only interact
        for some values passes it, which is why a batch whose outputs do not have its rows
        is still run request by request (`runtime.batching`)."""
        for spec in (*self.inputs, *self.outputs):
            if not spec.shape or spec.shape[0] != -1:
                return f"{spec.describe()} has no dynamic first (batch) dimension"
        names = {s.dim_names[0] for s in self.inputs if s.dim_names[0] is not None}
        if len(names) > 1:
            return f"the inputs name their first dimensions differently ({sorted(names)})"
        if any(a.shape[0] != 1 for a in feeds.values()):
            return "the warm-up inputs are not of one row"
        alone = self.run(feeds, self._output_names)
        pair = {
            name: np.concatenate([a, a * 0.5 if a.dtype.kind == "f" else a])
            for name, a in feeds.items()
        }
        try:
            together = self.run(pair, self._output_names)
        except (InvalidInput, InferenceFailed) as err:
            return f"a two-row batch failed: {err}"
        for spec, one, two in zip(self.outputs, alone, together, strict=True):
            if two.ndim == 0 or two.shape[0] != 2:
                return f"output {spec.name!r} of a two-row batch has shape {list(two.shape)}"
            alike = (
                np.array_equal(two[:1], one) if one.dtype.kind in "OSUb" else _close(two[:1], one)
            )
            if not alike:
                return f"output {spec.name!r}: a row's result depends on the other rows"
        return None

    def time_batches(
        self, feeds: Mapping[str, np.ndarray], sizes: Sequence[int], budget_s: float
    ) -> dict[int, float]:
        """Seconds one run of `feeds` repeated to each of `sizes` rows takes (the quicker of
        two runs after an untimed one), in order, until a size's run alone or all of them
        together pass `budget_s`. Blocking. `feeds` are of one row."""
        times: dict[int, float] = {}
        spent = 0.0
        for size in sizes:
            batch = {name: np.repeat(a, size, axis=0) for name, a in feeds.items()}
            started = time.perf_counter()
            self.run(batch, self._output_names)
            taken = [_timed(self._session, batch) for _ in range(2)]
            times[size] = min(taken)
            spent += time.perf_counter() - started
            if times[size] > budget_s / 4 or spent > budget_s:
                break
        return times

    def _check_shared_dims(self, feeds: Mapping[str, np.ndarray]) -> None:
        for dim_name, places in self._shared_dims:
            first_name, first_axis = places[0]
            first = feeds[first_name].shape[first_axis]
            for name, axis in places[1:]:
                size = feeds[name].shape[axis]
                if size != first:
                    raise InvalidInput(
                        f"inputs {first_name!r} and {name!r} disagree on dimension "
                        f"{dim_name!r}: {first} and {size}; it must be the same size"
                    )

    @staticmethod
    def _describe(specs: Sequence[TensorSpec]) -> str:
        return ", ".join(s.describe() for s in specs)


def time_in_turn(
    models: Sequence[OnnxModel],
    inputs: Mapping[str, np.ndarray] | None = None,
    budget_s: float = 0.2,
    most_rounds: int = 200,
) -> list[float]:
    """The median compute time in ms of each of `models` (warmed up) on the same inputs
    (`OnnxModel.warm_up`'s), timed in turn, one run of each a round, for rounds until
    `budget_s` or `most_rounds` (at least one): a drift of this machine's speed or a burst of
    another process's work falls on each alike. Blocking. ValueError without models."""
    if not models:
        raise ValueError("no models to time")
    feeds = [model.warmup_feeds(inputs) for model in models]
    times: list[list[float]] = [[] for _ in models]
    deadline = time.monotonic() + budget_s
    for _ in range(most_rounds):
        for model, model_feeds, taken in zip(models, feeds, times, strict=True):
            taken.append(_timed(model._session, model_feeds))
        if time.monotonic() >= deadline:
            break
    return [statistics.median(taken) * 1000 for taken in times]


def _close(batched: np.ndarray, alone: np.ndarray) -> bool:
    """Whether a row computed in a batch is the row computed alone, up to what a device's
    arithmetic may change with the batch's shape and far below what another row's values
    would (a model that mixes rows moves them by their own order of magnitude): within 5% of
    the output's largest magnitude. On an H200 the former 1e-3/1e-5 tolerance refused
    ResNet-18 (the size of the difference was not logged; TF32 convolutions chosen per shape
    are the likely cause)."""
    scale = float(np.max(np.abs(alone))) if alone.size else 0.0
    return bool(np.allclose(batched, alone, rtol=0.05, atol=0.05 * scale + 1e-6, equal_nan=True))


def _shared_dims(inputs: Sequence[TensorSpec]) -> tuple[tuple[str, list[tuple[str, int]]], ...]:
    places: dict[str, list[tuple[str, int]]] = {}
    for spec in inputs:
        for axis, dim_name in enumerate(spec.dim_names):
            if dim_name is not None:
                places.setdefault(dim_name, []).append((spec.name, axis))
    return tuple((name, where) for name, where in places.items() if len(where) > 1)


def _to_array(tensor: RequestTensor, spec: TensorSpec) -> np.ndarray:
    if tensor.datatype != spec.datatype:
        raise InvalidInput(
            f"input {spec.name!r} has datatype {quote(tensor.datatype)}; the model "
            f"expects {spec.datatype}"
        )
    dtype = NUMPY_DTYPES.get(spec.datatype)
    if dtype is None:
        raise InvalidInput(
            f"input {spec.name!r}: {spec.datatype} inputs are not supported by this runtime"
        )
    _check_shape(tensor.shape, spec)
    count = math.prod(tensor.shape)
    if tensor.raw is not None:
        if len(tensor.raw) != count * dtype.itemsize:
            raise InvalidInput(
                f"input {spec.name!r} has {len(tensor.raw)} bytes of raw contents; shape "
                f"{list(tensor.shape)} of {spec.datatype} needs {count * dtype.itemsize}"
            )
        return np.frombuffer(tensor.raw, dtype=dtype).reshape(tensor.shape)
    values = tensor.values if tensor.values is not None else np.empty(0, dtype)
    if values.size != count:
        raise InvalidInput(
            f"input {spec.name!r} has {values.size} values in its typed contents; shape "
            f"{list(tensor.shape)} needs {count}"
        )
    if dtype.kind in "iu" and values.size and values.dtype != dtype:
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise InvalidInput(
                f"input {spec.name!r} has values outside the range of {spec.datatype} "
                f"[{info.min}, {info.max}]"
            )
    return values.astype(dtype, copy=False).reshape(tensor.shape)


def _timed(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]) -> float:
    started = time.perf_counter()
    session.run(None, dict(feeds))
    return time.perf_counter() - started


def _zeros(spec: TensorSpec) -> np.ndarray:
    dtype = NUMPY_DTYPES.get(spec.datatype)
    if dtype is None:
        raise ModelLoadError(
            f"input {spec.describe()} cannot be warmed up with zeros; give --warmup-inputs"
        )
    shape = tuple(d if d >= 0 else (1 if i == 0 else 64) for i, d in enumerate(spec.shape))
    return np.zeros(shape, dtype=dtype)


def _check_shape(shape: tuple[int, ...], spec: TensorSpec) -> None:
    if any(d < 0 for d in shape):
        raise InvalidInput(f"input {spec.name!r} has shape {list(shape)}: negative size")
    if len(shape) != len(spec.shape):
        raise InvalidInput(
            f"input {spec.name!r} has shape {list(shape)} of rank {len(shape)}; {_expects(spec)}"
        )
    for axis, (got, want) in enumerate(zip(shape, spec.shape, strict=True)):
        if want >= 0 and got != want:
            raise InvalidInput(
                f"input {spec.name!r} has size {got} in dimension {axis} "
                f"(shape {list(shape)}); {_expects(spec)}"
            )


def _expects(spec: TensorSpec) -> str:
    return f"the model expects {list(spec.shape)} (-1: any size)"
