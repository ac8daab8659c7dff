"""Services (issue 52): one model published once for many clients. A real broker, real node
daemons and process replicas of a real ONNX model; clients through the SDK
(`OffloadClient.use_service`) and the `offload service` command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import onnxruntime as ort
import pytest

import modelzoo
from edge_client.client import OffloadClient
from edge_client.errors import (
    AlreadyExists,
    InvalidInput,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from edge_client.rpc.tensors import infer_request
from protos.inference import grpc_service_pb2_grpc as infer_grpc
from protos.offload.v1 import broker_pb2 as pb
from runtime.tls import open_channel
from tests.cluster_support import CLUSTER_YAML, THREE_NODES, Cluster, EdgeClient, wait_for_log

CLIENTS = ("alice", "bob", "carol")
"""alice owns the service; bob may use it; carol may not."""


@contextlib.asynccontextmanager
async def started_cluster(
    tmp_path: Path, *broker_flags: str, cluster_yaml: str = CLUSTER_YAML
) -> AsyncIterator[Cluster]:
    """A broker (with `broker_flags` and the cluster file `cluster_yaml`) and three nodes,
    the clients' keys; stopped after."""
    cluster = Cluster(tmp_path, cluster_yaml=cluster_yaml)
    cluster.api_keys = {c: f"{c}.secret-key-of-{c}-0123456789" for c in CLIENTS}
    try:
        await cluster.start_broker(*broker_flags)
        await asyncio.gather(*(cluster.start_node(plan) for plan in THREE_NODES))
        yield cluster
    finally:
        await cluster.stop()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with started_cluster(tmp_path) as cluster:
        yield cluster


def _reference(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(modelzoo.model_path("mlp")))
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


async def _replica_refuses(endpoint: str, token: str) -> bool:
    """Whether the replica at `endpoint` refuses `token` (UNAUTHENTICATED)."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path("mlp"))
    async with open_channel(endpoint, None) as channel:
        try:
            await infer_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                infer_request("mlp", inputs),
                metadata=(("authorization", f"Bearer {token}"),),
                timeout=10,
            )
        except grpc.aio.AioRpcError as err:
            assert err.code() is grpc.StatusCode.UNAUTHENTICATED, err
            return True
    return False


async def test_clients_of_a_service_share_one_replica_each_with_a_token_of_its_own(
    cluster: Cluster,
) -> None:
    model = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(model, batch=2)
    expected = _reference(inputs)
    keys = cluster.api_keys
    async with (
        OffloadClient(cluster.broker_address, keys["alice"]) as alice,
        OffloadClient(cluster.broker_address, keys["bob"]) as bob,
        OffloadClient(cluster.broker_address, keys["carol"]) as carol,
    ):
        sha = await alice.upload_model(model)
        service = await alice.create_service("detector", sha, "mlp", gpus=1, clients=["bob"])
        assert (service.name, service.owner, len(service.replicas)) == ("detector", "alice", 0)
        with pytest.raises(AlreadyExists, match="exists already"):
            await alice.create_service("detector", sha, "mlp", gpus=1)

        mine = await alice.use_service("detector", site="site-a")
        theirs = await bob.use_service("detector", site="site-a", priority="critical")
        # One replica for both: started for the first, taken by the second too.
        assert mine.deployment_id == theirs.deployment_id
        assert (mine.endpoint, mine.node_id) == (theirs.endpoint, theirs.node_id)
        assert mine.node_id == "node-a"  # site-a's node: the nearest
        assert mine.token != theirs.token
        for client in (alice, bob):
            outputs = await client.infer(inputs)
            for name, array in expected.items():
                np.testing.assert_allclose(outputs[name], array, rtol=1e-5, atol=1e-6)

        with pytest.raises(PermissionDenied, match="does not allow client carol"):
            await carol.use_service("detector", site="site-a")
        with pytest.raises(NotFound):
            await carol.get_service("detector")
        assert [s.name for s in await carol.list_services()] == []
        shown = await bob.get_service("detector")
        assert [(r.deployment_id, r.clients) for r in shown.replicas] == [(mine.deployment_id, 2)]
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{cluster.ops_port}/metrics") as page,
        ):
            metrics = await page.text()
        assert 'offload_service_replicas{service="detector",site="site-a"} 1.0' in metrics
        assert 'offload_service_clients{service="detector"} 2.0' in metrics
        with pytest.raises(PermissionDenied, match="only it deletes it"):
            await bob.delete_service("detector")
        with pytest.raises(InvalidInput, match="site"):
            await bob.use_service("detector", site="nowhere")

        # Attaching again gives bob a new token: the replica stops taking the old one.
        again = await bob.use_service("detector", site="site-a")
        assert again.deployment_id == mine.deployment_id and again.token != theirs.token
        await until_refused(again.endpoint, theirs.token)
        await bob.infer(inputs)

        await alice.delete_service("detector")
        with pytest.raises(NotFound):
            await alice.get_service("detector")
        async with cluster.edge("alice") as edge:
            assert [d.deployment_id for d in await edge.list()] == []  # its replica deleted


async def until_refused(endpoint: str, token: str) -> None:
    """Until the replica refuses `token` (it re-reads its clients file twice a second)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not await _replica_refuses(endpoint, token):
        assert loop.time() < deadline, "the replica still takes the old token"
        await asyncio.sleep(0.1)


async def test_a_service_replica_stays_at_its_site_when_its_owner_moves(
    cluster: Cluster,
) -> None:
    """The owner's ReportLocation moves the owner's own deployments, not a service's
    replica, which serves the clients of its site."""
    model = modelzoo.model_path("mlp")
    async with OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice:
        sha = await alice.upload_model(model)
        await alice.create_service("commons", sha, "mlp", gpus=1, any_client=True)
        replica = await alice.use_service("commons", site="site-a")
        own = await alice.deploy(sha, "mlp", gpus=1, site="site-a")
        assert own.node_id == replica.node_id == "node-a"
        await alice.report_location("site-c")
        async with cluster.edge("alice") as edge:
            await until_moved(edge, own.deployment_id)
            assert (await edge.get(replica.deployment_id)).node_id == "node-a"
            assert (await edge.get(replica.deployment_id)).epoch == 1  # never moved


async def until_moved(edge: EdgeClient, deployment_id: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while (current := await edge.get(deployment_id)).node_id == "node-a":
        assert loop.time() < deadline, f"{deployment_id} still on node-a ({current.state})"
        await asyncio.sleep(0.1)


async def test_the_service_command_creates_shows_lists_and_deletes(
    cluster: Cluster, tmp_path: Path
) -> None:
    key_file = tmp_path / "alice.key"
    key_file.write_text(cluster.api_keys["alice"])
    base = ["--broker", cluster.broker_address, "--api-key-file", str(key_file)]

    async def offload(*args: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "edge_client.cli", "service", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    model = str(modelzoo.model_path("mlp"))
    created = await offload(
        "create", "cams", model, "--gpus", "1", "--min-replicas-per-site", "1",
        "--max-replicas", "3", "--any-client", "--json", *base,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    shown = json.loads(created.stdout)
    assert shown["clients"] == "any"
    assert sorted(r["site"] for r in shown["replicas"]) == ["site-a", "site-b", "site-c"]
    assert all(r["state"] == "running" for r in shown["replicas"])
    # Each replica's start is explained, with its site.
    assert sorted((e["action"], e["site"]) for e in shown["events"]) == [
        ("start", "site-a"), ("start", "site-b"), ("start", "site-c")
    ]  # fmt: skip
    assert all("min_replicas_per_site 1" in e["reason"] for e in shown["events"])
    text = await offload("show", "cams", *base)
    assert text.returncode == 0 and "scale decisions (most recent last):" in text.stdout
    assert text.stdout.count(" start ") == 3, text.stdout
    listed = await offload("list", "--json", *base)
    assert [s["name"] for s in json.loads(listed.stdout)] == ["cams"]
    bad = await offload("create", "Bad_Name", model, *base)
    assert bad.returncode == 1 and "lowercase" in bad.stderr
    too_few = await offload(
        "create", "cams2", model, "--min-replicas-per-site", "1", "--max-replicas", "2", *base
    )
    assert too_few.returncode == 1 and "max_replicas of at least 3" in too_few.stderr
    deleted = await offload("delete", "cams", *base)
    assert deleted.returncode == 0, deleted.stderr
    gone = await offload("show", "cams", *base)
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr


async def test_a_client_key_cannot_read_another_clients_service_replica(
    cluster: Cluster,
) -> None:
    """The replicas are the owner's deployments: another client sees none of them, nor
    their tokens, through the deployment calls."""
    async with OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice:
        sha = await alice.upload_model(modelzoo.model_path("mlp"))
        await alice.create_service("private", sha, "mlp", clients=["bob"])
        replica = await alice.use_service("private", site="site-b")
    async with cluster.edge("bob") as bob:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await bob.get(replica.deployment_id)
        assert refused.value.code() is grpc.StatusCode.NOT_FOUND
        listed = await bob.stub.ListDeployments(pb.ListDeploymentsRequest(), metadata=bob.metadata)
        assert list(listed.deployments) == []
    with pytest.raises(Unauthenticated):
        async with OffloadClient(cluster.broker_address, "bob.wrong-0123456789") as wrong:
            await wrong.use_service("private", site="site-b")


async def test_a_revoked_key_s_token_is_refused_by_the_replica(cluster: Cluster) -> None:
    """bob's API key removed (SIGHUP): the broker takes bob off the service's replica, which
    refuses his token from then on; alice, on the same replica, goes on."""
    keys = cluster.api_keys
    inputs = modelzoo.sample_inputs(modelzoo.model_path("mlp"))
    async with (
        OffloadClient(cluster.broker_address, keys["alice"]) as alice,
        OffloadClient(cluster.broker_address, keys["bob"]) as bob,
    ):
        sha = await alice.upload_model(modelzoo.model_path("mlp"))
        await alice.create_service("fleet", sha, "mlp", clients=["bob"])
        mine = await alice.use_service("fleet", site="site-c")
        his = await bob.use_service("fleet", site="site-c")
        assert his.deployment_id == mine.deployment_id
        await bob.infer(inputs)
        (cluster.root / "api-keys").write_text(f"{keys['alice']}\n{keys['carol']}\n")
        offset = cluster.broker_log.stat().st_size
        assert cluster.broker is not None
        cluster.broker.send_signal(signal.SIGHUP)
        await wait_for_log(
            cluster.broker_log,
            r"service=fleet client=bob taken off deployment=",
            after=offset,
        )
        await until_refused(his.endpoint, his.token)
        await alice.infer(inputs)
        assert (await alice.get_service("fleet")).clients == 1


async def test_a_move_to_a_site_whose_replica_runs_is_a_switch_with_no_failed_request(
    cluster: Cluster,
) -> None:
    """A replica at every site (`--min-replicas-per-site 1`): the client reports site-b and
    its calls go to site-b's replica (node-b), no replica started, while a closed loop of
    calls runs across the switch without a failure."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path("mlp"))
    keys = cluster.api_keys
    async with (
        OffloadClient(cluster.broker_address, keys["alice"]) as alice,
        OffloadClient(cluster.broker_address, keys["bob"]) as bob,
    ):
        sha = await alice.upload_model(modelzoo.model_path("mlp"))
        created = await alice.create_service(
            "everywhere", sha, "mlp", clients=["bob"], min_replicas_per_site=1, max_replicas=3
        )
        replicas = {r.site: r.deployment_id for r in created.replicas}
        assert sorted(replicas) == ["site-a", "site-b", "site-c"]
        first = await bob.use_service("everywhere", site="site-a")
        assert (first.deployment_id, first.node_id) == (replicas["site-a"], "node-a")

        async with calling(inputs, bob) as answered:
            await until_answered(lambda: answered[0], 20)
            assert await bob.report_location("site-b") is None  # no migration: a switch
            await until_on(bob, replicas["site-b"])
            before = answered[0]
            await until_answered(lambda: answered[0], before + 20)
        current = bob.deployment
        assert current is not None and current.node_id == "node-b"
        service = await alice.get_service("everywhere")
        assert len(service.replicas) == 3  # none started for the move
        assert {r.deployment_id: r.clients for r in service.replicas}[replicas["site-b"]] == 1


@contextlib.asynccontextmanager
async def calling(
    inputs: dict[str, np.ndarray], *clients: OffloadClient
) -> AsyncIterator[list[int]]:
    """Each client calls in a closed loop until the block ends; yields the calls each has
    had answered so far. A failed call raises at the block's end, failing the test."""
    answered = [0] * len(clients)
    stop = asyncio.Event()

    async def closed_loop(index: int, client: OffloadClient) -> None:
        while not stop.is_set():
            await client.infer(inputs)
            answered[index] += 1

    loops = [asyncio.create_task(closed_loop(i, c)) for i, c in enumerate(clients)]
    try:
        yield answered
    finally:
        stop.set()
        await asyncio.gather(*loops)


async def until_answered(count: Callable[[], int], at_least: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while count() < at_least:
        assert loop.time() < deadline, f"{count()} calls answered, not {at_least}"
        await asyncio.sleep(0.02)


async def until_on(client: OffloadClient, deployment_id: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while (current := client.deployment) is None or current.deployment_id != deployment_id:
        assert loop.time() < deadline, f"still on {current}"
        await asyncio.sleep(0.02)


async def test_a_service_replica_placed_again_after_its_node_is_lost_takes_its_clients(
    cluster: Cluster,
) -> None:
    """node-a's daemon and the replica on it SIGKILLed: the broker places the replica again
    on another node, gives it the same clients, and the client's calls follow it there with
    the token it had."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path("mlp"))
    async with OffloadClient(cluster.broker_address, cluster.api_keys["bob"]) as bob:
        async with OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice:
            sha = await alice.upload_model(modelzoo.model_path("mlp"))
            await alice.create_service("sturdy", sha, "mlp", gpus=1, clients=["bob"])
        on = await bob.use_service("sturdy", site="site-a")
        assert on.node_id == "node-a"
        await bob.infer(inputs)
        async with cluster.edge("alice") as edge:
            replica = await edge.get(on.deployment_id)
        os.kill(cluster.replica_pid(replica), signal.SIGKILL)
        cluster.nodes["node-a"].send_signal(signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        while (current := bob.deployment) is None or current.node_id in ("", "node-a"):
            assert loop.time() < deadline, f"still {current}"
            await asyncio.sleep(0.1)
        assert current.deployment_id == on.deployment_id and current.token == on.token
        await bob.infer(inputs)


async def test_the_clients_of_a_lost_replica_fail_over_to_a_running_one(
    cluster: Cluster,
) -> None:
    """A replica at every site, any in reach: node-a's daemon and bob's replica on it
    SIGKILLed, the broker marks node-a lost and moves bob at once to another running
    replica of the service (he need not wait for a new start), where his calls work with
    the token he had."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path("mlp"))
    async with OffloadClient(cluster.broker_address, cluster.api_keys["bob"]) as bob:
        async with OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice:
            sha = await alice.upload_model(modelzoo.model_path("mlp"))
            service = await alice.create_service(
                "spread", sha, "mlp", clients=["bob"], min_replicas_per_site=1
            )
        others = {r.deployment_id for r in service.replicas if r.node_id != "node-a"}
        on = await bob.use_service("spread", site="site-a")
        assert on.node_id == "node-a" and len(others) == 2
        await bob.infer(inputs)
        async with cluster.edge("alice") as edge:
            replica = await edge.get(on.deployment_id)
        os.kill(cluster.replica_pid(replica), signal.SIGKILL)
        cluster.nodes["node-a"].send_signal(signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        while (current := bob.deployment) is None or current.deployment_id not in others:
            assert loop.time() < deadline, f"still {current}"
            await asyncio.sleep(0.1)
        assert current.token == on.token and current.node_id in ("node-b", "node-c")
        await bob.infer(inputs)
    await wait_for_log(
        cluster.broker_log,
        re.escape(f"service=spread failed 1 client(s) over from deployment={on.deployment_id}"),
    )


async def test_services_and_assignments_survive_a_broker_sigkill(cluster: Cluster) -> None:
    """The broker SIGKILLed and started again on its state: the service, its replica and
    who is on it are still there; the replica serves its clients throughout; a client
    moves and attaches as before."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path("mlp"))
    keys = cluster.api_keys
    async with (
        OffloadClient(cluster.broker_address, keys["alice"]) as alice,
        OffloadClient(cluster.broker_address, keys["bob"]) as bob,
    ):
        sha = await alice.upload_model(modelzoo.model_path("mlp"))
        await alice.create_service(
            "durable", sha, "mlp", clients=["bob"], min_replicas_per_site=1, max_replicas=3
        )
        on = await bob.use_service("durable", site="site-a")
        before = await alice.get_service("durable")
        cluster.kill_broker()
        await bob.infer(inputs)  # the replica needs no broker
        await cluster.start_broker()
        after = await alice.get_service("durable")
        assert [(r.deployment_id, r.clients) for r in after.replicas] == [
            (r.deployment_id, r.clients) for r in before.replicas
        ]
        assert after.clients == 1
        await bob.infer(inputs)
        await bob.report_location("site-b")
        site_b = next(r.deployment_id for r in after.replicas if r.site == "site-b")
        await until_on(bob, site_b)
        await bob.infer(inputs)
        assert (await alice.use_service("durable", site="site-c")).node_id == "node-c"
        assert on.deployment_id != site_b


async def test_a_move_starts_a_replica_where_none_is_in_reach_and_the_idle_one_stops(
    tmp_path: Path,
) -> None:
    """A 5 ms SLO and sites 10 ms apart: bob's move to site-b starts a replica there
    (make-before-break: he keeps site-a's meanwhile, no call fails), and site-a's, with no
    client left, stops after --service-idle-grace."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path("mlp"))
    async with (
        started_cluster(tmp_path, "--service-idle-grace", "1") as cluster,
        OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice,
        OffloadClient(cluster.broker_address, cluster.api_keys["bob"]) as bob,
    ):
        sha = await alice.upload_model(modelzoo.model_path("mlp"))
        await alice.create_service("near", sha, "mlp", clients=["bob"], latency_slo_ms=5)
        first = await bob.use_service("near", site="site-a")
        assert first.node_id == "node-a"
        async with calling(inputs, bob) as answered:
            await until_answered(lambda: answered[0], 10)
            await bob.report_location("site-b")
            service = await alice.get_service("near")
            started = next(r.deployment_id for r in service.replicas if r.site == "site-b")
            await until_on(bob, started)
            before = answered[0]
            await until_answered(lambda: answered[0], before + 10)
        deadline = asyncio.get_running_loop().time() + 60
        while len((service := await alice.get_service("near")).replicas) > 1:
            assert asyncio.get_running_loop().time() < deadline, service
            await asyncio.sleep(0.2)
        assert [r.deployment_id for r in service.replicas] == [started]
        # Every scale decision explained, in order: the first replica (bob's attach),
        # site-b's (his move, beyond the SLO), site-a's stopped once idle.
        decisions = [(e.action, e.deployment_id, e.site) for e in service.events]
        assert decisions == [
            ("start", first.deployment_id, "site-a"),
            ("start", started, "site-b"),
            ("stop", first.deployment_id, "site-a"),
        ], service.events
        reasons = [e.reason for e in service.events]
        assert "a client at site-a needs a replica: none runs yet" in reasons[0]
        assert "none within 5 ms of site-b" in reasons[1]
        assert "no client on it for" in reasons[2] and "--service-idle-grace" in reasons[2]
        current = bob.deployment
        assert current is not None and current.node_id == "node-b"
        await bob.infer(inputs)


async def scaled_beside_a_busy_replica(
    cluster: Cluster, name: str, latency_slo_ms: float = 0.0
) -> pb.ServiceEvent:
    """alice creates service `name` (max_replicas 2), she and bob attach at site-a and call
    its replica in closed loops until the broker starts a second beside it. Checks that the
    second runs at site-a, bob (attached last: the half that moves) is switched to it and
    alice stays, both keep being answered (no call fails), and no third starts, and that
    the scale-up's event names the busy replica and its clients. That event."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path("mlp"))
    async with (
        OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice,
        OffloadClient(cluster.broker_address, cluster.api_keys["bob"]) as bob,
    ):
        sha = await alice.upload_model(modelzoo.model_path("mlp"))
        await alice.create_service(
            name, sha, "mlp", clients=["bob"], max_replicas=2, latency_slo_ms=latency_slo_ms
        )
        first = await alice.use_service(name, site="site-a")
        assert (await bob.use_service(name, site="site-a")).deployment_id == first.deployment_id
        async with calling(inputs, alice, bob) as answered:
            deadline = asyncio.get_running_loop().time() + 90
            while len((service := await alice.get_service(name)).replicas) < 2:
                assert asyncio.get_running_loop().time() < deadline, service
                await asyncio.sleep(0.2)
            second = next(
                r.deployment_id for r in service.replicas if r.deployment_id != first.deployment_id
            )
            # bob attached last: he is the half that moves.
            await until_on(bob, second)
            before = list(answered)
            await until_answered(lambda: answered[1], before[1] + 10)  # bob's
            await until_answered(lambda: answered[0], before[0] + 10)  # alice's
        current = alice.deployment
        assert current is not None and current.deployment_id == first.deployment_id
        service = await alice.get_service(name)
        assert sorted(r.clients for r in service.replicas) == [1, 1]
        assert all(r.site == "site-a" for r in service.replicas)
        scale = service.events[-1]
        assert (scale.action, scale.deployment_id, scale.site) == ("start", second, "site-a")
        assert f"replica {first.deployment_id}" in scale.reason, scale.reason
        assert "2 clients" in scale.reason, scale.reason
        # At max_replicas 2 no third one starts, however busy they stay.
        assert len(service.replicas) == 2
        return scale


async def test_a_replica_over_its_queue_target_gets_another_and_half_its_clients(
    tmp_path: Path,
) -> None:
    """A queue target below any queue delay (0.01 ms: the runtime's smallest histogram bucket
    is 0.1 ms), so the replica two clients call in loops is over it in every sample: after
    the 5 s it must be sustained, a second replica starts at its site, one of the two
    clients is switched to it with no failed call, and the decision is explained."""
    async with started_cluster(tmp_path, "--service-queue-target-ms", "0.01") as cluster:
        scale = await scaled_beside_a_busy_replica(cluster, "busy")
    assert "queue delay p99" in scale.reason, scale.reason
    assert "past the 0.01 ms target by at least" in scale.reason, scale.reason
    assert "latency" not in scale.reason, scale.reason  # the service has no SLO


ZERO_ACCESS_CLUSTER = CLUSTER_YAML + "nodes:\n  node-a: {site: site-a, latency_ms: 0}\n"
"""The demo's cluster with node-a 0 ms from its site: a replica there is within any latency
SLO of site-a's clients."""


async def test_a_replica_past_its_services_latency_slo_gets_another_and_half_its_clients(
    tmp_path: Path,
) -> None:
    """A latency SLO below any request's latency (0.01 ms: the runtime's smallest latency
    bucket is 0.1 ms) and the queue target out of reach (60 s: past the largest bucket), so
    only the SLO can make the replica two clients call in loops over its load: a second
    replica starts beside it, as for the queue target, and the decision names the SLO and
    by how much its latency passed it. node-a is 0 ms from site-a (its replica within the
    SLO's reach: otherwise bob's attach would start the second)."""
    flags = ("--service-queue-target-ms", "60000")
    async with started_cluster(tmp_path, *flags, cluster_yaml=ZERO_ACCESS_CLUSTER) as cluster:
        scale = await scaled_beside_a_busy_replica(cluster, "slow", latency_slo_ms=0.01)
    assert "latency p99" in scale.reason, scale.reason
    assert "past the 0.01 ms latency SLO by at least" in scale.reason, scale.reason
    assert "queue delay" not in scale.reason, scale.reason


async def test_a_scale_up_the_owner_has_no_room_for_is_logged_and_serving_goes_on(
    tmp_path: Path,
) -> None:
    """As the queue-target test, but the owner may hold one deployment: the replica beside
    the busy one is refused (its quota), the broker says so for that service alone (the
    round goes on), and both clients keep being served by the one replica."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path("mlp"))
    flags = ("--service-queue-target-ms", "0.01", "--max-deployments-per-client", "1")
    async with (
        started_cluster(tmp_path, *flags) as cluster,
        OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice,
        OffloadClient(cluster.broker_address, cluster.api_keys["bob"]) as bob,
    ):
        sha = await alice.upload_model(modelzoo.model_path("mlp"))
        await alice.create_service("tight", sha, "mlp", clients=["bob"], max_replicas=2)
        first = await alice.use_service("tight", site="site-a")
        await bob.use_service("tight", site="site-a")
        async with calling(inputs, alice, bob):
            await wait_for_log(
                cluster.broker_log,
                re.escape("service=tight: no replica started beside a busy one:"),
                timeout_s=90,
            )
        service = await alice.get_service("tight")
        assert [r.deployment_id for r in service.replicas] == [first.deployment_id]
        assert [r.clients for r in service.replicas] == [2]
        for client in (alice, bob):
            await client.infer(inputs)


async def test_a_flooding_client_is_paced_then_refused_and_the_quiet_one_is_not(
    cluster: Cluster,
) -> None:
    """Per-client limits on one replica for both: bob floods it (60 calls at once, at most
    4 a second each client), alice calls it now and then. bob is refused past his rate
    (RESOURCE_EXHAUSTED) after his second's burst and the calls paced within 0.25 s; alice,
    under her own limit, is never refused."""
    inputs = modelzoo.sample_inputs(modelzoo.model_path("mlp"))
    async with (
        OffloadClient(cluster.broker_address, cluster.api_keys["alice"]) as alice,
        OffloadClient(cluster.broker_address, cluster.api_keys["bob"]) as bob,
    ):
        sha = await alice.upload_model(modelzoo.model_path("mlp"))
        await alice.create_service("limited", sha, "mlp", clients=["bob"], max_rps_per_client=4)
        mine = await alice.use_service("limited", site="site-a")
        assert (await bob.use_service("limited", site="site-a")).deployment_id == (
            mine.deployment_id
        )

        async def outcome(client: OffloadClient) -> str:
            try:
                await client.infer(inputs)
            except ResourceExhausted as err:
                assert "over its rate limit of 4 requests/s" in str(err), err
                return "refused"
            return "answered"

        flood = asyncio.gather(*(outcome(bob) for _ in range(60)))
        quiet = [await outcome(alice) for _ in range(3)]
        flooded = await flood
    assert quiet == ["answered"] * 3
    # His burst (4) and the call paced within RATE_WAIT_S (one at 4/s) at least; the rest,
    # whose tokens were seconds away, refused at once.
    assert flooded.count("answered") >= 5, flooded
    assert flooded.count("refused") >= 30, flooded
