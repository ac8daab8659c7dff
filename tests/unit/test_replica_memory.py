"""`common.replica_memory`: a model's GPU memory need estimated from its file (weights of
every kind, the largest step at one row, the margin), the refusal of a share below it, and
the reading of ONNX Runtime's arena error into the same refusal with the need measured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import modelzoo
from common import replica_memory
from common.replica_memory import (
    MARGIN_MIB,
    MIB,
    REFUSALS,
    SHARE_TOO_SMALL,
    ModelMemory,
    arena_ran_out,
    estimate,
    share_ran_out,
    share_too_small,
)

# bfc_arena.cc's message as a replica's log tail carries it (onnxruntime-gpu 1.17 .. 1.23).
ARENA_TAIL = (
    "onnxruntime.capi.onnxruntime_pybind11_state.RuntimeException: [ONNXRuntimeError] : 6 : "
    "RUNTIME_EXCEPTION : Non-zero status code returned while running Conv node. Name:'conv_1' "
    "Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:376 void* "
    "onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*, bool, "
    "onnxruntime::WaitNotificationFn) Available memory of 1048576 is smaller than requested "
    "bytes of 6422528"
)


def matmul_model(path: Path, width: int) -> Path:
    """[N, width] @ a width x width float weight, plus a Constant bias of `width` floats
    and a sparse initializer of 3 float values with 3 int64 indices: weights of every kind
    the estimate counts."""
    weight = numpy_helper.from_array(np.ones((width, width), np.float32), "w")
    bias = helper.make_node(
        "Constant", [], ["b"], value=numpy_helper.from_array(np.zeros(width, np.float32))
    )
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.ones(3, np.float32), "s"),
        numpy_helper.from_array(np.array([0, 1, 2], np.int64), "s_indices"),
        [width],
    )
    graph = helper.make_graph(
        [
            bias,
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["xb"]),
            helper.make_node("Add", ["xb", "s"], ["y"]),
        ],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
        [weight],
        sparse_initializer=[sparse],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_the_need_is_the_weights_the_largest_step_at_one_row_and_the_margin(
    tmp_path: Path,
) -> None:
    width = 1024
    memory = estimate(matmul_model(tmp_path / "matmul.onnx", width))
    # The weight matrix, the Constant bias, the sparse values and their indices.
    assert memory.weights_bytes == width * width * 4 + width * 4 + 3 * 4 + 3 * 8
    # One row: an Add's two activations in and one out (a weight input does not count).
    assert memory.activations_bytes == 3 * width * 4
    assert memory.need_mib == 5 + MARGIN_MIB  # 4 MiB and a bit, rounded up


def test_the_zoos_models_have_their_weights_counted() -> None:
    path = modelzoo.model_path("resnet18")
    memory = estimate(path)
    # Weights are nearly the whole file; its first activation (64x112x112 floats) is 3 MiB.
    assert 0.99 * path.stat().st_size < memory.weights_bytes < path.stat().st_size
    assert memory.activations_bytes >= 64 * 112 * 112 * 4
    assert memory.need_mib > 45 + MARGIN_MIB


def test_a_file_that_is_not_onnx_is_a_value_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\xff\xff\xff\xff\xff")
    with pytest.raises(ValueError, match="not an ONNX model"):
        estimate(bad)


def test_a_share_below_the_need_is_refused_naming_both() -> None:
    memory = ModelMemory(weights_bytes=45 * MIB, activations_bytes=6 * MIB)
    assert memory.need_mib == 51 + MARGIN_MIB
    refusal = share_too_small(64, "resnet18", memory)
    assert refusal is not None and refusal.startswith(SHARE_TOO_SMALL)
    assert refusal.startswith(REFUSALS)
    assert "gpu_memory_mib 64 asked" in refusal
    assert f"needs at least {memory.need_mib} MiB" in refusal
    assert "weights 45 MiB" in refusal
    assert share_too_small(memory.need_mib, "resnet18", memory) is None


def test_the_arena_error_is_read_into_the_need_measured() -> None:
    assert arena_ran_out("exited with code 1\nsome other failure") is None
    ran_out = arena_ran_out(ARENA_TAIL)
    assert ran_out == (1048576, 6422528)
    message = share_ran_out(128, "resnet18", ran_out, ModelMemory(45 * MIB, 6 * MIB))
    # It held 127 MiB of its 128 and asked for 6.125 more: at least 134 MiB.
    assert message.startswith(SHARE_TOO_SMALL)
    assert "gpu_memory_mib 128 asked" in message
    assert "at least 134 MiB measured" in message
    assert f"{51 + MARGIN_MIB} MiB estimated from its file" in message
    assert "BFCArena" not in message and "bfc_arena" not in message


def test_estimates_are_cached_per_file_version(tmp_path: Path) -> None:
    path = matmul_model(tmp_path / "m.onnx", 64)
    first = estimate(path)
    assert estimate(path) is first
    matmul_model(path, 128)  # rewritten: another size, another estimate
    assert estimate(path).weights_bytes > first.weights_bytes
    assert replica_memory._estimate.cache_info().hits >= 1
