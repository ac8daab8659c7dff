"""TLS on the broker's channels (issue 15): a broker and a node with certificates, as real
processes on loopback, every channel read through a TCP proxy that keeps the bytes.

What must hold: no join token, API key, deployment token or model byte crosses in the clear;
a client with the wrong CA, a node without a valid certificate and a plaintext client are
each refused at once with a status and a message that say so (UNAVAILABLE with the handshake
failure, UNAUTHENTICATED or PERMISSION_DENIED; never UNKNOWN or INTERNAL, never a hang); a
plaintext listener on a non-loopback address needs --insecure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import ssl
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest

import modelzoo
from broker.server import config_from_args
from common.certs import TlsIdentity, issue, make_ca
from common.node_identity import NODE_SECRET_HEADER, SECRET_FILE
from edge_client.cli import build_parser
from edge_client.client import OffloadClient
from edge_client.errors import Unavailable
from protos.inference import grpc_service_pb2 as ipb
from protos.inference import grpc_service_pb2_grpc as infer_grpc
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from runtime.tls import open_channel
from tests.cluster_support import JOIN_TOKEN, THREE_NODES, Cluster, infer_once, wait_for_log
from tests.docker_support import require_docker

NODE = THREE_NODES[0]
TRITON_PROBE = Path(__file__).resolve().parents[1] / "triton_probe.py"


@dataclass
class Proxy:
    """A TCP proxy on loopback to `target`, keeping every byte either way in `seen`."""

    target: int
    seen: bytearray = field(default_factory=bytearray)
    server: asyncio.Server | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                self.seen += data
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target)
        pipes = [
            asyncio.create_task(self._pipe(reader, upstream_writer)),
            asyncio.create_task(self._pipe(upstream_reader, writer)),
        ]
        self.tasks.update(pipes)
        await asyncio.gather(*pipes)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Proxy]:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield self
        finally:
            self.server.close()
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await self.server.wait_closed()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path, tls=True)
    try:
        await cluster.start_broker()
        yield cluster
    finally:
        await cluster.stop()


def _foreign_identity(name: str) -> TlsIdentity:
    """A certificate for `name` from a CA the cluster does not trust, with that CA."""
    ca, ca_key = make_ca("a CA nobody trusts")
    cert, key = issue(ca, ca_key, name, ["localhost"], ["127.0.0.1"])
    return TlsIdentity(ca=ca, cert=cert, key=key)


async def test_no_secret_crosses_in_the_clear(cluster: Cluster) -> None:
    model = modelzoo.model_path("mlp")
    async with (
        Proxy(cluster.broker_port).running() as clients,
        Proxy(cluster.node_port).running() as nodes,
    ):
        await cluster.start_node(NODE, "process", "--broker", nodes.address)
        api_key = cluster.api_keys["alice"]
        async with OffloadClient(
            clients.address, api_key, tls_ca=cluster.tls_dir / "ca.pem"
        ) as client:
            sha = await client.upload_model(model)
            deployment = await client.deploy(sha, "mlp", gpus=1, site=NODE.site)
            await client.infer(modelzoo.sample_inputs(model))
        assert deployment.node_id == NODE.node_id
        # The node fetched the model from the broker, and heartbeats, through the proxy.
        await wait_for_log(cluster.node_log(NODE.node_id), r"model [0-9a-f]{12} fetched")
    assert clients.seen[:1] == b"\x16" and nodes.seen[:1] == b"\x16"  # TLS handshake records
    secrets = {
        "join token": JOIN_TOKEN.encode(),
        "API key": api_key.encode(),
        "API key secret": api_key.partition(".")[2].encode(),
        "deployment token": deployment.token.encode(),
        "model bytes": model.read_bytes()[-64:],
    }
    for stream, seen in (("client<->broker", clients.seen), ("node<->broker", nodes.seen)):
        for what, secret in secrets.items():
            assert secret not in seen, f"the {what} crossed {stream} in the clear"


@pytest.mark.parametrize("runtime", ["process", pytest.param("docker", marks=pytest.mark.docker)])
async def test_replicas_serve_tls_with_the_nodes_certificate(
    cluster: Cluster, tmp_path: Path, runtime: str
) -> None:
    if runtime == "docker":
        require_docker().close()
    await cluster.start_node(NODE, runtime)
    model = modelzoo.model_path("mlp")
    async with cluster.edge("alice") as alice:
        sha = (await alice.upload(model)).sha256
        deployment = await alice.deploy(model_sha256=sha, model_name="mlp", site=NODE.site)
    assert deployment.endpoint_ca_pem.encode() == cluster.certificate("broker").ca
    await infer_once(deployment)  # over TLS, with the CA the endpoint came with
    async with open_channel(deployment.endpoint, None) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await infer_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                ipb.ServerLiveRequest(), timeout=30
            )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # tritonclient, with ssl=True and our CA, infers on it.
    inputs_file, outputs_file = tmp_path / "inputs.npz", tmp_path / "outputs.npz"
    np.savez(inputs_file, **modelzoo.sample_inputs(model))
    (tmp_path / "endpoint-ca.pem").write_text(deployment.endpoint_ca_pem)
    done = await asyncio.create_subprocess_exec(
        sys.executable, str(TRITON_PROBE), "--url", deployment.endpoint, "--model", "mlp",
        "--inputs", str(inputs_file), "--outputs", str(outputs_file),
        "--ca", str(tmp_path / "endpoint-ca.pem"),
        env={**os.environ, "TRITON_PROBE_TOKEN": deployment.token},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await done.communicate()
    assert done.returncode == 0, err.decode()
    report = json.loads(out)
    assert report["live"] and report["server_ready"] and report["model_ready"]
    with np.load(outputs_file) as outputs:
        assert outputs.files == [o["name"] for o in report["metadata"]["outputs"]]


async def test_a_client_with_the_wrong_ca_is_refused_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with open_channel(cluster.broker_address, _foreign_identity("x")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.EdgeBrokerStub(channel).ListDeployments(
                pb.ListDeploymentsRequest(), metadata=cluster.metadata("alice"), timeout=30
            )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in (caught.value.details() or "")
    # The client does not retry what no retry mends (it would for up to broker_retry_s).
    (tmp_path / "foreign-ca.pem").write_bytes(_foreign_identity("x").ca)
    async with OffloadClient(
        cluster.broker_address,
        cluster.api_keys["alice"],
        tls_ca=tmp_path / "foreign-ca.pem",
        broker_retry_s=3600,
    ) as client:
        with pytest.raises(Unavailable, match="the TLS handshake failed"):
            await client.upload_model(modelzoo.model_path("mlp"))


async def test_a_plaintext_client_is_refused(cluster: Cluster) -> None:
    async with open_channel(cluster.broker_address, None) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.EdgeBrokerStub(channel).ListDeployments(
                pb.ListDeploymentsRequest(), metadata=cluster.metadata("alice"), timeout=30
            )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
    async with OffloadClient(
        cluster.broker_address, cluster.api_keys["alice"], broker_retry_s=0
    ) as client:
        with pytest.raises(Unavailable, match="the server may serve TLS"):
            await client.upload_model(modelzoo.model_path("mlp"))


async def test_a_node_without_a_valid_certificate_is_refused(cluster: Cluster) -> None:
    register = pb.RegisterRequest(node_id=NODE.node_id, address="127.0.0.1:1", site=NODE.site)
    metadata = (("authorization", f"Bearer {JOIN_TOKEN}"),)
    for identity in (
        TlsIdentity(ca=cluster.certificate("broker").ca),  # no client certificate
        TlsIdentity(
            ca=cluster.certificate("broker").ca,
            cert=_foreign_identity(NODE.node_id).cert,
            key=_foreign_identity(NODE.node_id).key,
        ),
    ):
        async with open_channel(cluster.registry_address, identity) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pb_grpc.NodeRegistryStub(channel).Register(
                    register, metadata=metadata, timeout=30
                )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
    # A certificate of the cluster's CA, but for another node: the node stops, saying why.
    cluster.certificate("node-x")
    flags = ["--tls-cert", str(cluster.tls_dir / "node-x.pem")]
    flags += ["--tls-key", str(cluster.tls_dir / "node-x-key.pem")]
    with pytest.raises(AssertionError):  # it never registers
        await cluster.start_node(NODE, "process", *flags)
    process = cluster.nodes.pop(NODE.node_id)
    assert await asyncio.to_thread(process.wait, 30) == 1
    log = cluster.node_log(NODE.node_id).read_text()
    assert "PERMISSION_DENIED" in log and "this certificate is for node 'node-x'" in log
    # A node whose CA does not know the broker's certificate stops too.
    foreign = _foreign_identity(NODE.node_id)
    for name, data in (
        ("f.pem", foreign.cert),
        ("f-key.pem", foreign.key),
        ("fca.pem", foreign.ca),
    ):
        (cluster.tls_dir / name).write_bytes(data)
    (cluster.tls_dir / "f-key.pem").chmod(0o600)
    flags = ["--tls-cert", str(cluster.tls_dir / "f.pem"), "--tls-key"]
    flags += [str(cluster.tls_dir / "f-key.pem"), "--tls-ca", str(cluster.tls_dir / "fca.pem")]
    with pytest.raises(AssertionError):
        await cluster.start_node(NODE, "process", *flags)
    process = cluster.nodes.pop(NODE.node_id)
    assert await asyncio.to_thread(process.wait, 30) == 1
    assert "CERTIFICATE_VERIFY_FAILED" in cluster.node_log(NODE.node_id).read_text()


async def test_a_heartbeat_stream_speaks_only_for_its_certificates_node(
    cluster: Cluster,
) -> None:
    """The stream reads its connection's certificate once; every message after is still
    held to it: node-a's own certificate and secret renew node-a's lease, then a message
    for node-b on the same stream is refused, naming both."""
    node_a, node_b = THREE_NODES[0], THREE_NODES[1]
    await cluster.start_node(node_a)
    secret = (cluster.root / f"{node_a.node_id}-state" / SECRET_FILE).read_text().strip()
    metadata = (("authorization", f"Bearer {JOIN_TOKEN}"), (NODE_SECRET_HEADER, secret))
    async with open_channel(cluster.registry_address, cluster.certificate(node_a.node_id)) as ch:
        stream = pb_grpc.NodeRegistryStub(ch).Heartbeats(metadata=metadata)
        await stream.write(pb.HeartbeatRequest(node_id=node_a.node_id, lease_only=True))
        assert await stream.read() == pb.HeartbeatResponse()
        await stream.write(pb.HeartbeatRequest(node_id=node_b.node_id, lease_only=True))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.read()
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "this certificate is for node 'node-a', not 'node-b'" in (caught.value.details() or "")


async def test_the_ops_server_serves_https_only(cluster: Cluster) -> None:
    context = ssl.create_default_context(cadata=cluster.certificate("broker").ca.decode())
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"https://127.0.0.1:{cluster.ops_port}/healthz", ssl=context
        ) as response:
            assert response.status == 200
        with pytest.raises(aiohttp.ClientError):
            async with http.get(f"http://127.0.0.1:{cluster.ops_port}/healthz") as response:
                await response.read()
    done = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "edge_client.cli", "nodes", "--json",
        "--ops", f"https://127.0.0.1:{cluster.ops_port}",
        "--ops-token-file", str(cluster.root / "broker-state" / "ops-token"),
        "--tls-ca", str(cluster.tls_dir / "ca.pem"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await done.communicate()
    assert done.returncode == 0, err.decode()
    assert out.strip() == b"[]"


def _broker_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    (tmp_path / "join-token").write_text(JOIN_TOKEN)
    return build_parser().parse_args(
        [
            "broker", "--listen", "0.0.0.0:7000", "--ops-listen", "127.0.0.1:8080",
            "--state-dir", str(tmp_path), "--cluster", str(tmp_path / "cluster.yaml"),
            "--join-token-file", str(tmp_path / "join-token"), *extra,
        ]
    )  # fmt: skip


def test_a_broker_beyond_loopback_needs_tls_or_insecure(tmp_path: Path) -> None:
    reachable = r"--listen '0\.0\.0\.0:7000' is reachable from other hosts"
    with pytest.raises(ValueError, match=reachable):
        config_from_args(_broker_args(tmp_path))
    assert config_from_args(_broker_args(tmp_path, "--insecure")).tls is None
    cluster = Cluster(tmp_path)
    cluster.certificate("broker")
    tls = ["--tls-cert", str(tmp_path / "tls" / "broker.pem")]
    tls += ["--tls-key", str(tmp_path / "tls" / "broker-key.pem")]
    tls += ["--tls-ca", str(tmp_path / "tls" / "ca.pem")]
    with pytest.raises(ValueError, match="--tls-cert needs --node-listen"):
        config_from_args(_broker_args(tmp_path, *tls))
    with pytest.raises(ValueError, match="--tls-cert, --tls-key and --tls-ca go together"):
        config_from_args(_broker_args(tmp_path, *tls[:2], "--node-listen", "0.0.0.0:7001"))
    config = config_from_args(_broker_args(tmp_path, *tls, "--node-listen", "0.0.0.0:7001"))
    assert config.tls is not None and config.node_listen == "0.0.0.0:7001"
