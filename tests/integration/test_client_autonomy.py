"""Adaptive offload against a real broker and node daemons (process runtime) on loopback:
a device with its own copy of the model keeps answering when the broker and its replica's
node die, and goes back to the replica when they return."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import modelzoo
from bench.link import Conditions, DelayLink
from edge_client.adaptive import AdaptiveSettings, Decision, Reason, Target
from edge_client.client import OffloadClient
from edge_client.errors import InvalidInput, NotDeployed
from tests.cluster_support import THREE_NODES, Cluster, InferenceLoad, until


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        await asyncio.gather(*(cluster.start_node(plan, "process") for plan in THREE_NODES))
        yield cluster
    finally:
        await cluster.stop()


async def _until(condition: Callable[[], bool], what: str) -> None:
    """`until`, with the time a loaded machine needs to restart a broker and a node."""
    await until(condition, what, timeout_s=90)


def _reference(model: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def _load(client: OffloadClient, model: Path) -> InferenceLoad:
    """A steady request loop, one at a time; every answer is checked against ONNX Runtime."""
    inputs = modelzoo.sample_inputs(model)
    return InferenceLoad(client, inputs, _reference(model, inputs))


def _remote(client: OffloadClient) -> int:
    return client.stats().offload.remote_requests


def _local(client: OffloadClient) -> int:
    return client.stats().offload.local_requests


async def test_killing_the_broker_then_the_replicas_node_fails_no_request(
    cluster: Cluster,
) -> None:
    model = modelzoo.model_path("mlp")
    async with OffloadClient(
        cluster.broker_address,
        cluster.api_keys["alice"],
        local_model=model,
        policy="remote-then-local",
        offload_report_s=0.5,
    ) as client:
        first = await client.deploy(await client.upload_model(model), "mlp", site="site-a")
        assert first.node_id == "node-a"
        load = _load(client, model)
        try:
            await _until(lambda: _remote(client) > 10, "remote inference")
            # The broker dies: the replica keeps serving, nothing runs locally.
            cluster.kill_broker()
            before = _remote(client)
            await _until(lambda: _remote(client) > before + 20, "remote inference, broker down")
            assert _local(client) == 0
            # The replica's node dies too (daemon and replica): the local model serves.
            node_a = cluster.nodes["node-a"]
            node_a.send_signal(signal.SIGKILL)
            node_a.wait()
            os.kill(cluster.replica_pid(first), signal.SIGKILL)
            await _until(lambda: _local(client) > 20, "local inference, broker and node down")
            assert not client.stats().offload.remote_reachable
            # Both return: the deployment is placed again and requests go remote again.
            await cluster.start_broker()
            await cluster.start_node(THREE_NODES[0], "process")
            await _until(
                lambda: client.deployment is not None and client.deployment.epoch >= 2,
                "the deployment placed again",
            )
            after = _remote(client)
            await _until(lambda: _remote(client) > after + 20, "remote inference again")
        finally:
            await load.stop()
    assert load.failures == []
    stats = client.stats()
    assert stats.failures == 0 and stats.requests == load.successes
    offload = stats.offload
    assert offload.remote_reachable and offload.preferred == Target.REMOTE
    counts = {(c.target, c.reason): c.requests for c in offload.decisions}
    assert counts[Target.LOCAL, Reason.FALLBACK] >= 1
    assert counts[Target.LOCAL, Reason.REMOTE_DOWN] > 0
    # The replica came back through probes, each raced against the local model.
    assert offload.raced >= 1


async def test_policies_choose_by_figures_and_local_models_are_checked(
    cluster: Cluster, tmp_path: Path
) -> None:
    mlp = modelzoo.model_path("mlp")
    key = cluster.api_keys["bob"]
    with pytest.raises(InvalidInput, match="unknown offload policy 'nearest'"):
        OffloadClient(cluster.broker_address, key, local_model=mlp, policy="nearest")
    with pytest.raises(InvalidInput, match="needs a local model"):
        OffloadClient(cluster.broker_address, key, policy="fastest")
    with pytest.raises(InvalidInput, match="no such file"):
        OffloadClient(cluster.broker_address, key, local_model=tmp_path / "absent.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model" * 100)
    with pytest.raises(InvalidInput, match="cannot be loaded"):
        async with OffloadClient(cluster.broker_address, key, local_model=garbage):
            pass

    # A local model whose inputs differ from the deployment's is refused; the deployment is
    # still followed, remotely.
    transformer = modelzoo.model_path("transformer")
    async with OffloadClient(cluster.broker_address, key, local_model=mlp) as client:
        sha = await client.upload_model(transformer)
        with pytest.raises(InvalidInput, match=r"cannot stand in for deployment .*input_ids"):
            await client.deploy(sha, "transformer", site="site-b")
        await client.infer(modelzoo.sample_inputs(transformer))
        assert client.stats().offload.remote_requests == 1

    # `local` needs no deployment; `fastest` (the default with a local model) runs the
    # small model where it is faster (here: in process) and probes the replica now and then.
    inputs = modelzoo.sample_inputs(mlp)
    expected = _reference(mlp, inputs)
    async with OffloadClient(cluster.broker_address, key, local_model=mlp, policy="local") as c:
        outputs = await c.infer(inputs)
        assert c.stats().offload.local_requests == 1
    np.testing.assert_allclose(outputs["logits"], expected["logits"], rtol=1e-5, atol=1e-6)
    async with OffloadClient(cluster.broker_address, key) as plain:
        with pytest.raises(NotDeployed):
            await plain.infer(inputs)
    async with OffloadClient(cluster.broker_address, key, local_model=mlp) as client:
        await client.deploy(await client.upload_model(mlp), "mlp", site="site-c")
        for _ in range(60):
            outputs = await client.infer(inputs)
            np.testing.assert_allclose(outputs["logits"], expected["logits"], rtol=1e-5, atol=1e-6)
        offload = client.stats().offload
        # Inputs neither side can take are refused on whichever side the request goes to
        # (a probe of the replica every third request here, raced or alone as the figures
        # of this loaded machine say, whatever it costs), counted nowhere, and probing goes
        # on: a refused probe leaves no race open (one would hold every later probe back).
        unencodable = {name: np.zeros(a.shape, np.complex64) for name, a in inputs.items()}
        # A raced probe of the loop above may still be out on a loaded machine (one race at
        # a time: it would hold the probes below back); what follows starts with none.
        await client.probes_settled()
        chooser = client._chooser
        chooser.settings = AdaptiveSettings(
            probe_every=2, probe_min_requests=1, probe_cost_budget=1000
        )
        decided: list[Decision] = []
        choose = chooser.choose

        def spy(now: float) -> Decision:
            decision = choose(now)
            decided.append(decision)
            return decision

        chooser.choose = spy  # type: ignore[method-assign]
        for _ in range(6):
            with pytest.raises(InvalidInput, match="cannot be encoded"):
                await client.infer(unencodable)
        assert client.stats().offload.decisions == offload.decisions
        assert Target.REMOTE in {d.target for d in decided}, decided
        decided.clear()
        for _ in range(6):
            await client.infer(inputs)
        assert Target.REMOTE in {d.target for d in decided}, decided
    counts = {(c.target, c.reason): c.requests for c in offload.decisions}
    assert offload.policy == "fastest" and offload.preferred == Target.LOCAL
    assert counts[Target.REMOTE, Reason.MEASURING] == 2
    # The replica is still probed, each probe raced against the local model: the request
    # counts once, under the side that answered first (here the local model, nearly always).
    assert offload.raced > 0
    assert counts[Target.LOCAL, Reason.FASTER] > counts.get((Target.REMOTE, Reason.PROBE), 0)
    assert sum(counts.values()) == 60


async def test_the_replica_side_of_a_raced_probe_is_waited_for(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a slow link every probe of the replica races the local model: the application
    has the local answer at once while the replica's side is still out, and
    `probes_settled` waits for that side (it returns how many it waited for)."""
    mlp = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(mlp)
    link = DelayLink(Conditions(delay_ms=150.0))
    await link.start()
    try:
        monkeypatch.setenv("grpc_proxy", f"http://127.0.0.1:{link.port}")
        every_request = AdaptiveSettings(probe_every=1, probe_min_requests=1)
        async with OffloadClient(
            cluster.broker_address, cluster.api_keys["bob"], local_model=mlp,
            adaptive=every_request, offload_report_s=0,
        ) as client:  # fmt: skip
            await client.deploy(await client.upload_model(mlp), "mlp", site="site-a")
            for _ in range(5):  # each side measured twice, then compared: the local model wins
                await client.infer(inputs)
            assert client.stats().offload.preferred == Target.LOCAL
            assert await client.probes_settled() == 0
            raced = client.stats().offload.raced
            while client.stats().offload.raced == raced:
                await client.infer(inputs)
            # The probe's local side answered; its replica side is 300 ms of link away.
            assert await client.probes_settled() == 1
            assert await client.probes_settled() == 0
    finally:
        await link.close()
