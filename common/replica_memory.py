"""What a replica's memory asks can be held to: the GPU memory a model needs, estimated from
its ONNX file, and the words both services use to refuse a replica that cannot run as asked.

ONNX Runtime's CUDA provider takes everything a session allocates on its GPU from one arena
(BFC), which `gpu_mem_limit`, the replica's share (`gpu_memory_mib`), caps: the initializers
are copied into it when the session is created, and every run takes its intermediate
tensors and its kernels' scratch buffers from it. `estimate` reads the file and returns

    weights + the largest step's tensors at one row + MARGIN_MIB

- weights: the bytes of every initializer (sparse ones: values and indices), of every
  `Constant` node's value, and of those in subgraphs (If, Loop, Scan);
- the largest step's tensors: for each node, the inputs that are not weights plus its
  outputs, which are alive together while it runs, shaped by ONNX shape inference with each
  dynamic dimension taken as 1; a tensor of unknown shape or type counts nothing;
- `MARGIN_MIB` for the kernels' scratch buffers and the arena's rounding.

It is a floor, not a fit: the CUDA provider's convolution workspaces, larger batches (the
runtime's `--max-batch-size auto` times batches of up to 64 rows at load) and the arena's
fragmentation can need more. A share below the floor cannot work and is refused before any
replica starts (`share_too_small`); a share above it that still runs out fails at load, and
the node turns ONNX Runtime's arena error into the same refusal with what the arena held
when it ran out (`arena_ran_out`, `share_ran_out`). The margin is not measured on a GPU: it
errs low, so that a share that could work is never refused before it is tried.

Messages that refuse a replica's spec start with one of `REFUSALS`: the node answers them
FAILED_PRECONDITION, and the broker tells them from a replica that failed by itself by that
start (both sides import it from here).

Blocking: `estimate` parses the whole model (memory about its size, in onnx's C++ code) and
runs shape inference on it; callers on an event loop run it through `asyncio.to_thread`.
Results are cached per file (path, size and modification time), so a model deployed again
is not parsed again.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import helper

MIB = 1024 * 1024
MARGIN_MIB = 16
"""Added to the weights and the largest step: the kernels' scratch buffers (cuBLAS and cuDNN
workspaces taken from the arena) and its rounding. Not measured on a GPU; see the module
docstring."""

SHARE_TOO_SMALL = "GPU memory share too small"
"""How a refusal of a share below the model's need begins."""
MEMORY_LIMIT_UNAVAILABLE = "memory limit cannot be enforced"
"""How a node's refusal of a `memory_mib` its runtime cannot enforce begins."""
REFUSALS = (SHARE_TOO_SMALL, MEMORY_LIMIT_UNAVAILABLE)
"""The starts of a node's FAILED_PRECONDITION messages that refuse the replica's spec: the
same spec fails alike however often it is tried."""

_ARENA_RAN_OUT = re.compile(r"Available memory of (\d+) is smaller than requested bytes of (\d+)")
"""ONNX Runtime's BFC arena (bfc_arena.cc, `BFCArena::Extend`) when an allocation would take
it past its limit."""


@dataclass(frozen=True, slots=True)
class ModelMemory:
    """The GPU memory a model needs, estimated from its file (see the module docstring)."""

    weights_bytes: int
    activations_bytes: int
    """The largest step's inputs and outputs at one row; 0 when shape inference failed."""

    @property
    def need_mib(self) -> int:
        """The estimated need in MiB: weights, largest step and margin, rounded up."""
        return math.ceil((self.weights_bytes + self.activations_bytes) / MIB) + MARGIN_MIB

    def explain(self) -> str:
        """What the need is made of, for a message."""
        return (
            f"weights {_mib(self.weights_bytes)} MiB, its largest step's tensors "
            f"{_mib(self.activations_bytes)} MiB at one row, {MARGIN_MIB} MiB for ONNX Runtime's "
            "scratch buffers; estimated from its file"
        )


def _mib(n: int) -> str:
    return f"{n / MIB:.0f}" if n >= MIB else f"{n / MIB:.2f}"


def estimate(path: Path) -> ModelMemory:
    """The GPU memory the ONNX model at `path` needs (see the module docstring). Blocking;
    cached per (path, size, modification time). OSError when the file cannot be read;
    ValueError when it is not an ONNX model."""
    stat = path.stat()
    return _estimate(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _estimate(path: str, _size: int, _mtime_ns: int) -> ModelMemory:
    try:
        model = onnx.load(path, load_external_data=False)
    except DecodeError as err:
        raise ValueError(f"not an ONNX model: {err}") from err
    weights = sum(_tensor_bytes(t) for t in _weights(model.graph))
    return ModelMemory(weights, _largest_step(model))


def _weights(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "Constant" and attribute.HasField("t"):
                yield attribute.t
            if attribute.HasField("g"):
                yield from _weights(attribute.g)
            for subgraph in attribute.graphs:
                yield from _weights(subgraph)


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    return math.prod(tensor.dims) * _itemsize(tensor.data_type)


def _itemsize(elem_type: int) -> int:
    """Bytes per element of an ONNX tensor type; 0 for strings and unknown types."""
    try:
        dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    except (KeyError, ValueError):
        return 0
    return 0 if dtype.kind in "OSU" else dtype.itemsize


def _value_bytes(value: onnx.ValueInfoProto) -> int:
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not tensor.HasField("shape"):
        return 0
    # A dynamic dimension (named, or unknown) at one row; a known one as it is.
    rows = math.prod(d.dim_value if d.HasField("dim_value") else 1 for d in tensor.shape.dim)
    return rows * _itemsize(tensor.elem_type)


def _largest_step(model: onnx.ModelProto) -> int:
    """The most bytes any one node's non-weight inputs and outputs take together; 0 when
    shape inference cannot run on the model."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, ValueError, RuntimeError):
        return 0
    graph = inferred.graph
    weights = {t.name for t in graph.initializer}
    sizes = {v.name: _value_bytes(v) for v in (*graph.input, *graph.value_info, *graph.output)}
    return max(
        (
            sum(sizes.get(name, 0) for name in node.input if name and name not in weights)
            + sum(sizes.get(name, 0) for name in node.output if name)
            for node in graph.node
        ),
        default=0,
    )


def share_too_small(share_mib: int, model_name: str, memory: ModelMemory) -> str | None:
    """The refusal of a `share_mib` below `memory`'s need, naming both; None when it is not
    below."""
    if share_mib >= memory.need_mib:
        return None
    return (
        f"{SHARE_TOO_SMALL}: gpu_memory_mib {share_mib} asked, but model {model_name!r} needs "
        f"at least {memory.need_mib} MiB of GPU memory ({memory.explain()}); ask for at least "
        f"{memory.need_mib}"
    )


def arena_ran_out(text: str) -> tuple[int, int] | None:
    """(bytes the arena had left, bytes it was asked for) when `text` (a replica's log)
    carries ONNX Runtime's error of an arena that reached its limit; None otherwise."""
    match = _ARENA_RAN_OUT.search(text)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def share_ran_out(
    share_mib: int, model_name: str, ran_out: tuple[int, int], memory: ModelMemory | None
) -> str:
    """The refusal of a share whose arena ran out while the replica loaded: what it held and
    was asked for then is the need measured (a floor: later steps may ask for more)."""
    left, asked = ran_out
    held = max(0, share_mib * MIB - left)
    measured = math.ceil((held + asked) / MIB)
    estimated = "" if memory is None else f"; {memory.need_mib} MiB estimated from its file"
    return (
        f"{SHARE_TOO_SMALL}: gpu_memory_mib {share_mib} asked, but model {model_name!r} needs "
        f"more: ONNX Runtime's arena on its GPU ran out while the replica loaded and warmed up, "
        f"holding {_mib(held)} MiB when it asked for {_mib(asked)} MiB more (at least "
        f"{measured} MiB measured{estimated}); ask for more than {measured}"
    )
