"""`offload demo`: offload a real model to a replica on this machine and report.

This first version runs one replica (a Docker container when an engine is reachable, else
a local process, and it says which) of the ResNet-18-shaped CNN, sends a steady stream of
inferences over the Open Inference Protocol, checks the answers against in-process ONNX
Runtime, and reports latency percentiles and failures. The broker, the node daemons and
migration join the demo as they land.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import statistics
import sys
import time

import grpc
import numpy as np
import onnxruntime as ort

import modelzoo
from edge_client.rpc.tensors import infer_request, response_arrays
from images.build import ImageBuildError, build_image
from node_daemon.runtimes import (
    DockerRuntime,
    ProcessRuntime,
    ReplicaFailed,
    ReplicaSpec,
    RuntimeUnavailable,
)
from protos.inference import grpc_service_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class _Clock:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)


def _pick_runtime(choice: str, clock: _Clock) -> DockerRuntime | ProcessRuntime:
    if choice in ("auto", "docker"):
        try:
            image = build_image("cpu", progress=lambda line: clock.say(f"  image: {line}"))
            return DockerRuntime.connect(image)
        except (ImageBuildError, RuntimeUnavailable) as err:
            if choice == "docker":
                raise RuntimeUnavailable(str(err)) from err
            clock.say(
                f"Docker is not usable here ({err}).\n"
                "         Running the replica as a local process instead (same server, no "
                "container isolation). `make docker-engine` installs and starts Debian's engine."
            )
    return ProcessRuntime()


async def run_demo(args: argparse.Namespace) -> int:
    clock = _Clock()
    clock.say(f"model: building or loading {args.model!r} from the model zoo")
    model = modelzoo.model_path(args.model)
    inputs = modelzoo.sample_inputs(model, seed=1)
    runtime = await asyncio.to_thread(_pick_runtime, args.runtime, clock)
    clock.say(f"runtime: {runtime.name}")
    token = secrets.token_urlsafe(24)
    spec = ReplicaSpec("demo", model, args.model, token, {"node": "demo"})
    try:
        started = time.monotonic()
        replica = await runtime.start(spec)
        clock.say(
            f"replica ready at {replica.endpoint} in {time.monotonic() - started:.2f}s "
            f"({runtime.name} {replica.ref[:12]})"
        )
        expected = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(
            None, inputs
        )
        latencies, failures = await _stream(replica.endpoint, token, args, inputs, expected, clock)
    finally:
        clock.say("stopping the replica (SIGTERM, drain)")
        await runtime.close()
    ok = len(latencies)
    clock.say("report")
    print(f"  model              {args.model} ({model.stat().st_size / 1e6:.1f} MB)")
    print(f"  runtime            {runtime.name}")
    print(f"  requests           {ok + failures} sent, {ok} ok, {failures} failed")
    if latencies:
        ordered = sorted(latencies)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        print(f"  latency p50 / p99  {statistics.median(ordered):.2f} / {p99:.2f} ms")
    print("  outputs            equal to in-process ONNX Runtime (np.allclose)")
    return 0 if failures == 0 and ok > 0 else 1


async def _stream(
    endpoint: str,
    token: str,
    args: argparse.Namespace,
    inputs: dict[str, np.ndarray],
    expected: list[np.ndarray],
    clock: _Clock,
) -> tuple[list[float], int]:
    request = infer_request(args.model, inputs)
    metadata = (("authorization", f"Bearer {token}"),)
    latencies: list[float] = []
    failures = 0
    clock.say(f"client: sending {args.requests} inferences")
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for index in range(args.requests):
            started = time.perf_counter()
            try:
                response = await stub.ModelInfer(request, metadata=metadata, timeout=30)
            except grpc.aio.AioRpcError as err:
                failures += 1
                clock.say(f"  request {index} failed: {err.code().name} {err.details()}")
                continue
            latencies.append((time.perf_counter() - started) * 1000)
            if index == 0:
                got = list(response_arrays(response).values())
                if not all(
                    np.allclose(g, e, rtol=1e-4, atol=1e-5)
                    for g, e in zip(got, expected, strict=True)
                ):
                    raise AssertionError(
                        "the replica's outputs differ from in-process ONNX Runtime"
                    )
            if (index + 1) % max(1, args.requests // 5) == 0:
                clock.say(f"  {index + 1}/{args.requests} done, last {latencies[-1]:.1f} ms")
    return latencies, failures


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="offload a real model to a replica on this machine and report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a short run (CI)")
    parser.add_argument("--requests", type=int, help="inferences to send (default 200, quick 30)")
    parser.add_argument("--model", default="resnet18", choices=modelzoo.ALL)
    parser.add_argument(
        "--runtime",
        choices=["auto", "docker", "process"],
        default="auto",
        help="auto: Docker when an engine is reachable, else a local process",
    )
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.requests is None:
        args.requests = 30 if args.quick else 200
    if args.requests < 1:
        print("offload demo: --requests must be at least 1", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run_demo(args))
    except (RuntimeUnavailable, ReplicaFailed) as err:
        print(f"offload demo: {err}", file=sys.stderr)
        return 1
