"""The load side of `python -m bench.serving`: closed-loop clients in one process.

    python -m bench.serving_client SPEC.json OUT.json

SPEC (written by `bench.serving`): the replicas' endpoints, the model's name, its inputs
(.npz), the kind of client ("ours": the SDK's request building, `edge_client.rpc.tensors`, on
a grpc.aio stub; "triton": `tritonclient.grpc.aio`), one token per client (its class comes
with it), how long to load each endpoint, the phase and when to start (`start_at`, wall
clock, so that the processes of one block start and switch together). With several
endpoints the clients call them in turn, all on one for a phase (`phase_s`) then all on the
next, until each has had `seconds`: the replicas share every stretch of this machine's
noise. A call in flight at a switch is answered where it was sent. Each client has a
connection of its own to each endpoint, as a device has.

OUT receives, per endpoint and client, the latency of each answered request (ms) and its
failures by status, and the seconds each endpoint was loaded. A process of its own:
tritonclient's generated `inference.*` protobuf symbols collide with ours in one process,
so the triton kind never imports our protos.
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


async def _ours(
    spec: dict[str, Any], endpoint: str, feeds: dict[str, np.ndarray], token: str
) -> Call:
    import grpc

    from edge_client.rpc.tensors import infer_request
    from protos.inference import grpc_service_pb2 as pb

    channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
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


async def _triton(
    spec: dict[str, Any], endpoint: str, feeds: dict[str, np.ndarray], token: str
) -> Call:
    import tritonclient.grpc.aio as triton
    from tritonclient.utils import np_to_triton_dtype

    client = triton.InferenceServerClient(endpoint, channel_args=CHANNEL_OPTIONS)
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
    calls: Sequence[Call],
    start: float,
    phase_s: float,
    end: float,
    samples: Sequence[list[float]],
    failures: Sequence[dict[str, int]],
) -> None:
    """Call `calls[k]` while phase k (of `phase_s`, from `start`, wall clock, in turn) lasts,
    until `end`; each answer's latency into `samples[k]`, each failure into `failures[k]`."""
    clock = time.perf_counter
    while (now := time.time()) < end:
        target = int((now - start) // phase_s) % len(calls)
        sent = clock()
        try:
            await calls[target]()
        except Exception as err:  # counted by kind: the report says what failed
            code = getattr(err, "code", None)
            name = code().name if callable(code) else type(err).__name__
            failures[target][name] = failures[target].get(name, 0) + 1
            continue
        samples[target].append((clock() - sent) * 1000)


def phases(seconds: float, phase_s: float, endpoints: int) -> tuple[float, int]:
    """The phase length and how many phases there are in all: each endpoint has `seconds` in
    whole phases of about `phase_s` (one endpoint: a single phase)."""
    if endpoints == 1:
        return seconds, 1
    each = max(1, round(seconds / phase_s))
    return seconds / each, each * endpoints


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    with np.load(spec["inputs"], allow_pickle=False) as archive:
        feeds = {name: archive[name] for name in archive.files}
    make = _ours if spec["kind"] == "ours" else _triton
    endpoints = spec["endpoints"]
    calls = [
        [await make(spec, endpoint, feeds, token) for endpoint in endpoints]
        for token in spec["tokens"]
    ]
    # Every connection up and warm.
    await asyncio.gather(*(call() for client in calls for call in client))
    phase_s, count = phases(spec["seconds"], spec["phase_s"], len(endpoints))
    start = spec["start_at"]
    end = start + phase_s * count + spec.get("outlast_s", 0.0)
    await asyncio.sleep(max(0.0, start - time.time()))
    samples: list[list[list[float]]] = [[[] for _ in endpoints] for _ in calls]
    failures: list[list[dict[str, int]]] = [[{} for _ in endpoints] for _ in calls]
    await asyncio.gather(
        *(
            _client(c, start, phase_s, end, s, f)
            for c, s, f in zip(calls, samples, failures, strict=True)
        )
    )
    took = time.time() - start  # to the last answer, past `end` (wall clock, as the phases)
    return {
        "seconds": [took / len(endpoints)] * len(endpoints),
        "latencies_ms": [[client[k] for client in samples] for k in range(len(endpoints))],
        "failures": [[client[k] for client in failures] for k in range(len(endpoints))],
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
