"""NodeAgent's SetReplicaClients end to end, as the broker calls it (`broker.node_client.
NodeClient`): a real node daemon (`offload node`) on each runtime checks every field, writes
the replica's clients file, and answers once the replica has exactly the clients of the
call in effect (a call made right after it is served, or refused, accordingly); a replica
that cannot confirm in time gets UNAVAILABLE, and takes the set once it runs again."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import stat
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

import modelzoo
from broker.node_client import NodeClient
from edge_client.rpc.tensors import infer_request
from protos.inference import grpc_service_pb2_grpc as infer_grpc
from protos.offload.v1 import node_pb2 as pb
from protos.offload.v1 import node_pb2_grpc as pb_grpc
from runtime.batching import PriorityClass
from runtime.clients import MAX_CLIENTS, ClientEntry, parse_generation, read_clients_file
from tests.docker_support import require_docker
from tests.integration.test_node_agent import TOKEN, _cleanup, put_model, start_daemon

MODEL = "mlp"
ONE = "client-one-token-0123456789"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 30
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def refusal(endpoint: str, token: str) -> grpc.StatusCode | None:
    """The status of one inference with `token` on the replica; None when answered."""
    request = infer_request(MODEL, modelzoo.sample_inputs(modelzoo.model_path(MODEL)))
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = infer_grpc.GRPCInferenceServiceStub(channel)
        try:
            await stub.ModelInfer(
                request, metadata=(("authorization", f"Bearer {token}"),), timeout=30
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
    return None


def client(
    client_id: str = "c1",
    priority_class: str = "critical",
    token_sha256: str = sha(ONE),
    max_rps: float = 0.0,
) -> pb.ReplicaClient:
    return pb.ReplicaClient(
        client_id=client_id,
        priority_class=priority_class,
        token_sha256=token_sha256,
        max_rps=max_rps,
    )


async def test_a_replica_takes_the_clients_the_node_is_given(runtime: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    daemon = await start_daemon(
        runtime, f"test-node-{runtime}-clients", state, tmp_path / "daemon.log"
    )
    started: list[str] = []
    node = NodeClient("clients-node", daemon.address, None)
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            sha256 = await put_model(stub, modelzoo.model_path(MODEL))
            spec = pb.ReplicaSpec(
                deployment_id="common", epoch=1, model_sha256=sha256, model_name=MODEL,
                token=TOKEN,
            )  # fmt: skip
            replica = (await stub.StartReplica(pb.StartReplicaRequest(spec=spec))).replica
            started.append(replica.replica_id)

            # Every field checked, the first bad one named (a hash never quoted); nothing
            # written meanwhile.
            for clients, message in (
                ([client(client_id="c 1")], "clients[0]: client id 'c 1' must be 1 to 64"),
                ([client(priority_class="urgent")], "clients[0]: class 'urgent' must be one"),
                ([client(token_sha256=ONE)], "clients[0]: a token's SHA-256 must be 64"),
                ([client(max_rps=float("nan"))], "clients[0]: a rate limit must be a number"),
                ([client(max_rps=-1.0)], "clients[0]: a rate limit must be a number"),
                (
                    [client(), client(token_sha256=sha("other"))],
                    "clients[1]: client 'c1' is listed at clients[0] too",
                ),
                (
                    [client(), client(client_id="c2")],
                    "clients[1]: the same token hash as clients[0]",
                ),
                (
                    [client(client_id=f"c{i}") for i in range(MAX_CLIENTS + 1)],
                    f"clients has {MAX_CLIENTS + 1} entries; at most {MAX_CLIENTS}",
                ),
            ):
                request = pb.SetReplicaClientsRequest(
                    replica_id=replica.replica_id, clients=clients
                )
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.SetReplicaClients(request)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = caught.value.details() or ""
                assert details.startswith(message), details
                assert ONE not in details and sha(ONE) not in details
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.SetReplicaClients(pb.SetReplicaClientsRequest(replica_id="nope-1"))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert not await node.set_replica_clients("nope-1", [])

        # Not a client yet: refused. Given: taken once the call answers.
        assert await refusal(replica.endpoint, ONE) == grpc.StatusCode.UNAUTHENTICATED
        c1 = ClientEntry("c1", PriorityClass.CRITICAL, sha(ONE), 25.0)
        assert await node.set_replica_clients(replica.replica_id, [c1])
        assert await node.set_replica_clients(replica.replica_id, [c1])  # idempotent
        assert await refusal(replica.endpoint, ONE) is None
        if runtime == "process":
            written = state / "replicas" / replica.replica_id / "clients"
            assert stat.S_IMODE(written.stat().st_mode) == 0o600
            assert read_clients_file(written) == (c1,)
            assert not list(written.parent.glob(".clients-*"))  # no temporary file left

        # The whole set each call: an empty one removes the client; the deployment's own
        # token still works.
        assert await node.set_replica_clients(replica.replica_id, [])
        assert await refusal(replica.endpoint, ONE) == grpc.StatusCode.UNAUTHENTICATED
        assert await refusal(replica.endpoint, TOKEN) is None
    finally:
        await node.close()
        await _cleanup(daemon, started)


def generation(metrics_endpoint: str) -> float:
    """The clients generation the replica reports (blocking)."""
    url = f"http://{metrics_endpoint}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("offload_runtime_clients_generation "):
                return float(line.split()[1])
    raise AssertionError("the replica reports no clients generation")


async def test_a_client_is_served_as_soon_as_the_node_answers(
    runtime: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    daemon = await start_daemon(
        runtime, f"test-node-{runtime}-attach", state, tmp_path / "daemon.log"
    )
    started: list[str] = []
    node = NodeClient("attach-node", daemon.address, None)
    resume: Callable[[], None] | None = None
    """Set while the replica is stopped."""
    try:
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.NodeAgentStub(channel)
            sha256 = await put_model(stub, modelzoo.model_path(MODEL))
            spec = pb.ReplicaSpec(
                deployment_id="attach", epoch=1, model_sha256=sha256, model_name=MODEL,
                token=TOKEN,
            )  # fmt: skip
            replica = (await stub.StartReplica(pb.StartReplicaRequest(spec=spec))).replica
            started.append(replica.replica_id)
        folder = state / "replicas" / replica.replica_id
        metrics = ""
        if runtime == "process":
            record = json.loads((folder / "replica.json").read_text())
            metrics = record["metrics_endpoint"]
            assert await asyncio.to_thread(generation, metrics) == 0  # none written yet

        # Each round attaches a new client in place of the last (a new token, the old one
        # dropped), and calls with both at once: no race between the answer and the set.
        seen = 0.0
        for n in range(20):
            token, before = f"client-token-{n}-0123456789", f"client-token-{n - 1}-0123456789"
            entry = ClientEntry(f"c{n}", PriorityClass.STANDARD, sha(token))
            assert await node.set_replica_clients(replica.replica_id, [entry])
            assert await refusal(replica.endpoint, token) is None, n
            if n:
                assert await refusal(replica.endpoint, before) == (
                    grpc.StatusCode.UNAUTHENTICATED
                ), n
            if metrics:
                now = await asyncio.to_thread(generation, metrics)
                assert now > seen, (n, now, seen)
                seen = now
                assert now == parse_generation((folder / "clients").read_text())

        # A replica that does not answer (stopped) cannot confirm: UNAVAILABLE naming it and
        # the wait; the file is written all the same.
        stop, resume = freeze(runtime, replica.ref)
        stop()
        late = "client-token-late-0123456789"
        request = pb.SetReplicaClientsRequest(
            replica_id=replica.replica_id,
            clients=[client(client_id="late", token_sha256=sha(late))],
        )
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pb_grpc.NodeAgentStub(channel).SetReplicaClients(request, timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        details = caught.value.details() or ""
        assert f"replica {replica.replica_id}" in details, details
        assert "did not confirm its clients" in details and "within 5 s" in details, details
        written = (folder / "clients").read_text() if runtime == "process" else ""
        resume, thawed = None, resume
        thawed()

        # Running again, it catches up (its poll reads the file) and serves the client.
        async def caught_up() -> bool:
            return await refusal(replica.endpoint, late) is None

        await until(caught_up, "the replica never took the clients written while it was stopped")
        if metrics:
            assert await asyncio.to_thread(generation, metrics) == parse_generation(written)
        assert await node.set_replica_clients(replica.replica_id, [])
        assert await refusal(replica.endpoint, late) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        if resume is not None:
            resume()
        await node.close()
        await _cleanup(daemon, started)


def freeze(runtime: str, ref: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(stop, resume) the replica: SIGSTOP and SIGCONT to a process, the engine's pause and
    unpause to a container."""
    if runtime == "process":
        pid = int(ref)
        return (lambda: os.kill(pid, signal.SIGSTOP)), (lambda: os.kill(pid, signal.SIGCONT))

    def call(action: str) -> None:
        client = require_docker()
        try:
            getattr(client.containers.get(ref), action)()
        finally:
            client.close()

    return (lambda: call("pause")), (lambda: call("unpause"))
