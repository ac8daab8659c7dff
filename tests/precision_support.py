"""A model whose FP16 copy loses its answers, for the `--precision fp16` tests."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper


def build_scaler(path: Path) -> Path:
    """`y` = x * 100,000 for `x` FP32 [N, 8] (a unit conversion, say): past FP16's largest
    value (65,504), so the converter clips the weight, and FP16 arithmetic would overflow."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "factor"], ["y"])],
        "scaler",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        initializer=[helper.make_tensor("factor", TensorProto.FLOAT, [], [100_000.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path
