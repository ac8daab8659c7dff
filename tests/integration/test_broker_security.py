"""The broker's security defaults, on a real broker: real gRPC over loopback sockets, the real
ops HTTP server, a real SQLite state dir checked with os.stat.

- the API keys file is the source of truth: a removed key stops working after SIGHUP and after
  a restart; a malformed file on SIGHUP keeps the old keys; with 1,000 keys, a removed or
  replaced key is refused on the first call after the reload returns, and a WatchDeployment
  stream opened with it ends;
- the state dir is 0700 and its files 0600;
- `/api/*` needs the ops token; a broker without `--ops-token-file` makes one (0600);
- per-client quotas answer RESOURCE_EXHAUSTED naming the limit and its flag;
- a stalled upload is cut off and its staging removed; uploads under way are capped in staged
  bytes, per client and broker-wide, counted as chunks arrive, and the model bytes quota stops
  an upload at the chunk that passes it; a cancelled upload gives back its bytes and file;
- a client deploys only models it uploaded, and deduplication is invisible to other clients;
- an infinity that slipped into the store never breaks `/api/migrations` or ListMigrations.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from broker.quotas import Quotas
from broker.server import BrokerConfig, RunningBroker, reload_api_keys, start_broker
from broker.state import (
    DeploymentRecord,
    DeploymentState,
    MigrationRecord,
    MigrationState,
    MigrationStrategy,
    MigrationTrigger,
    NodeRecord,
    NodeState,
    api_keys,
    new_api_key,
)
from broker.state.opener import open_store
from broker.state.sqlite_backend import DB_FILENAME
from broker.values import BrokerSettings
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from protos.offload.v1 import node_pb2 as npb
from tests.cluster_support import CLUSTER_YAML, JOIN_TOKEN, Cluster, wait_for_log
from tests.ops_support import OPS_TOKEN, ops_headers

ALICE = "alice.secret-key-of-alice-0123456789"
BOB = "bob.secret-key-of-bob-0123456789"


def onnx_model(scale: float) -> bytes:
    """A small valid ONNX model, y = x * scale: a different scale, a different sha256."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "scale"], ["y"])],
        "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.full([1, 4], scale, np.float32), "scale")],
    )
    return helper.make_model(graph).SerializeToString()


MODEL_A, MODEL_B = onnx_model(2.0), onnx_model(3.0)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def poll(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


BrokerFactory = Callable[..., "contextlib.AbstractAsyncContextManager[RunningBroker]"]


@pytest.fixture
def broker_at(tmp_path: Path) -> BrokerFactory:
    """Start an in-process broker on loopback over `tmp_path/state` (again on each call: a
    restart), with alice's and bob's keys and the given quotas and config fields."""
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)

    @contextlib.asynccontextmanager
    async def start(
        quotas: Quotas | None = None, **fields: object
    ) -> AsyncIterator[RunningBroker]:
        config = BrokerConfig(
            listen="127.0.0.1:0",
            ops_listen="127.0.0.1:0",
            state_dir=tmp_path / "state",
            cluster=tmp_path / "cluster.yaml",
            join_token=JOIN_TOKEN,
            api_keys=(ALICE, BOB),
            settings=BrokerSettings(quotas=quotas or Quotas()),
        )
        running = await start_broker(replace(config, **fields))  # type: ignore[arg-type]
        try:
            yield running
        finally:
            await running.stop()

    return start


@contextlib.asynccontextmanager
async def edge(running: RunningBroker) -> AsyncIterator[pb_grpc.EdgeBrokerStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield pb_grpc.EdgeBrokerStub(channel)


def key(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),)


async def upload(
    stub: pb_grpc.EdgeBrokerStub, api_key: str, data: bytes
) -> pb.UploadModelResponse:
    chunks = [npb.ModelChunk(sha256=sha(data), name="scaled", data=data)]
    return await stub.UploadModel(iter(chunks), metadata=key(api_key), timeout=30)


def staging(running: RunningBroker) -> list[Path]:
    return sorted(running.broker.models.root.glob(".upload-*"))


# -- API keys: the file is the source of truth ------------------------------------------------


async def list_status(cluster: Cluster, api_key: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(cluster.broker_address) as channel:
        try:
            await pb_grpc.EdgeBrokerStub(channel).ListDeployments(
                pb.ListDeploymentsRequest(), metadata=key(api_key), timeout=15
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        yield cluster
    finally:
        await cluster.stop()


async def test_a_removed_key_stops_working_on_sighup_and_after_restart(cluster: Cluster) -> None:
    await cluster.start_broker()
    alice, bob = cluster.api_keys["alice"], cluster.api_keys["bob"]
    assert await list_status(cluster, bob) == grpc.StatusCode.OK  # now verified and cached
    keys_file = cluster.root / "api-keys"
    assert cluster.broker is not None

    keys_file.write_text(f"# bob left\n{alice}\n")
    offset = cluster.broker_log.stat().st_size
    cluster.broker.send_signal(signal.SIGHUP)
    await wait_for_log(cluster.broker_log, r"API keys reloaded from .*: revoked bob", after=offset)
    assert await list_status(cluster, bob) == grpc.StatusCode.UNAUTHENTICATED
    assert await list_status(cluster, alice) == grpc.StatusCode.OK

    keys_file.write_text(f"{alice}\nalice.not a key at all\n{bob}\n")
    offset = cluster.broker_log.stat().st_size
    cluster.broker.send_signal(signal.SIGHUP)
    await wait_for_log(
        cluster.broker_log, r"API keys not reloaded, the current ones stay: .*line 2", after=offset
    )
    assert await list_status(cluster, alice) == grpc.StatusCode.OK
    assert await list_status(cluster, bob) == grpc.StatusCode.UNAUTHENTICATED

    cluster.kill_broker()
    cluster.api_keys = {"bob": bob}
    await cluster.start_broker()
    await wait_for_log(cluster.broker_log, r"API keys at start: added bob; revoked alice")
    assert await list_status(cluster, alice) == grpc.StatusCode.UNAUTHENTICATED
    assert await list_status(cluster, bob) == grpc.StatusCode.OK
    log = cluster.broker_log.read_text()
    for secret in (alice, bob):
        assert secret.partition(".")[2] not in log


async def call_status(stub: pb_grpc.EdgeBrokerStub, api_key: str) -> grpc.StatusCode:
    try:
        await stub.ListDeployments(pb.ListDeploymentsRequest(), metadata=key(api_key), timeout=15)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_with_1000_keys_a_removed_or_replaced_key_is_refused_once_the_reload_returns(
    broker_at: BrokerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Cheap hashes, so that 1,000 keys start in a second: what is tested is when a key stops
    # working, which waits for no hash (a reload hashes only changed keys, and after).
    monkeypatch.setattr(api_keys, "_N", 2**4)
    keys = [new_api_key(f"client{n:04}") for n in range(1000)]
    removed, replaced = keys[500], keys[600]
    async with broker_at(api_keys=tuple(keys)) as running, edge(running) as stub:
        await upload(stub, removed, MODEL_A)
    seed(tmp_path / "state", pending("d-1", "client0500", sha(MODEL_A)))
    async with broker_at(api_keys=tuple(keys)) as running, edge(running) as stub:
        for api_key in (removed, replaced):
            assert await call_status(stub, api_key) == grpc.StatusCode.OK  # verified, cached
        watch = stub.WatchDeployment(
            pb.WatchDeploymentRequest(deployment_id="d-1"), metadata=key(removed)
        )
        assert (await watch.read()).deployment_id == "d-1"
        replacement = new_api_key("client0600")
        keys_file = tmp_path / "api-keys"
        now = [replacement if k == replaced else k for k in keys if k != removed]
        keys_file.write_text("\n".join(now) + "\n")

        await reload_api_keys(running, keys_file)
        assert await call_status(stub, removed) == grpc.StatusCode.UNAUTHENTICATED
        assert await call_status(stub, replaced) == grpc.StatusCode.UNAUTHENTICATED
        assert await call_status(stub, replacement) == grpc.StatusCode.OK
        assert await call_status(stub, keys[0]) == grpc.StatusCode.OK
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await watch.read()
        assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "was revoked" in (ended.value.details() or "")
        # The state followed: the same keys again change nothing.
        assert not await asyncio.to_thread(running.store.replace_client_keys, now)


# -- the state dir and the ops token ---------------------------------------------------------


async def test_state_files_are_private_and_looser_ones_are_tightened(
    broker_at: BrokerFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    async with broker_at() as running, edge(running) as stub:
        await upload(stub, ALICE, MODEL_A)
        files = [p for p in state.rglob("*") if p.is_file()]
        names = {p.name for p in files}
        assert {DB_FILENAME, f"{DB_FILENAME}-wal", "ops-token", sha(MODEL_A)} <= names
        assert {p.name: mode(p) for p in files} == {p.name: 0o600 for p in files}
        assert mode(state) == mode(state / "models") == 0o700

    state.chmod(0o755)
    (state / "models").chmod(0o755)
    for path in (state / DB_FILENAME, state / "ops-token", state / "models" / sha(MODEL_A)):
        path.chmod(0o644)
    async with broker_at():
        pass
    for path in (state, state / "models"):
        assert mode(path) == 0o700
        assert f"{path} was readable by others" in caplog.text
    for path in (state / DB_FILENAME, state / "ops-token", state / "models" / sha(MODEL_A)):
        assert mode(path) == 0o600
        assert f"{path} was readable by others" in caplog.text


async def test_the_ops_api_needs_the_token_the_broker_made(
    broker_at: BrokerFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="broker.server")
    async with broker_at() as running, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{running.ops_port}"
        for path in ("/api/nodes", "/api/deployments", "/api/migrations"):
            async with http.get(base + path) as response:
                assert response.status == 401
                assert set(await response.json()) == {"error", "status"}
        for path in ("/healthz", "/metrics"):
            async with http.get(base + path) as response:
                assert response.status == 200
        token_file = tmp_path / "state" / "ops-token"
        assert mode(token_file) == 0o600
        async with http.get(f"{base}/api/nodes", headers=ops_headers(token_file)) as response:
            assert response.status == 200
    token = token_file.read_text().strip()
    assert f"ops token: in {token_file}" in caplog.text
    assert token not in caplog.text
    async with broker_at() as restarted:  # the same token after a restart
        assert token_file.read_text().strip() == token
        assert restarted.ops_port


async def test_a_given_ops_token_and_metrics_auth(broker_at: BrokerFactory) -> None:
    async with (
        broker_at(ops_token=OPS_TOKEN, metrics_auth=True) as running,
        aiohttp.ClientSession() as http,
    ):
        base = f"http://127.0.0.1:{running.ops_port}"
        async with http.get(f"{base}/metrics") as response:
            assert response.status == 401
        async with http.get(f"{base}/healthz") as response:
            assert response.status == 200
        headers = {"Authorization": f"Bearer {OPS_TOKEN}"}
        for path in ("/metrics", "/api/deployments"):
            async with http.get(base + path, headers=headers) as response:
                assert response.status == 200, path


async def offload(*args: str, env: dict[str, str]) -> tuple[int, str]:
    """Run the `offload` CLI (without blocking the in-process broker): exit code and output."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "edge_client.cli", *args,
        env={**os.environ, **env}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(proc.communicate(), 60)
    return await proc.wait(), output.decode()


async def test_the_cli_reads_the_ops_api_with_the_token_file(
    broker_at: BrokerFactory, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    async with broker_at() as running:
        ops = {"OFFLOAD_OPS": f"http://127.0.0.1:{running.ops_port}"}
        token_file = str(running.store.path.parent / "ops-token")
        code, output = await offload("status", "--json", env=ops)
        assert code == 1 and "give --ops-token-file F (or set OFFLOAD_OPS_TOKEN_FILE)" in output
        code, output = await offload("status", "--ops-token-file", str(wrong), env=ops)
        assert code == 1 and "refused the ops token" in output
        code, output = await offload(
            "status", "--json", env={**ops, "OFFLOAD_OPS_TOKEN_FILE": token_file}
        )
        assert code == 0, output
        assert json.loads(output)["migrations"] == 0


# -- model ownership -------------------------------------------------------------------------


async def test_a_client_deploys_only_models_it_uploaded(broker_at: BrokerFactory) -> None:
    async with broker_at() as running, edge(running) as stub:
        first = await upload(stub, ALICE, MODEL_A)
        assert (first.sha256, first.deduplicated) == (sha(MODEL_A), False)
        assert (await upload(stub, ALICE, MODEL_A)).deduplicated
        assert not (await upload(stub, BOB, MODEL_B)).deduplicated

        answers = []
        for model in (sha(MODEL_B), "f" * 64):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Deploy(
                    pb.DeployRequest(model_sha256=model, model_name="scaled", site="site-a"),
                    metadata=key(ALICE),
                    timeout=15,
                )
            answers.append((refused.value.code(), refused.value.details().replace(model, "X")))
        assert answers[0] == answers[1]
        assert answers[0][0] == grpc.StatusCode.NOT_FOUND

        # Bob sends alice's content: stored once, but nothing tells him alice has it.
        assert not (await upload(stub, BOB, MODEL_A)).deduplicated
        assert (await upload(stub, BOB, MODEL_A)).deduplicated
        store = running.store
        assert await asyncio.to_thread(store.owns_model, "bob", sha(MODEL_A))
        assert await asyncio.to_thread(store.client_model_bytes, "bob") == len(MODEL_A) + len(
            MODEL_B
        )


# -- quotas ----------------------------------------------------------------------------------


def pending(deployment_id: str, client_id: str, model_sha256: str) -> DeploymentRecord:
    now = time.time()
    return DeploymentRecord(
        deployment_id=deployment_id, client_id=client_id, model_sha256=model_sha256,
        model_name="scaled", request_json="{}", priority=2, site="site-a",
        state=DeploymentState.PENDING, node_id=None, gpus=(), gpu_uuids=(), endpoint="",
        token="", epoch=1, explanation_json="{}", reason="waiting", created_at=now,
        updated_at=now,
    )  # fmt: skip


def seed(state_dir: Path, *records: DeploymentRecord | NodeRecord | MigrationRecord) -> None:
    """Write records into a stopped broker's state (a running broker is the only writer of
    its deployments: it keeps them in memory)."""
    store = open_store("", state_dir)
    try:
        for record in records:
            if isinstance(record, NodeRecord):
                store.upsert_node(record)
            elif isinstance(record, DeploymentRecord):
                store.create_deployment(record)
            else:
                store.create_migration(record)
    finally:
        store.close()


async def test_quotas_refuse_with_the_limit_and_its_flag(
    broker_at: BrokerFactory, tmp_path: Path
) -> None:
    quotas = Quotas(deployments=2, model_bytes=len(MODEL_A) + 10, watch_streams=2)
    async with broker_at(quotas) as running, edge(running) as stub:
        await upload(stub, ALICE, MODEL_A)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await upload(stub, ALICE, MODEL_B)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-model-bytes-per-client" in refused.value.details()
        assert not (running.broker.models.root / sha(MODEL_B)).exists()
        assert staging(running) == []
    seed(tmp_path / "state", *(pending(f"d-{n}", "alice", sha(MODEL_A)) for n in (1, 2)))
    async with broker_at(quotas) as running, edge(running) as stub:
        request = pb.DeployRequest(model_sha256=sha(MODEL_A), model_name="scaled", site="site-a")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Deploy(request, metadata=key(ALICE), timeout=15)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "has 2 deployments, its limit (--max-deployments-per-client 2)" in (
            refused.value.details()
        )

        streams = [
            stub.WatchDeployment(
                pb.WatchDeploymentRequest(deployment_id=f"d-{n}"), metadata=key(ALICE)
            )
            for n in (1, 2)
        ]
        for stream in streams:
            assert (await stream.read()).deployment_id.startswith("d-")
        third = stub.WatchDeployment(
            pb.WatchDeploymentRequest(deployment_id="d-1"), metadata=key(ALICE)
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await third.read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-watch-streams-per-client 2" in refused.value.details()
        streams[0].cancel()
        again = stub.WatchDeployment(
            pb.WatchDeploymentRequest(deployment_id="d-2"), metadata=key(ALICE)
        )
        assert (await again.read()).deployment_id == "d-2"
        for stream in (streams[1], again):
            stream.cancel()


async def stalled_upload(
    stub: pb_grpc.EdgeBrokerStub, data: bytes, resume: asyncio.Event
) -> pb.UploadModelResponse:
    """An upload that sends its first 100 bytes, then nothing until `resume` is set."""

    async def chunks() -> AsyncIterator[npb.ModelChunk]:
        yield npb.ModelChunk(sha256=sha(data), name="scaled", data=data[:100])
        await resume.wait()
        yield npb.ModelChunk(data=data[100:])

    return await stub.UploadModel(chunks(), metadata=key(ALICE), timeout=30)


async def test_a_stalled_upload_is_cut_off_and_its_staging_removed(
    broker_at: BrokerFactory,
) -> None:
    async with broker_at(Quotas(upload_idle_timeout_s=0.5)) as running, edge(running) as stub:
        resume = asyncio.Event()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await stalled_upload(stub, MODEL_A, resume)
        finally:
            resume.set()
        assert cut.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "no chunk for 0.5 s (--upload-idle-timeout)" in cut.value.details()
        await poll(lambda: staging(running) == [], "the staging folder is removed")
        assert not (running.broker.models.root / sha(MODEL_A)).exists()


async def test_concurrent_uploads_are_limited_per_client(broker_at: BrokerFactory) -> None:
    async with broker_at(Quotas(uploads=1)) as running, edge(running) as stub:
        resume = asyncio.Event()
        first = asyncio.create_task(stalled_upload(stub, MODEL_A, resume))
        try:
            await poll(lambda: len(staging(running)) == 1, "the first upload is under way")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await upload(stub, ALICE, MODEL_B)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-uploads-per-client 1" in refused.value.details()
            assert not (await upload(stub, BOB, MODEL_B)).deduplicated  # bob has his own
        finally:
            resume.set()
            done = await first
        assert done.sha256 == sha(MODEL_A)
        assert (await upload(stub, ALICE, MODEL_B)).sha256 == sha(MODEL_B)


async def held_upload(
    stub: pb_grpc.EdgeBrokerStub, api_key: str, parts: list[bytes], resume: asyncio.Event
) -> pb.UploadModelResponse:
    """An upload that sends `parts` (one chunk each), then nothing until `resume` is set."""

    async def chunks() -> AsyncIterator[npb.ModelChunk]:
        for number, part in enumerate(parts):
            yield npb.ModelChunk(sha256="" if number else "cd" * 32, name="held", data=part)
        await resume.wait()

    return await stub.UploadModel(chunks(), metadata=key(api_key), timeout=30)


async def test_staged_bytes_are_capped_per_client_and_broker_wide_as_chunks_arrive(
    broker_at: BrokerFactory,
) -> None:
    settings = BrokerSettings(
        quotas=Quotas(staged_bytes=300_000, uploads=3), max_staged_upload_bytes=500_000
    )
    async with broker_at(settings=settings) as running, edge(running) as stub:
        staged = running.broker.limits.staged
        resume = asyncio.Event()
        held = [
            asyncio.create_task(held_upload(stub, ALICE, [bytes(150_000)] * 2, resume)),
            asyncio.create_task(held_upload(stub, BOB, [bytes(100_000)], resume)),
        ]
        try:
            await poll(lambda: staged.total == 400_000, "both uploads are staged")
            assert (staged.of("alice"), staged.of("bob")) == (300_000, 100_000)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await upload(stub, ALICE, bytes(1))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "(--max-staged-upload-bytes-per-client 300000)" in refused.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await upload(stub, BOB, bytes(100_001))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "(--max-staged-upload-bytes 500000)" in refused.value.details()
            assert len(staging(running)) == 2  # the refused ones left nothing
            assert staged.total == 400_000
        finally:
            resume.set()
            for done in await asyncio.gather(*held, return_exceptions=True):
                # Not ONNX: refused when finished, its staging gone.
                assert isinstance(done, grpc.aio.AioRpcError), done
                assert done.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert staged.total == 0
        assert staging(running) == []
        assert (await upload(stub, BOB, MODEL_B)).sha256 == sha(MODEL_B)
        assert staged.total == 0


async def test_an_upload_cancelled_midway_gives_back_its_bytes_and_its_file(
    broker_at: BrokerFactory,
) -> None:
    async with broker_at() as running, edge(running) as stub:
        staged = running.broker.limits.staged
        resume = asyncio.Event()
        held = asyncio.create_task(held_upload(stub, ALICE, [bytes(200_000)], resume))
        await poll(lambda: staged.of("alice") == 200_000, "the first chunk is staged")
        assert len(staging(running)) == 1
        held.cancel()  # the client gives up: its call is cancelled
        with pytest.raises(asyncio.CancelledError):
            await held
        await poll(lambda: staged.total == 0, "the staged bytes are given back")
        await poll(lambda: staging(running) == [], "the staging file is removed")


async def test_the_model_bytes_quota_stops_an_upload_at_the_chunk_that_passes_it(
    broker_at: BrokerFactory,
) -> None:
    quotas = Quotas(model_bytes=len(MODEL_A) + 1000)
    async with broker_at(quotas) as running, edge(running) as stub:
        await upload(stub, ALICE, MODEL_A)
        resume = asyncio.Event()
        try:
            # 600 bytes fit, 600 more do not: refused while the client still holds its
            # stream open, not when it ends.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await held_upload(stub, ALICE, [bytes(600), bytes(600)], resume)
        finally:
            resume.set()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"(--max-model-bytes-per-client {len(MODEL_A) + 1000}) with this chunk" in (
            refused.value.details()
        )
        await poll(lambda: staging(running) == [], "the staging file is removed")
        assert running.broker.limits.staged.total == 0
        # Its own model again adds nothing to its quota: taken, deduplicated.
        assert (await upload(stub, ALICE, MODEL_A)).deduplicated


async def test_staging_left_by_a_crash_is_removed_at_start(
    broker_at: BrokerFactory, tmp_path: Path
) -> None:
    leftover = tmp_path / "state" / "models" / ".upload-crashed"
    leftover.mkdir(parents=True)
    (leftover / "model.onnx").write_bytes(MODEL_A[:100])
    async with broker_at() as running:
        assert staging(running) == []


# -- a bad value in the store never breaks a read path ---------------------------------------


async def test_an_infinite_downtime_in_the_store_reads_as_null(
    broker_at: BrokerFactory, tmp_path: Path
) -> None:
    async with broker_at() as running, edge(running) as stub:
        await upload(stub, ALICE, MODEL_A)
    now = time.time()
    seed(
        tmp_path / "state",
        *(
            NodeRecord(node_id, "127.0.0.1:1", "site-a", NodeState.LOST, '{"gpus": []}', (),
                       now, now, "{}")
            for node_id in ("n-1", "n-2")
        ),
        pending("d-1", "alice", sha(MODEL_A)),
        MigrationRecord(
            "m-1", "d-1", MigrationTrigger.MOBILITY, "n-1", "n-2",
            MigrationStrategy.MAKE_BEFORE_BREAK, MigrationState.COMPLETED, "[]", "succeeded",
            "", math.inf, 0, now, now,
        ),
    )  # fmt: skip
    async with broker_at() as running, edge(running) as stub:
        async with aiohttp.ClientSession(headers=ops_headers_for(running)) as http:
            base = f"http://127.0.0.1:{running.ops_port}"
            async with http.get(f"{base}/api/migrations") as response:
                assert response.status == 200
                listed = await response.json()
        assert [(m["migration_id"], m["downtime_ms"]) for m in listed] == [("m-1", None)]
        reply = await stub.ListMigrations(
            pb.ListMigrationsRequest(deployment_id="d-1"), metadata=key(ALICE), timeout=15
        )
        assert [(m.migration_id, m.downtime_ms) for m in reply.migrations] == [("m-1", -1.0)]


def ops_headers_for(running: RunningBroker) -> dict[str, str]:
    return ops_headers(running.store.path.parent / "ops-token")
