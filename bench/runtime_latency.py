"""ModelInfer latency through a replica, against in-process ONNX Runtime and a raw gRPC echo.

For each test model, in one run and on the same input:
  - ort:     session.run in this process (the floor: the model's own cost);
  - echo:    a grpc.aio echo server in another process, sending the request's bytes and
             receiving the response's (the floor of moving the payload over loopback gRPC);
  - docker:  ModelInfer through the runtime container (port published on 127.0.0.1, so
             through Docker's proxy);
  - docker-host: the same container on the host's network (no proxy);
  - process: ModelInfer through the same runtime as a plain subprocess (no Docker proxy).
Contenders are timed in alternating blocks, so machine noise falls on all of them alike.
Overhead = replica p50 - ort p50; the target (issue 2) is overhead <= echo p50 + 0.3 ms for
the CNN input (1x3x224x224 FP32, 602 KB). Requests are sent one at a time.

    python -m bench.runtime_latency [--quick] [--models resnet18 mlp] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnxruntime as ort

import modelzoo
from bench import echo_server
from bench.loopback import loopback_server
from bench.timing import channel_to, percentiles, timed
from edge_client.rpc.tensors import infer_request
from images.build import ImageBuildError, build_image
from node_daemon.runtimes import DockerRuntime, ProcessRuntime, ReplicaSpec, RuntimeUnavailable
from protos.inference import grpc_service_pb2_grpc as pb_grpc

TOKEN = "bench-token"
TARGET_EXTRA_MS = 0.3
ROUNDS = 5
RUNTIMES = ("docker", "docker-host", "process")


@contextlib.asynccontextmanager
async def echo_endpoint() -> AsyncIterator[str]:
    async with loopback_server(echo_server.__name__) as (address, _):
        yield address


async def bench_model(
    name: str, runtimes: dict[str, DockerRuntime | ProcessRuntime], echo: str, n: int
) -> dict[str, object]:
    """Start one replica per runtime, then time every contender in alternating blocks
    (ort, echo, each replica; ROUNDS times) so that machine noise falls on all alike."""
    model = modelzoo.model_path(name)
    inputs = modelzoo.sample_inputs(model)
    request = infer_request(name, inputs)
    request_bytes = request.SerializeToString()
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])

    async def run_ort() -> object:  # blocks the loop on purpose: nothing else runs meanwhile
        return session.run(None, inputs)

    calls: dict[str, Callable[[], Awaitable[object]]] = {"ort": run_ort}
    figures: dict[str, object] = {"model": name, "request_bytes": len(request_bytes)}
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    async with contextlib.AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        np.savez(tmp / "warmup.npz", **cast(dict[str, Any], inputs))
        response_bytes = 0
        for kind, runtime in runtimes.items():
            spec = ReplicaSpec(f"bench-{name}-{kind}", model, name, TOKEN, {"node": "bench"},
                               warmup_inputs=tmp / "warmup.npz")  # fmt: skip
            replica = await runtime.start(spec)
            stack.push_async_callback(runtime.stop, replica.replica_id, 5)
            channel = await stack.enter_async_context(channel_to(replica.endpoint))
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            calls[kind] = functools.partial(stub.ModelInfer, request, metadata=metadata)
            response = await stub.ModelInfer(request, metadata=metadata)
            response_bytes = response.ByteSize()
        figures["response_bytes"] = response_bytes
        echo_channel = await stack.enter_async_context(channel_to(echo))
        payload = response_bytes.to_bytes(8, "little") + request_bytes[8:]
        calls["echo"] = functools.partial(echo_channel.unary_unary(echo_server.METHOD), payload)
        samples: dict[str, list[float]] = {kind: [] for kind in calls}
        per_block = max(1, n // ROUNDS)
        for _ in range(ROUNDS):
            for kind, call in calls.items():
                samples[kind] += await timed(call, warmup=3, n=per_block)
    for kind, values in samples.items():
        figures[kind] = percentiles(values)
    return figures


def verdicts(figures: dict) -> dict[str, dict[str, float | bool]]:
    ort_p50, echo_p50 = figures["ort"]["p50"], figures["echo"]["p50"]
    out = {}
    for kind in RUNTIMES:
        if kind in figures:
            overhead = figures[kind]["p50"] - ort_p50
            out[kind] = {
                "overhead_p50_ms": overhead,
                "budget_ms": echo_p50 + TARGET_EXTRA_MS,
                "within": overhead <= echo_p50 + TARGET_EXTRA_MS,
            }
    return out


def _cell(figures: dict, kind: str) -> str:
    f = figures.get(kind)
    return "-" if f is None else f"{f['p50']:.2f}/{f['p99']:.2f}"


def print_table(results: list[dict]) -> None:
    kinds = ["ort", "echo", *(k for k in RUNTIMES if any(k in r for r in results))]
    print(f"{'model':<12} {'req KB':>7} " + " ".join(f"{k + ' p50/p99':>18}" for k in kinds))
    for r in results:
        cells = " ".join(f"{_cell(r, k):>18}" for k in kinds)
        print(f"{r['model']:<12} {r['request_bytes'] / 1000:>7.0f} {cells}")
    print(
        "\noverhead = replica p50 - ort p50; budget = echo p50 + 0.3 ms (the target for the CNN)"
    )
    for r in results:
        for kind, v in r["verdict"].items():
            print(
                f"{r['model']:<12} {kind:<12} overhead {v['overhead_p50_ms']:+6.2f} ms  "
                f"budget {v['budget_ms']:5.2f} ms  {'within' if v['within'] else 'OVER'}"
            )
    print("times in ms")


async def run(args: argparse.Namespace) -> list[dict]:
    runtimes: dict[str, DockerRuntime | ProcessRuntime] = {}
    docker_kinds = {"docker": "bridge", "docker-host": "host"}
    if docker_kinds.keys() & set(args.runtime):
        try:
            image = build_image("cpu", progress=lambda line: print(line, file=sys.stderr))
            for kind, network in docker_kinds.items():
                if kind in args.runtime:
                    runtimes[kind] = DockerRuntime.connect(image, network)
        except (ImageBuildError, RuntimeUnavailable) as err:
            print(f"docker runtimes skipped: {err}", file=sys.stderr)
    if "process" in args.runtime:
        runtimes["process"] = ProcessRuntime()
    results = []
    try:
        async with echo_endpoint() as echo:
            for name in args.models:
                print(f"benchmarking {name} ({args.iterations} requests each) ...",
                      file=sys.stderr)  # fmt: skip
                figures = await bench_model(name, runtimes, echo, args.iterations)
                figures["verdict"] = verdicts(figures)
                results.append(figures)
    finally:
        for runtime in runtimes.values():
            await runtime.close()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests (CI smoke run)")
    parser.add_argument("--iterations", type=int, help="requests per measurement")
    parser.add_argument(
        "--models", nargs="+", default=list(modelzoo.BUILT), choices=modelzoo.ALL, metavar="MODEL"
    )
    parser.add_argument("--runtime", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.iterations is None:
        args.iterations = 50 if args.quick else 500
    if args.iterations < 10:
        parser.error("--iterations must be at least 10")
    results = asyncio.run(run(args))
    print_table(results)
    machine = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "cpus": os.cpu_count(),
    }
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
