"""The measuring side of `python -m bench.peers`: one client process for every contender.

    python -m bench.peers_client SPEC.json OUT.json

Runs in a process of its own because tritonclient's generated `inference.*` protobuf
symbols collide with ours in one process; so it imports nothing of ours that loads our
protos (`bench.timing` and `bench.echo_server` do not). SPEC (written by `bench.peers`)
names the model, its inputs (.npz), the servers' endpoints and how much to measure; OUT
receives the figures (see `measure`).

Every server is called the same way: `tritonclient.grpc.aio.InferenceServerClient.infer`
with inputs set once by `InferInput.set_data_from_numpy` (raw FP32 contents) and the
deployment's bearer token as a header (servers that need none ignore it). `ort` runs, in
this process, a session with the servers' options (SPEC's "session"), blocking the loop on
purpose (nothing else runs meanwhile); `echo` sends the bytes tritonclient would send for
this request over a raw grpc.aio channel to `bench.echo_server` and gets back as many bytes
as the reference server's response (the floor of moving the payload over loopback gRPC,
without tritonclient's own per-call work on either side).
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import tritonclient.grpc.aio as triton
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import np_to_triton_dtype

from bench import echo_server
from bench.timing import (
    block_calls,
    channel_to,
    sample_calls,
    tail_percentiles,
    timed,
)

Call = Callable[[], Awaitable[object]]
WARMUP = 3
RTOL, ATOL = 1e-4, 1e-5
"""How close a server's outputs must be to in-process ONNX Runtime's (np.allclose)."""


class WrongOutputs(Exception):
    """A server answered with outputs that differ from in-process ONNX Runtime's."""


def session_options(settings: dict[str, Any]) -> ort.SessionOptions:
    """SessionOptions from {"attributes": {name: value}, "config": {key: value}} (the same
    helper as in bench/peers_kserve.py, which cannot import ours)."""
    options = ort.SessionOptions()
    for name, value in settings.get("attributes", {}).items():
        if name == "execution_mode":
            value = ort.ExecutionMode(value)
        elif name == "graph_optimization_level":
            value = ort.GraphOptimizationLevel(value)
        setattr(options, name, value)
    for key, value in settings.get("config", {}).items():
        options.add_session_config_entry(key, value)
    return options


async def closed_loops(call: Call, clients: int, seconds: float) -> tuple[int, float, list[float]]:
    """`clients` loops, each sending its next request when the previous answers, for about
    `seconds`: (requests answered, seconds taken, each request's latency in ms)."""
    await asyncio.gather(*(call() for _ in range(clients)))  # every loop warm
    samples: list[float] = []
    started = time.perf_counter()
    deadline = started + seconds

    async def loop() -> None:
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            await call()
            samples.append((time.perf_counter() - sent) * 1000)

    await asyncio.gather(*(loop() for _ in range(clients)))
    return len(samples), time.perf_counter() - started, samples


def _triton_inputs(feeds: dict[str, np.ndarray]) -> list[triton.InferInput]:
    inputs = []
    for name, array in feeds.items():
        tensor = triton.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _check_outputs(server: str, expected: dict[str, np.ndarray], result: Any) -> float:
    """The largest absolute difference from `expected`; WrongOutputs when not allclose."""
    worst = 0.0
    for name, want in expected.items():
        got = result.as_numpy(name)
        if got is None or got.shape != want.shape or got.dtype != want.dtype:
            raise WrongOutputs(f"{server}: output {name!r} is missing or of the wrong shape")
        if not np.allclose(got, want, rtol=RTOL, atol=ATOL):
            raise WrongOutputs(f"{server}: output {name!r} differs from in-process ORT")
        if want.size:
            worst = max(worst, float(np.max(np.abs(got.astype(np.float64) - want))))
    return worst


async def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Check every server's outputs against in-process ORT, then time every contender.

    Latency: `iterations` calls each (when null, `timing.sample_calls` with `sample`'s
    bounds), one at a time, in alternating blocks (ort, echo, each server) of about
    `block_s` each, at least `min_rounds` of them (`timing.block_calls`). Both from a lower
    bound of a call's time: in-process ORT's run (the median of 3) plus the echo's p50 over
    20 calls.
    Throughput, when `clients` is not empty: for each N, N closed loops per contender for
    `seconds` x `throughput_rounds`, alternating likewise.
    """
    model = spec["model"]
    with np.load(spec["inputs"], allow_pickle=False) as archive:
        feeds = {name: archive[name] for name in archive.files}
    session = ort.InferenceSession(
        spec["model_path"], session_options(spec["session"]), providers=["CPUExecutionProvider"]
    )
    output_names = [o.name for o in session.get_outputs()]
    expected = dict(zip(output_names, session.run(None, feeds), strict=True))
    run_s = statistics.median(_run_seconds(session, feeds) for _ in range(3))
    inputs = _triton_inputs(feeds)
    headers = {"authorization": f"Bearer {spec['token']}"}
    request = _get_inference_request(
        model_name=model, inputs=inputs, model_version="", request_id="", outputs=None,
        sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=None,
        parameters=None,
    )  # fmt: skip
    request_bytes = request.SerializeToString()

    figures: dict[str, Any] = {"request_bytes": len(request_bytes), "response_bytes": {}}
    figures["max_abs_diff"] = {}
    clients = {
        server: triton.InferenceServerClient(url=endpoint)
        for server, endpoint in spec["servers"].items()
    }
    echo = channel_to(spec["echo"])
    pool = ThreadPoolExecutor(max(spec["clients"], default=1), thread_name_prefix="ort")
    try:
        calls: dict[str, Call] = {}

        async def run_ort() -> object:  # blocks the loop on purpose, as in runtime_latency
            return session.run(None, feeds)

        calls["ort"] = run_ort
        for server, client in clients.items():
            result = await client.infer(model, inputs, headers=headers)
            figures["max_abs_diff"][server] = _check_outputs(server, expected, result)
            figures["response_bytes"][server] = result.get_response().ByteSize()
        response_bytes = figures["response_bytes"].get(
            spec["reference"], max(figures["response_bytes"].values(), default=0)
        )
        payload = response_bytes.to_bytes(8, "little") + request_bytes[8:]
        calls["echo"] = functools.partial(echo.unary_unary(echo_server.METHOD), payload)
        for server, client in clients.items():
            calls[server] = functools.partial(client.infer, model, inputs, headers=headers)

        # A call costs at least the model's run and the payload's trip: the estimate that
        # sizes the blocks and, when no count is asked for, the sample.
        call_s = run_s + statistics.median(await timed(calls["echo"], WARMUP, n=20)) / 1000
        iterations = spec["iterations"] or sample_calls(call_s, **spec["sample"])
        samples: dict[str, list[float]] = {kind: [] for kind in calls}
        block_p50s: dict[str, list[float]] = {kind: [] for kind in calls}
        block_samples: dict[str, list[list[float]]] = {kind: [] for kind in calls}
        per_block = block_calls(iterations, spec["min_rounds"], spec["block_s"], call_s)
        figures["rounds"] = rounds = iterations // per_block
        for _ in range(rounds):
            for kind, call in calls.items():
                block = await timed(call, warmup=WARMUP, n=per_block)
                samples[kind] += block
                block_p50s[kind].append(statistics.median(block))
                block_samples[kind].append(block)
        figures["latency"] = {kind: tail_percentiles(v) for kind, v in samples.items()}
        figures["block_p50s"] = block_p50s
        figures["block_samples"] = block_samples

        loop = asyncio.get_running_loop()

        async def ort_in_thread() -> object:  # N loops need N threads, not the event loop
            return await loop.run_in_executor(pool, session.run, None, feeds)

        concurrent = {**calls, "ort": ort_in_thread}
        figures["throughput"] = {}
        for n in spec["clients"]:
            cells: dict[str, list[tuple[int, float, list[float]]]] = {k: [] for k in concurrent}
            for _ in range(spec["throughput_rounds"]):
                for kind, call in concurrent.items():
                    cells[kind].append(await closed_loops(call, n, spec["seconds"]))
            figures["throughput"][str(n)] = {kind: _merge(parts) for kind, parts in cells.items()}
    finally:
        for client in clients.values():
            await client.close()
        await echo.close()
        pool.shutdown(wait=False, cancel_futures=True)
    return figures


def _run_seconds(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> float:
    started = time.perf_counter()
    session.run(None, feeds)
    return time.perf_counter() - started


def _merge(blocks: list[tuple[int, float, list[float]]]) -> dict[str, float]:
    """The blocks of one cell: requests/s over their total time, percentiles of them all."""
    requests = sum(b[0] for b in blocks)
    seconds = sum(b[1] for b in blocks)
    pooled = [ms for b in blocks for ms in b[2]]
    return {"requests": requests, "seconds": seconds, "rps": requests / seconds,
            **tail_percentiles(pooled)}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m bench.peers_client SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    try:
        figures = asyncio.run(measure(spec))
    except WrongOutputs as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    Path(args[1]).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
