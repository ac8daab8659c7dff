"""A broker and three node daemons on loopback, as real processes (issue 4's scenarios)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import grpc
import psycopg
import pytest

import modelzoo
from common.content import file_sha256
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from protos.offload.v1 import node_pb2 as npb
from protos.offload.v1 import node_pb2_grpc as npb_grpc
from tests.chromium_support import DomDump, log_in, open_page, require_chromium
from tests.cluster_support import (
    CLUSTER_YAML,
    JOIN_TOKEN,
    THREE_NODES,
    Cluster,
    free_port,
    infer_once,
    wait_for_log,
)
from tests.ops_support import ops_headers


@pytest.fixture
async def cluster(tmp_path: Path, broker_state: str) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path, state=broker_state)
    try:
        await cluster.start_broker()
        await asyncio.gather(*(cluster.start_node(plan) for plan in THREE_NODES))
        yield cluster
    finally:
        await cluster.stop()


async def test_placement_follows_the_client_and_the_topology(cluster: Cluster) -> None:
    async with cluster.edge("alice") as alice:
        uploaded = await alice.upload(modelzoo.model_path("mlp"))
        sha = uploaded.sha256
        # 4 GPUs with P2P from site-a: node-a's 4 free PCIe GPUs (NODE/SYS) cannot, so it goes
        # to the nearest NVLink group.
        p2p = await alice.deploy(
            model_sha256=sha, model_name="mlp", gpus=4, p2p_required=True, site="site-a"
        )
        assert p2p.node_id == "node-b"
        assert json.loads(p2p.explanation_json)["chosen"]["gpus"] in ([0, 1, 2, 3], [4, 5, 6, 7])
        explanation = json.loads(p2p.explanation_json)
        assert (
            explanation["rejected_counts"].get(
                "no P2P-capable group (NVLink, PIX or PXB) among its free GPUs"
            )
            == 1
        ), explanation
        await infer_once(p2p)
        # A client at each site lands on the node at that site (the nearest that fits; node-b
        # still has 4 GPUs free).
        for site, node in (("site-a", "node-a"), ("site-b", "node-b"), ("site-c", "node-c")):
            deployment = await alice.deploy(model_sha256=sha, model_name="mlp", gpus=1, site=site)
            assert (deployment.node_id, deployment.state) == (node, "running")
            explanation = json.loads(deployment.explanation_json)
            assert explanation["chosen"]["node_id"] == node
            assert "latency" in explanation["deciding"], explanation
            await infer_once(deployment)


def _ops_token_file(cluster: Cluster) -> Path:
    """The ops token the broker wrote to its state dir (it runs without --ops-token-file)."""
    return cluster.root / "broker-state" / "ops-token"


async def _ops(cluster: Cluster, path: str) -> list[dict]:
    async with (
        aiohttp.ClientSession(headers=ops_headers(_ops_token_file(cluster))) as http,
        http.get(f"http://127.0.0.1:{cluster.ops_port}{path}") as response,
    ):
        assert response.status == 200
        return await response.json()


async def test_every_refusal_has_its_status_and_changes_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    model = modelzoo.model_path("mlp")
    async with cluster.edge("alice") as alice, cluster.edge("bob") as bob:
        sha = (await alice.upload(model)).sha256
        mine = await alice.deploy(model_sha256=sha, model_name="mlp", gpus=1, site="site-a")
        before = (await _ops(cluster, "/api/deployments"), await _ops(cluster, "/api/nodes"))

        async def refused(call: object, code: grpc.StatusCode, message: str) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call  # type: ignore[misc]
            assert caught.value.code() == code, caught.value.details()
            assert message in caught.value.details(), caught.value.details()

        async with grpc.aio.insecure_channel(cluster.broker_address) as channel:
            registry = pb_grpc.NodeRegistryStub(channel)
            await refused(
                registry.Register(
                    pb.RegisterRequest(node_id="intruder", address="127.0.0.1:1", site="site-a"),
                    metadata=(("authorization", "Bearer not-the-join-token"),),
                ),
                grpc.StatusCode.UNAUTHENTICATED,
                "join token",
            )
            edge = pb_grpc.EdgeBrokerStub(channel)
            await refused(
                edge.ListDeployments(
                    pb.ListDeploymentsRequest(),
                    metadata=(("authorization", "Bearer alice.wrong-secret-0123456789"),),
                ),
                grpc.StatusCode.UNAUTHENTICATED,
                "API key",
            )
        await refused(bob.get(mine.deployment_id), grpc.StatusCode.NOT_FOUND, "not found")
        # A delete names whose it is (the id is random: only one who has it can ask).
        await refused(
            bob.stub.DeleteDeployment(
                pb.DeleteDeploymentRequest(deployment_id=mine.deployment_id),
                metadata=bob.metadata,
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "not yours",
        )
        garbage = tmp_path / "garbage.onnx"
        garbage.write_bytes(b"this is not an ONNX model" * 100)
        await refused(alice.upload(garbage), grpc.StatusCode.INVALID_ARGUMENT, "ONNX")
        truncated = tmp_path / "truncated.onnx"
        truncated.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
        await refused(alice.upload(truncated), grpc.StatusCode.INVALID_ARGUMENT, "ONNX")
        await refused(
            alice.upload(model, sha="0" * 64), grpc.StatusCode.INVALID_ARGUMENT, "sha256"
        )
        await refused(
            alice.deploy(model_sha256=sha, model_name="mlp", gpus=9, site="site-a"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "the largest node has 8",
        )
        await refused(
            alice.deploy(model_sha256="ab" * 32, model_name="mlp", gpus=1, site="site-a"),
            grpc.StatusCode.NOT_FOUND,
            "not uploaded",
        )
        await refused(
            alice.deploy(model_sha256=sha, model_name="mlp", gpus=1, site="mars"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "site 'mars' is unknown",
        )
        after = (await _ops(cluster, "/api/deployments"), await _ops(cluster, "/api/nodes"))
        for nodes in (before[1], after[1]):
            for node in nodes:
                node.pop("last_heartbeat_age_s")
        assert after == before
        assert [d.deployment_id for d in await alice.list()] == [mine.deployment_id]
        assert await bob.list() == []
        await infer_once(mine)


async def test_broker_killed_and_restarted_keeps_every_deployment_serving(
    cluster: Cluster,
) -> None:
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
        deployments = [
            await alice.deploy(model_sha256=sha, model_name="mlp", gpus=1, site=site)
            for site in ("site-a", "site-b", "site-c")
        ]
    failures: list[str] = []
    successes = 0
    stop = asyncio.Event()

    async def keep_inferring() -> None:
        nonlocal successes
        while not stop.is_set():
            for deployment in deployments:
                try:
                    await infer_once(deployment)
                    successes += 1
                except grpc.aio.AioRpcError as err:
                    failures.append(f"{deployment.deployment_id}: {err.code().name}")
            await asyncio.sleep(0.02)

    load = asyncio.create_task(keep_inferring(), name="inference-load")
    try:
        await asyncio.sleep(0.5)
        cluster.kill_broker()
        during = successes
        # Broker down, the replicas keep serving: long enough (with its restart) for gRPC's
        # default reconnect backoff to have grown past the broker's --lost-after.
        await asyncio.sleep(3.0)
        assert successes > during
        await cluster.start_broker()
        restarted = time.monotonic()
        # The restarted broker reloads the nodes from its state (each as heard from at the
        # load) and hears from each again: a heartbeat age under 0.5 s once a second has
        # passed is a heartbeat, not the load.
        for _ in range(200):
            await asyncio.sleep(0.05)
            nodes = await _ops(cluster, "/api/nodes")
            if (
                time.monotonic() - restarted > 1.0
                and len(nodes) == 3
                and all(n["last_heartbeat_age_s"] < 0.5 for n in nodes)
            ):
                break
        else:
            raise AssertionError(f"nodes did not check in again: {nodes}")
        # Past the broker's --lost-after (3 s) from its start: no node was counted lost.
        await asyncio.sleep(max(0.0, restarted + 3.5 - time.monotonic()))
        nodes = await _ops(cluster, "/api/nodes")
        assert [n["state"] for n in nodes] == ["ready"] * 3, nodes
    finally:
        stop.set()
        await load
    assert not failures, failures
    async with cluster.edge("alice") as alice:
        after = {d.deployment_id: d for d in await alice.list()}
    assert {d.deployment_id: (d.endpoint, d.epoch, d.state) for d in deployments} == {
        k: (d.endpoint, d.epoch, d.state) for k, d in after.items()
    }
    # No duplicate replicas: each node runs exactly the replica it ran before.
    nodes = await _ops(cluster, "/api/nodes")
    for node in nodes:
        async with grpc.aio.insecure_channel(node["address"]) as channel:
            listed = await npb_grpc.NodeAgentStub(channel).ListReplicas(
                npb.ListReplicasRequest(),
                metadata=cluster.agent_metadata(node["node_id"]),
            )
        expected = [
            f"{d.deployment_id}-{d.epoch}" for d in deployments if d.node_id == node["node_id"]
        ]
        assert [r.replica_id for r in listed.replicas] == expected


async def test_priority_preempts_lower_and_never_equal(cluster: Cluster) -> None:
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
        # Fill every GPU of every node with best-effort work: 4 + 8 + 8 GPUs.
        low = [
            await alice.deploy(
                model_sha256=sha, model_name="mlp", gpus=4, site="site-a",
                priority=pb.PRIORITY_CLASS_BEST_EFFORT,
            )
            for _ in range(5)
        ]  # fmt: skip
        assert sorted(d.node_id for d in low) == ["node-a", "node-b", "node-b", "node-c", "node-c"]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await alice.deploy(
                model_sha256=sha, model_name="mlp", gpus=4, site="site-a",
                priority=pb.PRIORITY_CLASS_BEST_EFFORT,
            )  # fmt: skip
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        critical = await alice.deploy(
            model_sha256=sha, model_name="mlp", gpus=4, site="site-a",
            priority=pb.PRIORITY_CLASS_CRITICAL,
        )  # fmt: skip
        assert critical.node_id == "node-a"
        evicted = [d for d in await alice.list() if d.state == "pending"]
        assert [d.deployment_id for d in evicted] == [low[0].deployment_id]
        assert f"preempted by {critical.deployment_id}" in evicted[0].reason
        await infer_once(critical)


def _offload(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edge_client.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


async def test_cli_shows_nodes_deployments_and_explanations(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
        deployment = await alice.deploy(model_sha256=sha, model_name="mlp", gpus=2, site="site-c")
    key_file = tmp_path / "alice.key"
    key_file.write_text(cluster.api_keys["alice"])
    env = {"OFFLOAD_BROKER": cluster.broker_address, "OFFLOAD_API_KEY_FILE": str(key_file)}
    ops = f"http://127.0.0.1:{cluster.ops_port}"
    token = str(_ops_token_file(cluster))
    nodes = await asyncio.to_thread(_offload, "nodes", "--ops", ops, "--ops-token-file", token)
    assert nodes.returncode == 0, nodes.stderr
    for node in ("node-a", "node-b", "node-c"):
        assert node in nodes.stdout
    assert "6/8" in nodes.stdout  # node-c gave 2 of its 8 GPUs
    listed = await asyncio.to_thread(_offload, "deployments", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert [d["deployment_id"] for d in json.loads(listed.stdout)] == [deployment.deployment_id]
    explained = await asyncio.to_thread(_offload, "explain", deployment.deployment_id, env=env)
    assert explained.returncode == 0, explained.stderr
    assert "chosen: node-c at site-c, GPUs" in explained.stdout
    assert "deciding: latency" in explained.stdout
    missing = await asyncio.to_thread(_offload, "explain", "d-nope", env=env)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    no_key = await asyncio.to_thread(_offload, "deployments", "--broker", cluster.broker_address)
    assert no_key.returncode == 1 and "--api-key-file" in no_key.stderr


@pytest.mark.parametrize("broker_state", ["sqlite"], indirect=True)
async def test_a_broker_paused_past_lost_after_counts_no_node_lost(cluster: Cluster) -> None:
    """Paused (SIGSTOP) longer than --lost-after (3 s) while the nodes heartbeat: resumed, it
    has their heartbeats waiting unread and its lost-node check due at once. It allows the
    silence its own lateness explains (`broker.loop_lag`) and counts no node lost. On SQLite
    only: on PostgreSQL a broker paused past its lease stops leading (test_broker_ha)."""
    assert cluster.broker is not None
    offset = cluster.broker_log.stat().st_size
    cluster.broker.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(4.5)
    finally:
        cluster.broker.send_signal(signal.SIGCONT)
    await asyncio.sleep(2.0)  # two lost-node checks after the resume
    nodes = await _ops(cluster, "/api/nodes")
    assert {n["node_id"]: n["state"] for n in nodes} == dict.fromkeys(
        ("node-a", "node-b", "node-c"), "ready"
    )
    log = cluster.broker_log.read_text()[offset:]
    assert "lost: no heartbeat" not in log
    assert "not lost yet" in log


async def test_lost_nodes_vanished_replicas_and_the_watch_stream(cluster: Cluster) -> None:
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
        deployment = await alice.deploy(model_sha256=sha, model_name="mlp", gpus=1, site="site-a")
        watch = alice.stub.WatchDeployment(
            pb.WatchDeploymentRequest(deployment_id=deployment.deployment_id),
            metadata=alice.metadata,
        )
        current = await watch.read()
        assert (current.epoch, current.endpoint, current.reason) == (
            1,
            deployment.endpoint,
            "current",
        )
        # A replica that vanishes from its node is placed again, at the next epoch, and the
        # watch stream says so.
        killed = cluster.replica_pid(deployment)
        os.kill(int(killed), signal.SIGKILL)
        while (
            update := await asyncio.wait_for(watch.read(), 30)
        ).epoch != 2 or not update.endpoint:
            pass
        assert update.reason == "replaced"
        watch.cancel()
        again = await alice.get(deployment.deployment_id)
        assert (again.epoch, again.state, again.endpoint) == (2, "running", update.endpoint)
        # A new process serves it. Its endpoint may be the old one: the node can be handed the
        # killed replica's port again.
        assert cluster.replica_pid(again) != killed
        await infer_once(again)
        await alice.stub.ReportLocation(
            pb.ReportLocationRequest(site="site-c"), metadata=alice.metadata
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await alice.stub.ReportLocation(
                pb.ReportLocationRequest(site="atlantis"), metadata=alice.metadata
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A node that stops heartbeating is marked lost.
    cluster.nodes["node-b"].send_signal(signal.SIGKILL)
    cluster.nodes["node-b"].wait()
    for _ in range(200):
        states = {n["node_id"]: n["state"] for n in await _ops(cluster, "/api/nodes")}
        if states["node-b"] == "lost":
            break
        await asyncio.sleep(0.05)
    assert states == {"node-a": "ready", "node-b": "lost", "node-c": "ready"}
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{cluster.ops_port}/metrics") as response,
    ):
        metrics = await response.text()
    assert 'offload_nodes{state="lost"} 1.0' in metrics


async def test_a_replica_no_deployment_claims_is_stopped(cluster: Cluster) -> None:
    plan = THREE_NODES[0]
    address = await wait_for_log(cluster.node_log(plan.node_id), r"127\.0\.0\.1:\d+")
    sha = file_sha256(modelzoo.model_path("mlp"))
    metadata = cluster.agent_metadata(plan.node_id)
    async with grpc.aio.insecure_channel(address) as channel:
        agent = npb_grpc.NodeAgentStub(channel)

        def chunks() -> Iterator[npb.ModelChunk]:
            yield npb.ModelChunk(sha256=sha, data=modelzoo.model_path("mlp").read_bytes())

        await agent.PutModel(chunks(), metadata=metadata)
        stray = npb.ReplicaSpec(
            deployment_id="stray", epoch=1, model_sha256=sha, model_name="mlp",
            token="stray-token-0123456789",
        )  # fmt: skip
        await agent.StartReplica(npb.StartReplicaRequest(spec=stray), metadata=metadata)
        for _ in range(300):
            listed = await agent.ListReplicas(npb.ListReplicasRequest(), metadata=metadata)
            if not listed.replicas:
                break
            await asyncio.sleep(0.05)
        assert list(listed.replicas) == []
    await wait_for_log(cluster.broker_log, r"replica=stray-1: no deployment claims it; stopping")


async def test_dashboard_shows_the_live_cluster(cluster: Cluster, tmp_path: Path) -> None:
    chromium = require_chromium()
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(modelzoo.model_path("mlp"))).sha256
        deployment = await alice.deploy(
            model_sha256=sha, model_name="mlp", gpus=4, p2p_required=True, site="site-b"
        )
    url = f"http://127.0.0.1:{cluster.ops_port}/"
    async with open_page(chromium, tmp_path / "profile") as page:
        await log_in(page, url, _ops_token_file(cluster).read_text().strip())
        dom = DomDump(await page.dom())
        png = await page.screenshot()
    assert [e.attrs["data-node-id"] for e in dom.having("data-node-id")] == [
        "node-a",
        "node-b",
        "node-c",
    ]
    used = [e for e in dom.having("data-gpu-index") if e.attrs.get("data-state") == "used"]
    assert {e.attrs["data-holders"] for e in used} == {deployment.deployment_id}
    assert len(used) == 4
    rows = [e.attrs["data-deployment-id"] for e in dom.having("data-deployment-id")]
    assert rows == [deployment.deployment_id]
    assert len(png) > 10_000


def test_the_state_location_is_checked_before_the_broker_serves(tmp_path: Path) -> None:
    """`--state`: a password in the URL is refused (it would be on the command line); another
    scheme and an unreachable server are clear errors that quote the location."""
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    token = tmp_path / "join-token"
    token.write_text(JOIN_TOKEN)
    token.chmod(0o600)

    def broker(state: str) -> subprocess.CompletedProcess[str]:
        # A fixed port: a broker sharing PostgreSQL must be reachable where it advertises.
        return _offload(
            "broker", "--listen", f"127.0.0.1:{free_port()}", "--ops-listen", "127.0.0.1:0",
            "--state-dir", str(tmp_path / "state"), "--cluster", str(tmp_path / "cluster.yaml"),
            "--join-token-file", str(token), "--state", state,
        )  # fmt: skip

    for with_password in (
        "postgresql://broker:s3cret-pw@db.example/offload",
        "postgres://broker@db.example/offload?password=s3cret-pw",
    ):
        refused = broker(with_password)
        assert refused.returncode == 2, refused.stderr
        assert "--state: the URL holds a password" in refused.stderr
        assert "PGPASSFILE" in refused.stderr and "s3cret" not in refused.stderr
    other = broker("mysql://broker@db.example/offload")
    assert other.returncode == 1
    assert "'mysql://broker@db.example/offload' is neither a folder nor a PostgreSQL URL" in (
        other.stderr
    )
    unreachable = broker("postgresql://broker@127.0.0.1:1/offload?connect_timeout=2")
    assert unreachable.returncode == 1
    assert "127.0.0.1:1" in unreachable.stderr and "Traceback" not in unreachable.stderr
    assert not (tmp_path / "state" / "broker.sqlite3").exists()


async def test_a_lost_database_connection_is_unavailable_then_reconnected(
    tmp_path: Path, postgresql_url: str
) -> None:
    """PostgreSQL drops the broker's connection (a restart, a failover): the call that meets
    it (a deploy: it reads the model's owners from the store) is UNAVAILABLE, saying nothing
    of the database; the next one reconnects and works."""
    cluster = Cluster(tmp_path, state=postgresql_url)
    unknown = {"model_sha256": "ab" * 32, "model_name": "mlp", "gpus": 1, "site": "site-a"}
    try:
        await cluster.start_broker()
        async with cluster.edge("alice") as alice:
            with pytest.raises(grpc.aio.AioRpcError) as before:
                await alice.deploy(**unknown)
            assert before.value.code() == grpc.StatusCode.NOT_FOUND
            database = postgresql_url.split("/")[-1].split("?")[0]
            with psycopg.connect(postgresql_url, autocommit=True) as admin:
                dropped = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (database,),
                ).fetchone()
            assert dropped is not None and dropped[0] >= 1
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await alice.deploy(**unknown)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert failed.value.details() == (
                "the broker cannot reach its state store; retry shortly"
            )
            with pytest.raises(grpc.aio.AioRpcError) as after:
                await alice.deploy(**unknown)
            assert after.value.code() == grpc.StatusCode.NOT_FOUND
            assert "not uploaded" in (after.value.details() or "")
        await wait_for_log(cluster.broker_log, r"WARNING .* the state store failed: ")
    finally:
        await cluster.stop()
