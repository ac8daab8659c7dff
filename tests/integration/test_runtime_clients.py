"""A shared replica's clients (`--clients-file`, `runtime.clients`) on a real `python -m
runtime.server` process serving the MLP: each client's token is taken with its own class and
rate limit, the file is followed as it changes (read at once on SIGHUP, else by its poll),
the generation in effect is reported, and each client has its own metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import signal
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import modelzoo
from edge_client.rpc.tensors import infer_request
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from runtime.batching import PriorityClass
from runtime.clients import RATE_WAIT_S, ClientEntry, format_clients
from tests.runtime_support import AUTH, spawn_runtime

MODEL = "mlp"
ONE, TWO, THREE = "client-one-token-0123", "client-two-token-0123", "client-three-token-01"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def write(path: Path, text: str) -> None:
    """As the node writes it: a new file renamed over the old one."""
    temporary = path.with_name(".clients.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


@dataclass
class Replica:
    stub: pb_grpc.GRPCInferenceServiceStub
    metrics_url: str
    log: Path
    process: asyncio.subprocess.Process

    async def infer(self, token: str) -> None:
        path = modelzoo.model_path(MODEL)
        request = infer_request(path.stem, modelzoo.sample_inputs(path))
        await self.stub.ModelInfer(
            request, metadata=(("authorization", f"Bearer {token}"),), timeout=30
        )

    async def refusal(self, token: str) -> grpc.aio.AioRpcError | None:
        """The call's error; None when it was answered."""
        try:
            await self.infer(token)
        except grpc.aio.AioRpcError as err:
            return err
        return None

    async def generation(self) -> float:
        return (await self.samples())[("offload_runtime_clients_generation", frozenset())]

    async def samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        def read() -> str:
            with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
                return response.read().decode()

        text = await asyncio.to_thread(read)
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }


@pytest.fixture
async def replica(tmp_path: Path) -> AsyncIterator[Callable[[str], Awaitable[Replica]]]:
    processes: list[asyncio.subprocess.Process] = []

    async def start(clients: str) -> Replica:
        path = tmp_path / "clients"
        write(path, clients)
        process, endpoint = await spawn_runtime(
            tmp_path, modelzoo.model_path(MODEL), "--clients-file", str(path),
            "--max-batch-size", "4",
        )  # fmt: skip
        processes.append(process)
        log = tmp_path / "runtime.log"
        match = re.search(r"metrics served at (\S+)", log.read_text())
        assert match is not None, log.read_text()
        channel = grpc.aio.insecure_channel(endpoint)
        channels.append(channel)
        return Replica(pb_grpc.GRPCInferenceServiceStub(channel), match.group(1), log, process)

    channels: list[grpc.aio.Channel] = []
    try:
        yield start
    finally:
        for channel in channels:
            await channel.close()
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            await process.wait()


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 30
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_clients_are_taken_with_their_class_and_followed_as_the_file_changes(
    replica: Callable[[str], Awaitable[Replica]], tmp_path: Path
) -> None:
    path = tmp_path / "clients"
    served = await replica(f"# the service's clients\nc1 critical {sha(ONE)}\n")
    await served.infer(ONE)
    await served.infer(AUTH[0][1].removeprefix("Bearer "))  # the deployment's own token
    samples = await served.samples()
    model = ("model", modelzoo.model_path(MODEL).stem)  # spawn_runtime serves it so
    assert samples[("offload_runtime_client_requests_total", frozenset(
        {model, ("client", "c1"), ("code", "OK")}
    ))] == 1  # fmt: skip

    # The client's call ran in its line's class, the deployment's in its own (standard);
    # a call that ran alone reaches the batching series a few milliseconds after it.
    async def classes_counted() -> bool:
        classes = {
            dict(labels)["class"]: value
            for (name, labels), value in (await served.samples()).items()
            if name == "offload_runtime_class_requests_total"
        }
        assert set(classes) <= {"critical", "standard"} and max(classes.values(), default=0) <= 1
        return classes == {"critical": 1.0, "standard": 1.0}

    await until(classes_counted, "each call was not counted once in its class")
    assert (
        samples[
            ("offload_runtime_client_compute_seconds_total", frozenset({model, ("client", "c1")}))
        ]
        > 0
    )

    # A client added works from a call soon after; the file never names it to the log.
    write(path, f"c1 critical {sha(ONE)}\nc2 best-effort {sha(TWO)}\n")

    async def taken(token: str) -> bool:
        return await served.refusal(token) is None

    await until(lambda: taken(TWO), "the added client was never taken")

    # A client removed is refused UNAUTHENTICATED, its series gone.
    write(path, f"c2 best-effort {sha(TWO)}\n")

    async def refused(token: str) -> bool:
        err = await served.refusal(token)
        return err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED

    await until(lambda: refused(ONE), "the removed client was still served")
    err = await served.refusal(ONE)
    assert err is not None and err.details() == "invalid token for this deployment"
    clients = {
        dict(labels).get("client")
        for name, labels in await served.samples()
        if name.startswith("offload_runtime_client_")
    }
    assert clients == {"c2"}

    # A file that does not parse keeps the clients read before, and says where.
    write(path, f"c2 best-effort {sha(TWO)}\nc3 urgent {sha(THREE)}\n")

    async def reported() -> bool:
        return "line 2" in await asyncio.to_thread(served.log.read_text)

    await until(reported, "the broken file was never reported")
    text = served.log.read_text()
    assert "class 'urgent' must be one of" in text and "keeping the 1 clients" in text
    assert sha(THREE) not in text and sha(TWO) not in text
    await served.infer(TWO)
    assert (await served.refusal(THREE)) is not None


async def test_a_client_over_its_rate_limit_is_refused_naming_it(
    replica: Callable[[str], Awaitable[Replica]],
) -> None:
    # One call's burst, then one call every 1,000 s: the second call is over the limit
    # whenever it comes in this test.
    served = await replica(f"c3 standard {sha(THREE)} 0.001\nc1 standard {sha(ONE)} 0\n")
    await served.infer(THREE)
    err = await served.refusal(THREE)
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "client c3 is over its rate limit of 0.001 requests/s; retry later"
    for _ in range(3):  # a client without a limit, and the deployment, are not held back
        await served.infer(ONE)
        await served.infer(AUTH[0][1].removeprefix("Bearer "))
    samples = await served.samples()
    codes = {
        dict(labels)["code"]: value
        for (name, labels), value in samples.items()
        if name == "offload_runtime_client_requests_total" and ("client", "c3") in labels
    }
    assert codes == {"OK": 1.0, "RESOURCE_EXHAUSTED": 1.0}
    live = await served.stub.ServerReady(pb.ServerReadyRequest(), metadata=AUTH)
    assert live.ready


async def test_a_client_a_little_over_its_rate_is_paced_and_a_flood_refused(
    replica: Callable[[str], Awaitable[Replica]],
) -> None:
    # 8 calls/s: 40 calls sent at once take the second's burst (8), then the next wait for
    # their token within RATE_WAIT_S (at least 2: a quarter second holds two tokens at 8/s),
    # answered late, not refused; the rest are refused at once (40 calls cannot arrive
    # spread over the 4 s their tokens would take).
    served = await replica(f"c3 standard {sha(THREE)} 8\n")
    errors = await asyncio.gather(*(served.refusal(THREE) for _ in range(40)))
    codes = [err.code() if err is not None else grpc.StatusCode.OK for err in errors]
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.OK) >= 8 + round(RATE_WAIT_S * 8), codes


def entry(client_id: str, token: str) -> ClientEntry:
    return ClientEntry(client_id, PriorityClass.STANDARD, sha(token))


async def test_sighup_has_the_file_read_at_once_and_its_generation_reported(
    replica: Callable[[str], Awaitable[Replica]], tmp_path: Path
) -> None:
    path = tmp_path / "clients"
    served = await replica(format_clients([entry("c0", "client-token-0-0123456789")], 1))
    assert await served.generation() == 1  # the file read at start
    await served.infer("client-token-0-0123456789")
    # As the node does it, round after round: write, signal, wait for the generation, and
    # call at once: the client added is served, the one removed refused.
    for n in range(1, 21):
        token, before = f"client-token-{n}-0123456789", f"client-token-{n - 1}-0123456789"
        write(path, format_clients([entry(f"c{n}", token)], n + 1))
        served.process.send_signal(signal.SIGHUP)

        async def confirmed(generation: int = n + 1) -> bool:
            return await served.generation() >= generation

        await until(confirmed, f"generation {n + 1} never reported")
        await served.infer(token)
        err = await served.refusal(before)
        assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert served.process.returncode is None
    assert "(signalled)" in served.log.read_text()

    # An older node sends no signal (nor a generation): the poll reads the file, and the
    # generation goes to 0.
    write(path, format_clients([entry("c0", "client-token-0-0123456789")]))

    async def polled() -> bool:
        return await served.generation() == 0

    await until(polled, "the file written without a signal was never read")
    await served.infer("client-token-0-0123456789")


async def test_sighup_without_a_clients_file_is_logged_not_fatal(tmp_path: Path) -> None:
    process, endpoint = await spawn_runtime(tmp_path, modelzoo.model_path(MODEL))
    try:
        process.send_signal(signal.SIGHUP)
        log = tmp_path / "runtime.log"

        async def logged() -> bool:
            return "SIGHUP: no --clients-file" in await asyncio.to_thread(log.read_text)

        await until(logged, "SIGHUP was not logged")
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert (await stub.ServerReady(pb.ServerReadyRequest(), metadata=AUTH)).ready
        assert process.returncode is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        await process.wait()
