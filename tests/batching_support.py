"""A model and a stream of mixed requests for the batching tests: good requests of several
shapes and output selections interleaved with bad ones, sent at once, each answer compared
with in-process ONNX Runtime's on that request alone."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from edge_client.rpc.tensors import infer_request, response_arrays
from protos.inference import grpc_service_pb2_grpc as pb_grpc

MIXER_OUTPUTS = ("y", "s", "e")
TABLE_ROWS = 10


def build_mixer(path: Path) -> Path:
    """Inputs `x` FP32 [N, K] and `ids` INT64 [N, 3] (N, K dynamic); outputs `y` = 2x + 1
    [N, K], `s` = the sum of each row of x [N], `e` = rows of a constant table picked by
    `ids` [N, 3, 4]: an id outside [0, 10) fails in ONNX Runtime, not in our checks."""
    table = np.arange(TABLE_ROWS * 4, dtype=np.float32).reshape(TABLE_ROWS, 4)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "two"], ["x2"]),
            helper.make_node("Add", ["x2", "one"], ["y"]),
            helper.make_node("ReduceSum", ["x", "axis1"], ["s"], keepdims=0),
            helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
        ],
        "mixer",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "K"]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 3]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "K"]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, ["N"]),
            helper.make_tensor_value_info("e", TensorProto.FLOAT, ["N", 3, 4]),
        ],
        initializer=[
            helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
            helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
            helper.make_tensor("axis1", TensorProto.INT64, [1], [1]),
            helper.make_tensor("table", TensorProto.FLOAT, table.shape, table.ravel()),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@dataclass(frozen=True)
class MixedRequest:
    """One request of the stream: `bad` names what is wrong with it ("" for a good one)."""

    rows: int
    width: int
    outputs: tuple[str, ...]
    bad: str = ""
    seed: int = 0

    def inputs(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        x = rng.standard_normal((self.rows, self.width)).astype(np.float32)
        ids = rng.integers(0, TABLE_ROWS, (self.rows, 3)).astype(np.int64)
        if self.bad == "id out of range":
            ids[-1, 0] = TABLE_ROWS
        if self.bad == "wrong dtype":
            return {"x": x.astype(np.float64), "ids": ids}
        if self.bad == "wrong rank":
            return {"x": x.reshape(-1), "ids": ids}
        if self.bad == "missing input":
            return {"x": x}
        if self.bad == "rows disagree":
            return {"x": x, "ids": np.concatenate([ids, ids])}
        return {"x": x, "ids": ids}

    def requested(self) -> tuple[str, ...]:
        return ("nope",) if self.bad == "unknown output" else self.outputs


BAD_KINDS = (
    "id out of range",
    "wrong dtype",
    "wrong rank",
    "missing input",
    "unknown output",
    "rows disagree",
)


@dataclass
class Outcome:
    answered: int = 0
    refused: int = 0
    mismatches: list[str] = field(default_factory=list)


async def send_mixed(
    stub: pb_grpc.GRPCInferenceServiceStub,
    model: Path,
    requests: list[MixedRequest],
    metadata: tuple[tuple[str, str], ...],
) -> Outcome:
    """Send every request at once; check each answer against ONNX Runtime on that request
    alone (good ones) or INVALID_ARGUMENT (bad ones)."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    outcome = Outcome()

    async def one(index: int, request: MixedRequest) -> None:
        message = infer_request(model.stem, request.inputs(), request.requested())
        try:
            response = await stub.ModelInfer(message, metadata=metadata, timeout=60)
        except grpc.aio.AioRpcError as err:
            if not request.bad or err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                outcome.mismatches.append(f"#{index} {request}: {err.code().name} {err.details()}")
            outcome.refused += 1
            return
        if request.bad:
            outcome.mismatches.append(f"#{index} {request}: answered although bad")
            return
        got = response_arrays(response)
        names = list(request.outputs or MIXER_OUTPUTS)
        expected = dict(zip(names, session.run(names, request.inputs()), strict=True))
        if list(got) != names:
            outcome.mismatches.append(f"#{index}: outputs {list(got)}, asked {names}")
        for name in names:
            if got[name].shape != expected[name].shape or not np.allclose(
                got[name], expected[name], rtol=1e-5, atol=1e-6
            ):
                outcome.mismatches.append(f"#{index} {request}: output {name} differs")
        outcome.answered += 1

    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return outcome


SPINNER_WIDTH = 64


def build_spinner(path: Path) -> Path:
    """Inputs `x` FP32 [N, 64] and `turns` INT64 [N]; output `y` FP32 [N, 64]: x through
    tanh(x @ W) as many times as the largest of `turns` (an ONNX Loop). A request's compute
    time is what its `turns` ask for: a test holds a batch running, for as long as it
    chooses, with one request of many turns (turns 0 computes nothing: y = x)."""
    weights = np.random.default_rng(0).standard_normal((SPINNER_WIDTH, SPINNER_WIDTH)) * 0.1
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("MatMul", ["v_in", "w"], ["product"]),
            helper.make_node("Tanh", ["product"], ["v_out"]),
        ],
        "spin",
        [
            helper.make_tensor_value_info("iteration", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", TensorProto.FLOAT, ["N", SPINNER_WIDTH]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, ["N", SPINNER_WIDTH]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMax", ["turns"], ["most"], keepdims=0),
            helper.make_node("Loop", ["most", "go", "x"], ["y"], body=body),
        ],
        "spinner",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", SPINNER_WIDTH]),
            helper.make_tensor_value_info("turns", TensorProto.INT64, ["N"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", SPINNER_WIDTH])],
        initializer=[
            helper.make_tensor("go", TensorProto.BOOL, [], [True]),
            helper.make_tensor(
                "w", TensorProto.FLOAT, weights.shape, weights.astype(np.float32).ravel()
            ),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path
