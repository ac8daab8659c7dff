"""The runtime pins its event loop's thread to one CPU when the model runs inline, and
leaves every other thread, and every other case, where the scheduler puts it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import numpy as np
import pytest

import modelzoo
from edge_client.rpc.tensors import infer_request, response_arrays
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.runtime_support import AUTH, spawn_runtime

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


async def served_threads(
    tmp_path: Path,
    model: Path,
    inputs: dict[str, np.ndarray],
    *flags: str,
    cpus: set[int] | None = None,
) -> tuple[int, dict[int, frozenset[int]], str]:
    """Start the runtime, make one inference, and return its pid, each of its threads with
    the CPUs it may run on, and its log; it is stopped on the way out."""
    process, endpoint = await spawn_runtime(tmp_path, model, *flags, cpus=cpus)
    try:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            response = await stub.ModelInfer(infer_request(model.stem, inputs), metadata=AUTH)
        assert response_arrays(response), "no outputs"
        threads = {
            int(tid): frozenset(os.sched_getaffinity(int(tid)))
            for tid in os.listdir(f"/proc/{process.pid}/task")
        }
    finally:
        process.terminate()
        await process.wait()
    return process.pid, threads, (tmp_path / "runtime.log").read_text()


async def test_an_inline_model_pins_the_loop_thread_alone(
    tmp_path: Path, probe_model: Path, probe_inputs: dict[str, np.ndarray]
) -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    pid, threads, log = await served_threads(tmp_path, probe_model, probe_inputs)
    assert "runs inline on the event loop" in log, log
    (cpu,) = threads[pid]  # the main thread runs the loop
    assert cpu in allowed
    assert f"event loop pinned to CPU {cpu}" in log, log
    others = {cpus for tid, cpus in threads.items() if tid != pid}
    assert others == {allowed}, threads  # gRPC's and ONNX Runtime's threads keep every CPU


@pytest.mark.parametrize(
    "flags",
    [("--pin-event-loop", "never"), ("--inline-below-ms", "0")],
    ids=["never", "worker-threads"],
)
async def test_otherwise_no_thread_is_pinned(
    tmp_path: Path,
    probe_model: Path,
    probe_inputs: dict[str, np.ndarray],
    flags: tuple[str, str],
) -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    _, threads, log = await served_threads(tmp_path, probe_model, probe_inputs, *flags)
    assert set(threads.values()) == {allowed}, threads
    assert "pinned to CPU" not in log, log


async def test_a_model_computing_for_a_millisecond_or_more_is_not_pinned(
    tmp_path: Path,
) -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    model = modelzoo.model_path("resnet18")
    _, threads, log = await served_threads(
        tmp_path, model, modelzoo.sample_inputs(model), "--inline-below-ms", "100000",
        "--max-batch-size", "1",
    )  # fmt: skip
    assert "runs inline on the event loop" in log, log
    assert set(threads.values()) == {allowed}, threads
    assert "event loop not pinned: the model computes in 1 ms or more" in log, log


async def test_a_process_on_one_cpu_says_it_has_nothing_to_pin(
    tmp_path: Path, probe_model: Path, probe_inputs: dict[str, np.ndarray]
) -> None:
    cpu = max(os.sched_getaffinity(0))
    _, threads, log = await served_threads(tmp_path, probe_model, probe_inputs, cpus={cpu})
    assert set(threads.values()) == {frozenset({cpu})}, threads
    assert "event loop not pinned: this process may run on one CPU only" in log, log


async def test_the_batches_threads_keep_every_cpu_when_the_loop_is_pinned(tmp_path: Path) -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    model = modelzoo.model_path("mlp")
    process, endpoint = await spawn_runtime(tmp_path, model)
    try:
        request = infer_request(model.stem, modelzoo.sample_inputs(model))
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            # Calls sent together queue behind one another: batches, in the batch thread.
            await asyncio.gather(*(stub.ModelInfer(request, metadata=AUTH) for _ in range(64)))
        threads = {
            int(tid): frozenset(os.sched_getaffinity(int(tid)))
            for tid in os.listdir(f"/proc/{process.pid}/task")
        }
    finally:
        process.terminate()
        await process.wait()
    log = (tmp_path / "runtime.log").read_text()
    assert "event loop pinned to CPU" in log and "batches: up to" in log, log
    assert len(threads[process.pid]) == 1
    others = {threads[tid] for tid in threads if tid != process.pid}
    assert others == {allowed}, threads
