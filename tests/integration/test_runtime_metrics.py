"""The runtime's Prometheus endpoint, scraped over HTTP while real gRPC calls go through."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge_client.rpc.tensors import infer_request, response_arrays
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from runtime.batching import BatchPolicy, PriorityClass
from runtime.clients import ClientEntry
from runtime.metrics import DURATION_BUCKETS_S
from runtime.model import OnnxModel
from runtime.server import (
    DEFAULT_METRICS_PORT,
    RunningServer,
    RuntimeSettings,
    load_model,
    settings_from_args,
    start_server,
)
from tests.batching_support import SPINNER_WIDTH, build_spinner

TOKEN = "metrics-test-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
MODEL = "probe"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def settings_for(model: Path, **overrides: object) -> RuntimeSettings:
    base = RuntimeSettings(
        model=model, name=MODEL, token=TOKEN, host="127.0.0.1", port=0, metrics_port=0
    )
    return replace(base, **overrides)


@pytest.fixture
async def serve(probe_model: Path) -> AsyncIterator[Callable[..., Awaitable[RunningServer]]]:
    started: list[RunningServer] = []

    async def start(**overrides: object) -> RunningServer:
        settings = settings_for(probe_model, **overrides)
        running = await start_server(settings)
        started.append(running)
        await load_model(running, settings)
        return running

    try:
        yield start
    finally:
        for running in started:
            await running.drain(1.0)


def scrape_text(running: RunningServer) -> str:
    assert running.metrics_endpoint is not None
    with urllib.request.urlopen(running.metrics_endpoint.url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def scrape(running: RunningServer) -> Samples:
    return parse(await asyncio.to_thread(scrape_text, running))


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model": MODEL, **labels}.items()))]


def failures(samples: Samples) -> dict[str, float]:
    """code -> count of every failure series of the model."""
    return {
        dict(labels)["code"]: count
        for (name, labels), count in samples.items()
        if name == "offload_runtime_request_failures_total" and dict(labels)["model"] == MODEL
    }


def buckets(samples: Samples, histogram: str) -> dict[str, float]:
    return {
        dict(labels)["le"]: count
        for (name, labels), count in samples.items()
        if name == f"{histogram}_bucket" and dict(labels)["model"] == MODEL
    }


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_each_answered_call_moves_the_metrics_once(
    serve, probe_model: Path, probe_inputs
) -> None:
    running = await serve()
    before = await scrape(running)
    assert value(before, "offload_runtime_requests_total") == 0
    assert failures(before) == {}

    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(3):
            await stub.ModelInfer(infer_request(MODEL, probe_inputs), metadata=AUTH)
        wrong_shape = infer_request(MODEL, {**probe_inputs, "x": np.zeros((2, 5), np.float32)})
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(wrong_shape, metadata=AUTH)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.ModelInfer(infer_request("other", probe_inputs), metadata=AUTH)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        garbage = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.aio.AioRpcError) as unparsed:
            await garbage(b"\xff\xff\xff", metadata=AUTH)
        assert unparsed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Not counted: refused before the handler (no token), or not an inference.
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await stub.ModelInfer(infer_request(MODEL, probe_inputs))
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL), metadata=AUTH)
        await stub.ServerReady(pb.ServerReadyRequest(), metadata=AUTH)

    text = await asyncio.to_thread(scrape_text, running)
    after = parse(text)
    assert value(after, "offload_runtime_requests_total") == 7
    assert failures(after) == {"INVALID_ARGUMENT": 3, "NOT_FOUND": 1}
    request = "offload_runtime_request_duration_seconds"
    assert value(after, f"{request}_count") == 7
    assert value(after, f"{request}_sum") > 0
    compute = "offload_runtime_compute_duration_seconds"
    assert value(after, f"{compute}_count") == 3  # the failures never reached ONNX Runtime
    assert 0 < value(after, f"{compute}_sum") <= value(after, f"{request}_sum")
    for histogram, count in ((request, 7), (compute, 3)):
        counts = buckets(after, histogram)
        bounds = [float(le) for le in counts if le != "+Inf"]
        assert sorted(bounds) == list(DURATION_BUCKETS_S)
        cumulative = [counts[le] for le in sorted(counts, key=float)]
        assert cumulative == sorted(cumulative)
        assert counts["+Inf"] == count
    assert value(after, "offload_runtime_in_flight") == 0
    assert value(after, "offload_runtime_queued") == 0  # inline: nothing waits for a thread
    assert running.state.inline

    assert TOKEN not in text
    assert str(probe_model.parent) not in text
    assert probe_model.name not in text


@contextlib.contextmanager
def worker_held(running: RunningServer) -> Iterator[threading.Event]:
    """Hold the server's worker thread (its only one: concurrency 1) until the event is set,
    at the latest on the way out."""
    release = threading.Event()
    blocker = running.executor.submit(release.wait)
    try:
        yield release
    finally:
        release.set()
        blocker.result()


async def test_calls_waiting_for_a_worker_are_queued(serve, probe_inputs) -> None:
    running = await serve(inline_below_ms=0, concurrency=1)
    assert not running.state.inline
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    request = infer_request(MODEL, probe_inputs)
    async with channel:
        with worker_held(running) as release:
            infer = stub.ModelInfer
            calls = [asyncio.ensure_future(infer(request, metadata=AUTH)) for _ in range(3)]
            # Its deadline passes while it waits: the server cancels it before a thread takes it.
            expiring = asyncio.ensure_future(stub.ModelInfer(request, metadata=AUTH, timeout=1.0))

            async def waiting(count: int) -> bool:
                samples = await scrape(running)
                return (
                    value(samples, "offload_runtime_queued") == count
                    and value(samples, "offload_runtime_in_flight") == count
                )

            await until(lambda: waiting(4), "4 calls queued")
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await expiring
            assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: waiting(3), "the expired call to leave the queue")
            release.set()
            await asyncio.gather(*calls)

    samples = await scrape(running)
    assert value(samples, "offload_runtime_queued") == 0
    assert value(samples, "offload_runtime_in_flight") == 0
    assert value(samples, "offload_runtime_requests_total") == 4
    assert failures(samples) == {"CANCELLED": 1}
    assert value(samples, "offload_runtime_compute_duration_seconds_count") == 3


async def test_the_endpoint_closes_with_the_drain(serve) -> None:
    running = await serve()
    assert running.metrics_endpoint is not None
    url = running.metrics_endpoint.url
    await running.drain(1.0)
    assert running.metrics_endpoint is None
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(urllib.request.urlopen, url, timeout=5)


async def test_no_metrics_port_serves_none(serve) -> None:
    running = await serve(metrics_port=None)
    assert running.metrics_endpoint is None


async def test_a_taken_metrics_port_fails_the_start(probe_model: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            await start_server(settings_for(probe_model, metrics_port=port))


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], DEFAULT_METRICS_PORT),
        (["--port", "0"], 0),  # one of several on free ports: a free one too
        (["--metrics-port", "9100"], 9100),
        (["--port", "0", "--metrics-port", "9100"], 9100),
        (["--metrics-port", "0"], 0),
        (["--metrics-port", "-1"], None),
    ],
)
def test_metrics_port_flag(tmp_path: Path, probe_model: Path, flags, expected) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    common = ["--model", str(probe_model), "--token-file", str(token), "--insecure"]
    assert settings_from_args([*common, *flags]).metrics_port == expected


@pytest.mark.parametrize("bad", ["-2", "65536", "http"])
def test_metrics_port_flag_refuses_bad_ports(tmp_path: Path, probe_model: Path, bad) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with pytest.raises(SystemExit) as exited:
        settings_from_args(
            ["--model", str(probe_model), "--token-file", str(token), "--metrics-port", bad]
        )
    assert exited.value.code == 2


async def too_late(call: Awaitable[object], compute_ms: str = "10000.0") -> None:
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await call
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    details = late.value.details() or ""
    assert f"under the model's compute time ({compute_ms} ms); not computed" in details, details


@pytest.mark.parametrize("inline_below_ms", [1e6, 0], ids=["inline", "worker-thread"])
async def test_a_call_whose_deadline_is_too_short_is_not_computed(
    serve, probe_inputs, inline_below_ms
) -> None:
    """A call whose deadline leaves less than the model's compute time is answered
    DEADLINE_EXCEEDED without running the model, inline or in a worker thread: under
    overload, computing answers nobody waits for would only make the calls behind them late
    too. The compute time is set to 10 s here, so the verdict does not hang on this
    machine's speed."""
    running = await serve(inline_below_ms=inline_below_ms)
    assert running.state.inline == (inline_below_ms > 0)
    running.state.compute_s = 10.0
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    request = infer_request(MODEL, probe_inputs)
    try:
        await too_late(stub.ModelInfer(request, metadata=AUTH, timeout=5))  # the full path
        await stub.ModelInfer(request, metadata=AUTH)  # no deadline: computed, and planned
        await too_late(stub.ModelInfer(request, metadata=AUTH, timeout=5))  # the planned path
        await stub.ModelInfer(request, metadata=AUTH, timeout=30)  # time enough
    finally:
        await channel.close()
    samples = await scrape(running)
    assert value(samples, "offload_runtime_compute_duration_seconds_count") == 2
    assert failures(samples) == {"DEADLINE_EXCEEDED": 2}
    assert value(samples, "offload_runtime_queued") == 0


async def test_a_queued_call_is_checked_against_its_deadline_when_a_thread_takes_it(
    serve, probe_inputs
) -> None:
    """The wait for a worker thread can use up a call's deadline, so the check runs when a
    thread takes the call, not when it is queued: a call queued with time enough for the
    model as measured then is not computed if, once a thread is free, what is left is under
    the compute time (raised here while it waits, so the verdict does not hang on how long
    the wait takes)."""
    running = await serve(inline_below_ms=0, concurrency=1)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    async with channel:
        with worker_held(running) as release:
            call = asyncio.ensure_future(
                stub.ModelInfer(infer_request(MODEL, probe_inputs), metadata=AUTH, timeout=30)
            )

            async def queued() -> bool:
                return value(await scrape(running), "offload_runtime_queued") == 1

            await until(queued, "the call to wait for the worker thread")
            running.state.compute_s = 60.0
            release.set()
            await too_late(call, "60000.0")
    samples = await scrape(running)
    assert value(samples, "offload_runtime_compute_duration_seconds_count") == 0
    assert value(samples, "offload_runtime_queued") == 0
    assert failures(samples) == {"DEADLINE_EXCEEDED": 1}


HELD_S = 3.0
"""How long the spinner's blocking request computes, as measured before: the test's calls
and scrapes while it runs take a small part of it."""


def turns_for(spinner: Path, seconds: float) -> int:
    """The spinner's turns that compute for about `seconds` on one thread here."""
    model = OnnxModel.load(spinner, "spinner", device="cpu", intra_op_threads=1)
    x = np.zeros((1, SPINNER_WIDTH), np.float32)
    started = time.perf_counter()
    model.run({"x": x, "turns": np.array([20_000])}, ["y"])
    return int(20_000 * seconds / max(time.perf_counter() - started, 1e-6))


async def test_a_full_class_is_refused_while_another_class_is_still_admitted(
    tmp_path: Path,
) -> None:
    """`--max-queued-per-class 2`, over gRPC: while one best-effort batch runs (the spinner,
    held by its turns), two best-effort requests wait, a third is refused RESOURCE_EXHAUSTED
    naming the flag and counted for its class, and a critical request (a token of that class)
    is still admitted and answered; so is every admitted request, once the batch is done."""
    spinner = build_spinner(tmp_path / "spinner.onnx")
    critical_token = "critical-client-token-0123"
    settings = settings_for(
        spinner,
        max_batch_size=4,
        batching=BatchPolicy(max_queued_per_class=2),
        inline_below_ms=0,  # every batch in its session's thread: the loop stays free
        intra_op_threads=1,
        priority_class=PriorityClass.BEST_EFFORT,
        class_tokens={critical_token: PriorityClass.CRITICAL},
    )
    turns = await asyncio.to_thread(turns_for, spinner, HELD_S)
    running = await start_server(settings)
    try:
        await load_model(running, settings)
        assert running.state.batcher is not None
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        rng = np.random.default_rng(0)

        def call(spin: int, metadata: tuple[tuple[str, str], ...] = AUTH) -> asyncio.Future:
            x = rng.standard_normal((1, SPINNER_WIDTH)).astype(np.float32)
            request = infer_request(MODEL, {"x": x, "turns": np.array([spin])})
            return asyncio.ensure_future(stub.ModelInfer(request, metadata=metadata, timeout=60))

        def queued(cls: PriorityClass, count: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                samples = await scrape(running)
                return value(samples, "offload_runtime_class_queued", **{"class": cls}) == count

            return check

        async with channel:
            held = call(turns)

            async def running_alone() -> bool:
                samples = await scrape(running)
                return (
                    value(samples, "offload_runtime_in_flight") == 1
                    and value(samples, "offload_runtime_queued") == 0
                )

            await until(running_alone, "the held batch to start")
            waiting = [call(0), call(0)]
            await until(queued(PriorityClass.BEST_EFFORT, 2), "two best-effort requests queued")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(0)
            critical = call(0, (("authorization", f"Bearer {critical_token}"),))
            await until(queued(PriorityClass.CRITICAL, 1), "the critical request admitted")
            samples = await scrape(running)
            answers = await asyncio.gather(held, critical, *waiting)
    finally:
        await running.drain(10.0)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 best-effort requests are queued already" in (refused.value.details() or "")
    assert "--max-queued-per-class" in (refused.value.details() or "")
    refusals = {
        dict(labels)["class"]: count
        for (name, labels), count in samples.items()
        if name == "offload_runtime_class_refused_total"
    }
    assert refusals == {"best-effort": 1}
    assert failures(samples) == {"RESOURCE_EXHAUSTED": 1}
    assert [response_arrays(a)["y"].shape for a in answers] == [(1, SPINNER_WIDTH)] * 4


async def test_a_model_run_in_worker_threads_bounds_each_class_too(serve, probe_inputs) -> None:
    """A model that does not batch (the probe: its `m` has no batch axis) and runs in worker
    threads holds at most --max-queued-per-class calls of one class waiting for a thread:
    the next of that class is refused RESOURCE_EXHAUSTED and counted, another class's call
    is still admitted, and every admitted call is answered once the thread is free."""
    critical_token = "critical-client-token-4567"
    running = await serve(
        inline_below_ms=0,
        concurrency=1,
        batching=BatchPolicy(max_queued_per_class=2),
        class_tokens={critical_token: PriorityClass.CRITICAL},
    )
    assert running.state.batcher is None and not running.state.inline
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    request = infer_request(MODEL, probe_inputs)
    async with channel:
        with worker_held(running) as release:
            held = [
                asyncio.ensure_future(stub.ModelInfer(request, metadata=AUTH, timeout=30))
                for _ in range(2)
            ]

            def waiting(count: int) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    return value(await scrape(running), "offload_runtime_queued") == count

                return check

            await until(waiting(2), "two standard calls waiting for the thread")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(request, metadata=AUTH, timeout=30)
            critical = asyncio.ensure_future(
                stub.ModelInfer(
                    request,
                    metadata=(("authorization", f"Bearer {critical_token}"),),
                    timeout=30,
                )
            )
            await until(waiting(3), "the critical call admitted")
            release.set()
            answers = await asyncio.gather(*held, critical)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = refused.value.details() or ""
    assert "2 standard requests are waiting for a worker thread already" in details, details
    assert "--max-queued-per-class" in details
    assert all(len(a.outputs) == 3 for a in answers)
    samples = await scrape(running)
    assert value(samples, "offload_runtime_class_refused_total", **{"class": "standard"}) == 1
    assert value(samples, "offload_runtime_queued") == 0
    # Freed slots are counted back: the class is admitted again.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as again:
        stub = pb_grpc.GRPCInferenceServiceStub(again)
        for _ in range(3):
            await stub.ModelInfer(request, metadata=AUTH, timeout=30)


async def test_a_client_waits_for_a_worker_thread_with_at_most_its_share(
    serve, probe_inputs
) -> None:
    """A client of the clients file (`runtime.clients`) holds at most half its class's
    --max-queued-per-class calls waiting for a thread: its next is refused naming that limit
    while the deployment's own calls of the same class are still admitted; each client's
    calls are counted by code."""
    token = "client-one-token-0123456789"
    running = await serve(
        inline_below_ms=0,
        concurrency=1,
        batching=BatchPolicy(max_queued_per_class=2),
        clients=(
            ClientEntry("c1", PriorityClass.STANDARD, hashlib.sha256(token.encode()).hexdigest()),
        ),
    )
    assert running.state.batcher is None and not running.state.inline
    client = (("authorization", f"Bearer {token}"),)
    request = infer_request(MODEL, probe_inputs)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with worker_held(running) as release:

            def waiting(count: int) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    return value(await scrape(running), "offload_runtime_queued") == count

                return check

            held = [asyncio.ensure_future(stub.ModelInfer(request, metadata=client, timeout=30))]
            await until(waiting(1), "the client's call waiting for the thread")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(request, metadata=client, timeout=30)
            held.append(asyncio.ensure_future(stub.ModelInfer(request, metadata=AUTH, timeout=30)))
            await until(waiting(2), "the deployment's call admitted")
            release.set()
            await asyncio.gather(*held)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.details() == (
        "client c1 has 1 standard requests queued already, the most one client may hold "
        "(50% of --max-queued-per-class 2); retry with backoff"
    )
    samples = await scrape(running)
    codes = {
        dict(labels)["code"]: count
        for (name, labels), count in samples.items()
        if name == "offload_runtime_client_requests_total"
    }
    assert codes == {"OK": 1, "RESOURCE_EXHAUSTED": 1}
    assert value(samples, "offload_runtime_client_compute_seconds_total", client="c1") > 0
    assert ("offload_runtime_class_refused_total", frozenset(
        {"model": MODEL, "class": "standard"}.items()
    )) not in samples  # fmt: skip
