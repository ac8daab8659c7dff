"""SIGTERM during a stream of requests: no accepted request fails, and the process exits 0."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import numpy as np

import modelzoo
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.runtime_process import runtime_process

TOKEN = "drain-test-token"


def infer_request(inputs: dict[str, np.ndarray]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="resnet18")
    for name, array in inputs.items():
        request.inputs.add(name=name, datatype="FP32", shape=array.shape)
        request.raw_input_contents.append(array.tobytes())
    return request


async def test_sigterm_finishes_accepted_requests(tmp_path: Path) -> None:
    model = modelzoo.model_path("resnet18")
    request = infer_request(modelzoo.sample_inputs(model))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with runtime_process(model, token_file, "--grace", "20", name="resnet18") as runtime:
        runtime.wait_for_log(r"model=resnet18 ready")
        results: list[tuple[float, float, grpc.StatusCode, str]] = []
        signalled = asyncio.Event()
        warmed = asyncio.Event()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{runtime.port}")
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def client() -> None:
            failures_after_signal = 0
            while failures_after_signal < 3:
                started = time.monotonic()
                try:
                    await stub.ModelInfer(
                        request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30
                    )
                    results.append((started, time.monotonic(), grpc.StatusCode.OK, ""))
                    if len(results) >= 8:
                        warmed.set()
                except grpc.aio.AioRpcError as err:
                    results.append((started, time.monotonic(), err.code(), err.details()))
                    if signalled.is_set():
                        failures_after_signal += 1
                        await asyncio.sleep(0.05)

        clients = [asyncio.create_task(client(), name=f"client-{i}") for i in range(4)]
        await asyncio.wait_for(warmed.wait(), 60)
        signal_at = time.monotonic()
        runtime.process.send_signal(signal.SIGTERM)
        signalled.set()
        await asyncio.gather(*clients)
        await channel.close()
        exit_code = await asyncio.to_thread(runtime.process.wait, 30)

    assert exit_code == 0, "".join(runtime.log)
    failures = [r for r in results if r[2] != grpc.StatusCode.OK]
    # Not accepted, so allowed to fail: refused while draining (UNAVAILABLE), refused by a
    # closed port (UNAVAILABLE), or sent after the signal and cut by gRPC's own shutdown
    # (CANCELLED, never seen by the handler). An accepted request failing would be anything
    # else, or CANCELLED for a request sent before the signal.
    unexpected = [
        (round(r[0] - signal_at, 3), round(r[1] - signal_at, 3), r[2].name, r[3])
        for r in failures
        if not (
            r[2] == grpc.StatusCode.UNAVAILABLE
            or (r[2] == grpc.StatusCode.CANCELLED and r[0] > signal_at)
        )
    ]
    assert not unexpected, unexpected
    across = [r for r in results if r[2] == grpc.StatusCode.OK and r[0] < signal_at < r[1]]
    assert across, "no request was in flight across the signal; the test proved nothing"
    drained = runtime.wait_for_log(r"drained: (\d+) in flight")
    assert int(drained.group(1)) >= 1
