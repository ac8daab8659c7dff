"""Hostile input on every RPC of the broker (issue 10): random field values and random bytes,
over real gRPC against a broker process with a node and a running deployment.

Nothing a caller sends makes the broker answer UNKNOWN or INTERNAL, crash, or change its state
when it refuses the call; the ops API's `/api/migrations` answers after it all.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from google.protobuf import descriptor
from google.protobuf.message_factory import GetMessageClass

import modelzoo
from bench.chaos_fuzz import Known, call_raw, random_fields, random_requests
from broker.errors import MESSAGE_CHARS
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from tests.cluster_support import JOIN_TOKEN, THREE_NODES, Cluster
from tests.ops_support import ops_headers

NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
# Each RPC gets this many calls with random fields (and as many with one random field in a
# valid request, where it has one) and with random bytes.
FIELD_CALLS = 12
BYTES_CALLS = 5
CALL_TIMEOUT_S = 30.0

NODE_REGISTRY = pb.DESCRIPTOR.services_by_name["NodeRegistry"]
EDGE_BROKER = pb.DESCRIPTOR.services_by_name["EdgeBroker"]
OPERATOR = pb.DESCRIPTOR.services_by_name["Operator"]
# DeleteDeployment last: it may delete the deployment the others reach deeper with.
METHODS = sorted(
    (method for service in (NODE_REGISTRY, EDGE_BROKER, OPERATOR) for method in service.methods),
    key=lambda method: method.name == "DeleteDeployment",
)


def known_values(deployment_id: str, model_sha256: str) -> Known:
    """Real values of the cluster under test, mixed into the random ones so that calls reach
    past the first lookups. No real node id and no valid node address: a call accepted with
    them would re-register, drain or heartbeat the node, whose effects arrive later."""
    return Known(
        {
            "deployment_id": (deployment_id, "d-0123456789"),
            "migration_id": ("m-0123456789",),
            "sha256": (model_sha256, "0" * 64, "A" * 64),
            "model_sha256": (model_sha256, "0" * 64),
            "model_name": ("mlp", "a" * 65),
            "site": ("site-a", "mars"),
            "client_id": ("alice", "bob"),
            "node_id": ("node-zz", "NODE"),
            "to_node": ("node-zz",),
            "address": ("127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1", "[::1]:80"),
            "strategy": ("make_before_break", "stop_start", "failover"),
            "kind": ("NV2", "PIX", "SYS", "NV999", "NVx"),
            "replica_id": (f"{deployment_id}-1", "r"),
        }
    )


def valid_request(method: str, deployment_id: str, model_sha256: str) -> dict[str, Any] | None:
    """A request of `method` the broker would accept, for calls that change one field of it;
    None where an accepted call would change the node (its effects arrive later) or delete
    what the other calls reach for."""
    deployment = {"deployment_id": deployment_id}
    return {
        "FetchModel": {"sha256": model_sha256},
        "Deploy": {"model_sha256": model_sha256, "model_name": "mlp", "gpus": 1, "site": "site-a"},
        "GetDeployment": deployment,
        "WatchDeployment": deployment,
        "ListMigrations": deployment,
        "ReportLocation": {"site": "site-a"},
        "AckSwitch": {**deployment, "epoch": 2},
        "ReportObservation": {
            **deployment,
            "migration_id": "m-0123456789",
            "longest_gap_ms": 12.5,
            "failed_requests": 0,
        },
        "Migrate": {**deployment, "strategy": "stop_start"},
    }.get(method)


def one_field_off(
    method: descriptor.MethodDescriptor, valid: dict[str, Any], rng: random.Random, known: Known
) -> list[bytes]:
    """`valid` with one field random: each check is reached on its own."""
    fields = random_fields(method.input_type, rng, known)
    name = rng.choice(sorted(fields or valid))
    request = GetMessageClass(method.input_type)(
        **{**valid, name: fields[name] if name in fields else valid[name]}
    )
    return [request.SerializeToString()]


def metadata_for(service: descriptor.ServiceDescriptor) -> tuple[tuple[str, str], ...]:
    if service is EDGE_BROKER:
        return (("authorization", "Bearer alice.secret-key-of-alice-0123456789"),)
    return (("authorization", f"Bearer {JOIN_TOKEN}"),)


async def call(
    channel: grpc.aio.Channel, method: descriptor.MethodDescriptor, messages: list[bytes]
) -> grpc.StatusCode:
    """One call; its status, which must not be UNKNOWN or INTERNAL, with a short, clean
    message."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    code, details = await call_raw(
        channel, method, messages, metadata_for(method.containing_service), CALL_TIMEOUT_S
    )
    assert code not in NEVER, f"{path}: {code.name} {details!r}"
    assert len(details) <= MESSAGE_CHARS + 100, f"{path}: a {len(details)}-character message"
    assert "\x1b" not in details and "Traceback" not in details, (path, details[:200])
    return code


async def ops_get(cluster: Cluster, path: str) -> Any:
    """A 200 answer of the broker's ops API, with the ops token it wrote to its state dir."""
    headers = ops_headers(cluster.root / "broker-state" / "ops-token")
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.get(f"http://127.0.0.1:{cluster.ops_port}{path}") as response,
    ):
        assert response.status == 200, f"{path}: {response.status} {await response.text()}"
        return await response.json()


async def state(cluster: Cluster) -> tuple[Any, ...]:
    """The broker's deployments, nodes and migrations as its ops API lists them (without the
    heartbeat age, which changes by itself)."""
    nodes = await ops_get(cluster, "/api/nodes")
    for node in nodes:
        node.pop("last_heartbeat_age_s")
    return (
        await ops_get(cluster, "/api/deployments"),
        nodes,
        await ops_get(cluster, "/api/migrations"),
    )


@dataclass(frozen=True)
class Running:
    """The cluster under test and its real values."""

    cluster: Cluster
    deployment_id: str
    model_sha256: str


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    """A broker, node-a (process runtime) and one running deployment of alice's."""
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        await cluster.start_node(THREE_NODES[0])
        async with cluster.edge("alice") as alice:
            sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
            deployment = await alice.deploy(
                model_sha256=sha, model_name="mlp", gpus=1, site="site-a"
            )
        yield Running(cluster, deployment.deployment_id, sha)
    finally:
        await cluster.stop()


async def test_fuzzed_fields_and_bytes_never_answer_unknown_or_internal(running: Running) -> None:
    cluster = running.cluster
    known = known_values(running.deployment_id, running.model_sha256)
    seen: dict[str, set[str]] = {}
    async with grpc.aio.insecure_channel(
        cluster.broker_address,
        options=[("grpc.max_send_message_length", 8 * 1024 * 1024)],
    ) as channel:
        before = await state(cluster)
        for method in METHODS:
            rng = random.Random(method.full_name)
            calls = random_requests(method, rng, known, FIELD_CALLS, BYTES_CALLS)
            valid = valid_request(method.name, running.deployment_id, running.model_sha256)
            if valid is not None:
                calls += [one_field_off(method, valid, rng, known) for _ in range(FIELD_CALLS)]
            for messages in calls:
                code = await call(channel, method, messages)
                seen.setdefault(method.full_name, set()).add(code.name)
                after = await state(cluster)
                if code is not grpc.StatusCode.OK:
                    assert after == before, f"a refused {method.name} changed the state"
                before = after
        assert cluster.broker is not None and cluster.broker.poll() is None, "the broker died"
        # Still serving: a plain call answers.
        listed = await pb_grpc.EdgeBrokerStub(channel).ListDeployments(
            pb.ListDeploymentsRequest(), metadata=metadata_for(EDGE_BROKER), timeout=10
        )
    assert isinstance(listed, pb.ListDeploymentsResponse)
    assert isinstance(await ops_get(cluster, "/api/migrations"), list)
    # Every RPC refused something with INVALID_ARGUMENT (the bytes that do not parse, at least).
    assert len(seen) == len(METHODS)
    assert all("INVALID_ARGUMENT" in codes for codes in seen.values()), seen


DEPLOY = {"model_sha256": "0" * 64, "model_name": "mlp", "gpus": 1, "site": "site-a"}
OFFLOAD = {"session": "0123456789abcdef", "policy": "fastest", "remote_reachable": True}
ATTACKS = {
    "NaN latency_slo_ms": ("Deploy", {**DEPLOY, "latency_slo_ms": math.nan}, "0..60000"),
    "inf cpus": ("Deploy", {**DEPLOY, "cpus": math.inf}, "cpus must be a finite number"),
    "cpus=1e308": ("Deploy", {**DEPLOY, "cpus": 1e308}, "cpus must be a finite number"),
    "memory_mib=2^63-1": ("Deploy", {**DEPLOY, "memory_mib": 2**63 - 1}, "memory_mib must"),
    "unknown priority": ("Deploy", {**DEPLOY, "priority": 99}, "priority 99"),
    "inf longest_gap_ms": (
        "ReportObservation",
        {"deployment_id": "d-1", "migration_id": "m-1", "longest_gap_ms": math.inf},
        "longest_gap_ms must be a finite number within 0..3.6e+06",
    ),
    "NaN span_gap_ms": (
        "ReportObservation",
        {
            "deployment_id": "d-1",
            "migration_id": "m-1",
            "longest_gap_ms": 1.0,
            "span_gap_ms": math.nan,
        },
        "span_gap_ms must be a finite number within 0..3.6e+06",
    ),
    "span_gap_ms under longest_gap_ms": (
        "ReportObservation",
        {
            "deployment_id": "d-1",
            "migration_id": "m-1",
            "longest_gap_ms": 90.0,
            "span_gap_ms": 20.0,
        },
        "span_gap_ms must be at least longest_gap_ms (90), not 20",
    ),
    "NaN offload estimate": (
        "ReportObservation",
        {"deployment_id": "d-1", "offload": {**OFFLOAD, "remote_estimate_ms": math.nan}},
        "offload.remote_estimate_ms must be a finite number within 0..3.6e+06",
    ),
    "huge offload count": (
        "ReportObservation",
        {
            "deployment_id": "d-1",
            "offload": {
                **OFFLOAD,
                "decisions": [{"target": "local", "reason": "faster", "requests": 2**62}],
                "local_requests": 2**62,
            },
        },
        "offload.decisions[0].requests must be within 0..2147483648",
    ),
    "unknown offload reason": (
        "ReportObservation",
        {
            "deployment_id": "d-1",
            "offload": {
                **OFFLOAD,
                "decisions": [{"target": "local", "reason": "x" * 5000, "requests": 1}],
                "local_requests": 1,
            },
        },
        "offload.decisions[0].reason 'xxxx",
    ),
    "report of nothing": (
        "ReportObservation",
        {"deployment_id": "d-1"},
        "neither a migration_id",
    ),
    "AckSwitch epoch -1": ("AckSwitch", {"deployment_id": "d-1", "epoch": -1}, "epoch must"),
    "port 99999": (
        "Register",
        {"node_id": "node-zz", "address": "127.0.0.1:99999", "site": "site-a"},
        "port 1..65535",
    ),
    "7 MB id": ("GetDeployment", {"deployment_id": "d" * 7_000_000}, "(7000000 characters)"),
}


@pytest.mark.parametrize("attack", ATTACKS)
async def test_the_attackers_values_are_refused_naming_the_field(
    tmp_path: Path, attack: str
) -> None:
    method_name, fields, expected = ATTACKS[attack]
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        service = NODE_REGISTRY if method_name == "Register" else EDGE_BROKER
        method = service.methods_by_name[method_name]
        request = GetMessageClass(method.input_type)(**fields)
        async with grpc.aio.insecure_channel(cluster.broker_address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary(f"/{service.full_name}/{method_name}")(
                    request.SerializeToString(),
                    metadata=metadata_for(service),
                    timeout=CALL_TIMEOUT_S,
                )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        details = caught.value.details() or ""
        assert expected in details, details
        assert len(details) < 200, details
        assert isinstance(await ops_get(cluster, "/api/migrations"), list)
    finally:
        await cluster.stop()
