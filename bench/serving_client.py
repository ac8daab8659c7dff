"""The load side of `python -m bench.serving`: closed-loop clients in one process.

    python -m bench.serving_client SPEC.json OUT.json

SPEC (written by `bench.serving`): the replica's endpoint, the model's name, its inputs
(.npz), the kind of client ("ours": the SDK's request building, `edge_client.rpc.tensors`, on
a grpc.aio stub; "triton": `tritonclient.grpc.aio`), one token per client (its class comes
with it), how long to run and when to start (`start_at`, wall clock, so that the processes of
one block start together). Each client has a connection of its own, as a device has.

OUT receives, per client, the latency of each answered request (ms) and its failures by
status. A process of its own: tritonclient's generated `inference.*` protobuf symbols
collide with ours in one process, so the triton kind never imports our protos.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

Call = Callable[[], Awaitable[object]]
CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),  # a connection per client, as each device has
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


async def _ours(spec: dict[str, Any], feeds: dict[str, np.ndarray], token: str) -> Call:
    import grpc

    from edge_client.rpc.tensors import infer_request
    from protos.inference import grpc_service_pb2 as pb

    channel = grpc.aio.insecure_channel(spec["endpoint"], options=CHANNEL_OPTIONS)
    method = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )
    request = infer_request(spec["model"], feeds)
    metadata = (("authorization", f"Bearer {token}"),)
    timeout = spec["timeout_s"]

    async def call() -> object:
        return await method(request, metadata=metadata, timeout=timeout)

    return call


async def _triton(spec: dict[str, Any], feeds: dict[str, np.ndarray], token: str) -> Call:
    import tritonclient.grpc.aio as triton
    from tritonclient.utils import np_to_triton_dtype

    client = triton.InferenceServerClient(spec["endpoint"], channel_args=CHANNEL_OPTIONS)
    inputs = []
    for name, array in feeds.items():
        tensor = triton.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    headers = {"authorization": f"Bearer {token}"}
    timeout = int(spec["timeout_s"])

    async def call() -> object:
        return await client.infer(spec["model"], inputs, headers=headers, client_timeout=timeout)

    return call


async def _client(
    call: Call, deadline: float, samples: list[float], failures: dict[str, int]
) -> None:
    clock = time.perf_counter
    while clock() < deadline:
        sent = clock()
        try:
            await call()
        except Exception as err:  # counted by kind: the report says what failed
            code = getattr(err, "code", None)
            name = code().name if callable(code) else type(err).__name__
            failures[name] = failures.get(name, 0) + 1
            continue
        samples.append((clock() - sent) * 1000)


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    with np.load(spec["inputs"], allow_pickle=False) as archive:
        feeds = {name: archive[name] for name in archive.files}
    make = _ours if spec["kind"] == "ours" else _triton
    calls = [await make(spec, feeds, token) for token in spec["tokens"]]
    await asyncio.gather(*(call() for call in calls))  # every connection up and warm
    await asyncio.sleep(max(0.0, spec["start_at"] - time.time()))
    deadline = time.perf_counter() + spec["seconds"]
    samples: list[list[float]] = [[] for _ in calls]
    failures: list[dict[str, int]] = [{} for _ in calls]
    started = time.perf_counter()
    await asyncio.gather(
        *(_client(c, deadline, s, f) for c, s, f in zip(calls, samples, failures, strict=True))
    )
    return {
        "seconds": time.perf_counter() - started,
        "latencies_ms": samples,
        "failures": failures,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m bench.serving_client SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    import uvloop  # the runtime's loop: the clients' own overhead as low as ours

    result = uvloop.run(run(spec))
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
