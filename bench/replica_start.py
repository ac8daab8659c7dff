"""Time from StartReplica to the first successful inference, per model and runtime.

A node daemon runs in this process (real gRPC on loopback, a topology-file inventory); the
model is in its cache and the image is built, so what is timed is the replica's own start:
container or process start, model load, warm-up, readiness, and one ModelInfer. Median and
max of several starts each.

    python -m bench.replica_start [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np

import modelzoo
from common.content import file_sha256
from edge_client.rpc.tensors import infer_request
from images.build import ImageBuildError, build_image
from node_daemon.inventory import GpuSpec
from node_daemon.runtimes import RuntimeUnavailable
from node_daemon.server import NodeSettings, start_node
from protos.inference import grpc_service_pb2_grpc as infer_grpc
from protos.offload.v1 import node_pb2 as pb
from protos.offload.v1 import node_pb2_grpc as pb_grpc
from tests.data import TOPOLOGIES

CAPTURE = TOPOLOGIES / "21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt"
TOKEN = "bench-replica-start-token"


async def time_starts(runtime: str, models: Sequence[str], repeats: int, tmp: Path) -> list[dict]:
    settings = NodeSettings(
        listen="127.0.0.1:0",
        site="bench",
        node_id=f"bench-{runtime}",
        state_dir=tmp / runtime,
        topology_file=CAPTURE,
        gpu_spec=GpuSpec("Tesla V100-SXM2-16GB", 16384),
        runtime=runtime,
    )
    server, port, agent = await start_node(settings)
    rows = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            for name in models:
                path = modelzoo.model_path(name)
                sha = await asyncio.to_thread(file_sha256, path)
                await asyncio.to_thread(agent.cache.put_file, path)
                inputs = modelzoo.sample_inputs(path)
                warmup_sha = ""
                if name == "silero_vad":  # zeros cannot warm it up
                    npz = tmp / f"{name}.npz"
                    np.savez(npz, **cast(dict[str, Any], inputs))
                    warmup_sha = (await asyncio.to_thread(agent.cache.put_file, npz)).sha256
                request = infer_request(name, inputs)
                samples = []
                for attempt in range(repeats):
                    spec = pb.ReplicaSpec(
                        deployment_id=f"bench-{name.replace('_', '-')}", epoch=attempt,
                        model_sha256=sha, model_name=name, token=TOKEN, gpu_count=1,
                        warmup_inputs_sha256=warmup_sha,
                    )  # fmt: skip
                    started = time.perf_counter()
                    reply = await stub.StartReplica(pb.StartReplicaRequest(spec=spec))
                    ready = time.perf_counter()
                    async with grpc.aio.insecure_channel(reply.replica.endpoint) as data:
                        await infer_grpc.GRPCInferenceServiceStub(data).ModelInfer(
                            request, metadata=(("authorization", f"Bearer {TOKEN}"),)
                        )
                    first = time.perf_counter()
                    samples.append((ready - started, first - started))
                    await stub.StopReplica(
                        pb.StopReplicaRequest(replica_id=reply.replica.replica_id, grace_ms=1000)
                    )
                ready_s = [s[0] for s in samples]
                first_s = [s[1] for s in samples]
                rows.append(
                    {
                        "runtime": runtime,
                        "model": name,
                        "n": repeats,
                        "ready_median_s": statistics.median(ready_s),
                        "first_inference_median_s": statistics.median(first_s),
                        "first_inference_max_s": max(first_s),
                    }
                )
                print(
                    f"{runtime:<8} {name:<12} first inference median "
                    f"{rows[-1]['first_inference_median_s']:.2f}s",
                    file=sys.stderr,
                )
    finally:
        await server.stop(1)
        await agent.close(stop_replicas=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer starts, fewer models")
    parser.add_argument("--runtime", nargs="+", default=["docker", "process"],
                        choices=["docker", "process"])  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 7
    models = ["mlp", "resnet18"] if args.quick else list(modelzoo.ALL)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for runtime in args.runtime:
            if runtime == "docker":
                try:
                    build_image("cpu", progress=lambda line: print(line, file=sys.stderr))
                except ImageBuildError as err:
                    print(f"docker skipped: {err}", file=sys.stderr)
                    continue
            try:
                rows += asyncio.run(time_starts(runtime, models, repeats, Path(tmp)))
            except RuntimeUnavailable as err:
                print(f"{runtime} skipped: {err}", file=sys.stderr)
    print(f"{'runtime':<8} {'model':<12} {'n':>2} {'ready (median)':>15} "
          f"{'first inference (median / max)':>31}")  # fmt: skip
    for r in rows:
        print(
            f"{r['runtime']:<8} {r['model']:<12} {r['n']:>2} {r['ready_median_s']:>14.2f}s "
            f"{r['first_inference_median_s']:>21.2f}s / {r['first_inference_max_s']:.2f}s"
        )
    if args.json:
        args.json.write_text(json.dumps({"results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
