"""Node identity with real daemons (issue 50, items 1-2): a node id is bound to the node's
secret (plaintext) or certificate (TLS), and NodeAgent takes calls from the broker only.

A second daemon with a live node's id, on this host or another address, is refused with
ALREADY_EXISTS naming the holder and exits; a registration or heartbeat forged with the join
token alone changes nothing; a node restarting with its state dir takes its id back at once;
a retired id registers afresh; over TLS another node's certificate does not open NodeAgent.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

import modelzoo
from common.content import file_sha256
from common.node_identity import NODE_SECRET_HEADER, SECRET_FILE, new_secret
from edge_client.demo.cluster import NodePlan, spawn
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from protos.offload.v1 import node_pb2 as npb
from protos.offload.v1 import node_pb2_grpc as npb_grpc
from runtime.tls import open_channel
from tests.cluster_support import (
    JOIN_TOKEN,
    THREE_NODES,
    Cluster,
    cluster_agrees,
    node_replicas,
    wait_for_log,
)

NODE_A, NODE_B = THREE_NODES[0], THREE_NODES[1]
JOIN = ("authorization", f"Bearer {JOIN_TOKEN}")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        await cluster.start_node(NODE_A)
        yield cluster
    finally:
        await cluster.stop()


def _agent_address(cluster: Cluster, node_id: str) -> str:
    """Where `node_id`'s latest daemon serves NodeAgent (from its log)."""
    log = cluster.node_log(node_id).read_text()
    return re.findall(r"node agent listening on (127\.0\.0\.1:\d+)", log)[-1]


def _second_daemon(cluster: Cluster, plan: NodePlan, name: str, host: str) -> subprocess.Popen:
    """A daemon claiming `plan`'s node id from a state dir of its own (`<name>-state`: a
    cloned host, or one that lost its state), listening on `host`."""
    return spawn(
        [
            sys.executable, "-m", "edge_client.cli", "node", "--listen", f"{host}:0",
            "--site", plan.site, "--node-id", plan.node_id, "--runtime", "process",
            "--topology-file", str(plan.capture), "--gpu-spec", plan.gpu_spec,
            "--state-dir", str(cluster.root / f"{name}-state"),
            "--broker", cluster.registry_address,
            "--join-token-file", str(cluster.root / "join-token"),
            "--stop-replicas-on-exit", *cluster.tls_flags(plan.node_id), *plan.flags,
        ],
        cluster.root / f"{name}.log",
    )  # fmt: skip


async def _exit_code(process: subprocess.Popen[bytes]) -> int:
    return await asyncio.to_thread(process.wait, 60)


def _retire(cluster: Cluster, node_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "edge_client.cli", "retire", node_id,
            "--broker", cluster.broker_address,
            "--join-token-file", str(cluster.root / "join-token"),
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


async def _deploy_on_a(cluster: Cluster) -> pb.Deployment:
    async with cluster.edge("alice") as alice:
        uploaded = await alice.upload(modelzoo.model_path("mlp"))
        deployment = await alice.deploy(
            model_sha256=uploaded.sha256, model_name="mlp", gpus=1, site=NODE_A.site
        )
    assert (deployment.node_id, deployment.state) == (NODE_A.node_id, "running")
    return deployment


async def _unchanged(cluster: Cluster, deployment: pb.Deployment) -> None:
    async with cluster.edge("alice") as alice:
        now = await alice.get(deployment.deployment_id)
    assert (now.node_id, now.epoch, now.endpoint, now.state) == (
        deployment.node_id,
        deployment.epoch,
        deployment.endpoint,
        "running",
    )
    await cluster_agrees(cluster)
    assert await node_replicas(cluster) == {
        NODE_A.node_id: [f"{deployment.deployment_id}-{deployment.epoch}"]
    }


def _replica_records(cluster: Cluster, name: str) -> list[Path]:
    return list((cluster.root / f"{name}-state" / "replicas").glob("*/replica.json"))


async def test_a_second_daemon_with_a_live_nodes_id_is_refused_and_exits(
    cluster: Cluster,
) -> None:
    deployment = await _deploy_on_a(cluster)
    holder = _agent_address(cluster, NODE_A.node_id)
    # The same host (a second daemon started by mistake) and another address (a clone).
    for name, host in (("same-host", "127.0.0.1"), ("clone", "127.0.0.2")):
        process = _second_daemon(cluster, NODE_A, name, host)
        assert await _exit_code(process) == 1
        log = (cluster.root / f"{name}.log").read_text()
        assert "this node cannot join the broker" in log, log[-2000:]
        assert f"node id node-a is held by the live node at {holder}" in log, log[-2000:]
        assert "registered with broker" not in log
        assert _replica_records(cluster, name) == []
        # The real node keeps its id, its address and its replica, untouched.
        await _unchanged(cluster, deployment)
    assert "held by the live node" not in cluster.node_log(NODE_A.node_id).read_text()


async def test_a_registration_forged_with_the_join_token_alone_changes_nothing(
    cluster: Cluster,
) -> None:
    deployment = await _deploy_on_a(cluster)
    holder = _agent_address(cluster, NODE_A.node_id)
    register = pb.RegisterRequest(node_id=NODE_A.node_id, address="127.0.0.1:1", site="site-a")
    async with open_channel(cluster.broker_address, None) as channel:
        registry = pb_grpc.NodeRegistryStub(channel)
        for metadata, code in (
            ((JOIN,), grpc.StatusCode.UNAUTHENTICATED),  # no node secret at all
            ((JOIN, (NODE_SECRET_HEADER, new_secret())), grpc.StatusCode.ALREADY_EXISTS),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await registry.Register(register, metadata=metadata, timeout=30)
            assert caught.value.code() == code, caught.value.details()
        assert holder in (caught.value.details() or "")
        # A heartbeat stream under another secret: NOT_FOUND (register again), not counted.
        stream = registry.Heartbeats(metadata=(JOIN, (NODE_SECRET_HEADER, new_secret())))
        await stream.write(pb.HeartbeatRequest(node_id=NODE_A.node_id))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.read()
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
    # The join token no longer opens a node's NodeAgent: only the broker's credential does.
    async with grpc.aio.insecure_channel(holder) as channel:
        agent = npb_grpc.NodeAgentStub(channel)
        stray = npb.ReplicaSpec(
            deployment_id="stray", epoch=1, model_sha256=file_sha256(modelzoo.model_path("mlp")),
            model_name="mlp", token="stray-token-0123456789",
        )  # fmt: skip
        for agent_metadata in ((JOIN,), ()):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await agent.StartReplica(
                    npb.StartReplicaRequest(spec=stray), metadata=agent_metadata, timeout=30
                )
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await _unchanged(cluster, deployment)


async def test_a_node_restarting_with_its_state_dir_takes_its_id_back_at_once(
    tmp_path: Path,
) -> None:
    # A lost-after long enough that the broker still counts the killed daemon's stream
    # live when the new daemon registers: the proof wins, and the replica is adopted.
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker("--lost-after", "60")
        await cluster.start_node(NODE_A)
        deployment = await _deploy_on_a(cluster)
        secret = cluster.node_secret(NODE_A.node_id)
        old = cluster.nodes[NODE_A.node_id]
        old.send_signal(signal.SIGKILL)
        await _exit_code(old)
        await cluster.start_node(NODE_A)
        log = cluster.node_log(NODE_A.node_id).read_text()
        assert "cannot join" not in log and "ALREADY_EXISTS" not in log
        assert cluster.node_secret(NODE_A.node_id) == secret
        assert "node=node-a lost" not in cluster.broker_log.read_text()
        await _unchanged(cluster, deployment)
    finally:
        await cluster.stop()


async def test_a_node_that_lost_its_state_dir_joins_again_once_its_id_is_retired(
    cluster: Cluster,
) -> None:
    state = cluster.root / f"{NODE_A.node_id}-state"
    old_secret = (state / SECRET_FILE).read_text()
    # While the node is live, its id cannot be retired.
    refused = _retire(cluster, NODE_A.node_id)
    assert refused.returncode == 1 and "is live" in refused.stderr, refused.stderr
    old = cluster.nodes.pop(NODE_A.node_id)
    old.send_signal(signal.SIGTERM)
    assert await _exit_code(old) == 0
    (state / SECRET_FILE).unlink()  # the host lost its state: it cannot prove the id
    await wait_for_log(cluster.broker_log, r"node=node-a lost")
    process = _second_daemon(cluster, NODE_A, NODE_A.node_id, "127.0.0.1")
    assert await _exit_code(process) == 1
    log = cluster.node_log(NODE_A.node_id).read_text()
    assert "retire the id (offload retire node-a)" in log, log[-2000:]
    retired = _retire(cluster, NODE_A.node_id)
    assert retired.returncode == 0, retired.stderr
    assert "node-a retired" in retired.stdout
    assert _retire(cluster, "node-z").returncode == 1  # never seen: NOT_FOUND
    await cluster.start_node(NODE_A)
    assert (state / SECRET_FILE).read_text() != old_secret
    await _deploy_on_a(cluster)


async def test_with_tls_only_the_brokers_certificate_opens_a_nodes_agent(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path, tls=True)
    try:
        await cluster.start_broker()
        await asyncio.gather(cluster.start_node(NODE_A), cluster.start_node(NODE_B))
        deployment = await _deploy_on_a(cluster)  # the broker's own calls work
        address = _agent_address(cluster, NODE_A.node_id)
        sha = file_sha256(modelzoo.model_path("mlp"))
        stray = npb.ReplicaSpec(
            deployment_id="stray", epoch=1, model_sha256=sha, model_name="mlp",
            token="stray-token-0123456789",
        )  # fmt: skip
        # node-b's certificate, even with a node secret as the bearer token: refused.
        metadata = (("authorization", f"Bearer {cluster.node_secret(NODE_B.node_id)}"),)
        async with open_channel(address, cluster.certificate(NODE_B.node_id)) as channel:
            agent = npb_grpc.NodeAgentStub(channel)
            for call in (
                agent.ListReplicas(npb.ListReplicasRequest(), metadata=metadata, timeout=30),
                agent.StartReplica(
                    npb.StartReplicaRequest(spec=stray), metadata=metadata, timeout=30
                ),
                agent.StopReplica(
                    npb.StopReplicaRequest(
                        replica_id=f"{deployment.deployment_id}-{deployment.epoch}"
                    ),
                    timeout=30,
                ),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "broker" in (caught.value.details() or "")
        # The broker's certificate is taken.
        async with open_channel(address, cluster.certificate("broker")) as channel:
            listed = await npb_grpc.NodeAgentStub(channel).ListReplicas(
                npb.ListReplicasRequest(), timeout=30
            )
        assert [r.replica_id for r in listed.replicas] == [
            f"{deployment.deployment_id}-{deployment.epoch}"
        ]
        await _unchanged_tls(cluster, deployment)
    finally:
        await cluster.stop()


async def _unchanged_tls(cluster: Cluster, deployment: pb.Deployment) -> None:
    await cluster_agrees(cluster)
    replicas = await node_replicas(cluster)
    assert replicas[NODE_A.node_id] == [f"{deployment.deployment_id}-{deployment.epoch}"]
    assert replicas[NODE_B.node_id] == []
