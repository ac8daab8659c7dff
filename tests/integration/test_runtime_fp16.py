"""`python -m runtime.server --precision fp16` as a process over gRPC: it serves the FP16 copy
(made by `python -m modelzoo.fp16`, the real converter) with answers within the bound of the
FP32 model's, its deviation in the log; a copy past the bound keeps the replica from
starting (exit 1, the reason logged)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort

import modelzoo
from edge_client.rpc.tensors import infer_request, response_arrays
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from runtime.precision import FP16_MAX_DEVIATION
from tests.precision_support import build_scaler
from tests.runtime_support import AUTH, REPO_ROOT, TOKEN, spawn_runtime


def convert(source: Path, target: Path) -> Path:
    """The FP16 copy, made as an operator makes it."""
    subprocess.run(
        [sys.executable, "-m", "modelzoo.fp16", str(source), str(target)],
        check=True,
        cwd=REPO_ROOT,
        capture_output=True,
    )
    return target


async def test_an_fp16_replica_answers_within_the_bound_of_fp32(tmp_path: Path) -> None:
    source = modelzoo.model_path("mlp")
    copy = await asyncio.to_thread(convert, source, tmp_path / "mlp.fp16.onnx")
    process, endpoint = await spawn_runtime(
        tmp_path, source, "--precision", "fp16", "--fp16-model", str(copy)
    )
    try:
        inputs = modelzoo.sample_inputs(source, seed=3, batch=4)
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            response = await stub.ModelInfer(
                infer_request(source.stem, inputs), metadata=AUTH, timeout=30
            )
    finally:
        process.terminate()
        await process.wait()
    reference = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    names = [o.name for o in reference.get_outputs()]
    got = response_arrays(response)
    for name, want in zip(names, reference.run(names, inputs), strict=True):
        scale = float(np.max(np.abs(want)))
        assert got[name].dtype == want.dtype
        assert float(np.max(np.abs(got[name] - want))) <= FP16_MAX_DEVIATION * scale
    log = (tmp_path / "runtime.log").read_text()
    assert "fp16 on CPUExecutionProvider against fp32 on CPUExecutionProvider" in log
    assert "ready provider=CPUExecutionProvider precision fp16" in log


async def test_a_copy_past_the_bound_keeps_the_replica_from_starting(tmp_path: Path) -> None:
    source = build_scaler(tmp_path / "scaler.onnx")
    copy = await asyncio.to_thread(convert, source, tmp_path / "scaler.fp16.onnx")
    token = tmp_path / "token"
    token.write_text(TOKEN)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "runtime.server", "--model", str(source), "--token-file",
        str(token), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
        "--precision", "fp16", "--fp16-model", str(copy),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=REPO_ROOT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), 60)
    log = output.decode()
    assert process.returncode == 1, log
    assert "--precision fp16 refused: the FP16 copy deviates from the FP32 model" in log
    assert "ready provider=" not in log
