"""The broker's in-memory deployments (`broker.deployment_table`) and the placement view it
keeps up to date node by node (`Broker._placement_view`): after any sequence of changes, the
view is the one a rebuild from scratch gives, and the table is what the store has."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from bench.placement import CAPTURES
from broker import values
from broker.deployment_table import ACTIVE, DeploymentTable
from broker.errors import ResourceExhausted, StateUnavailable
from broker.placement import ClusterSnapshot, PriorityClass
from broker.quotas import Quotas
from broker.service import Broker
from broker.state import (
    DeploymentRecord,
    DeploymentState,
    StorageError,
)
from broker.telemetry import NodeSample
from broker.values import VISIBLE, DeploySpec, Hold, spec_of
from common.node_identity import new_secret
from node_daemon.inventory.topo_file import inventory_from_capture
from tests.broker_support import SHA, local_broker
from tests.cluster_support import until
from tests.data import TOPOLOGIES


def record(deployment_id: str, client: str, state: DeploymentState, node: str | None, t: float):
    return DeploymentRecord(
        deployment_id=deployment_id,
        client_id=client,
        model_sha256=SHA,
        model_name="m",
        request_json="{}",
        priority=1,
        site="site-a",
        state=state,
        node_id=node,
        gpus=(),
        gpu_uuids=(),
        endpoint="",
        token="",
        epoch=1,
        explanation_json="{}",
        reason="",
        created_at=t,
        updated_at=t,
    )


def test_the_table_indexes_by_client_and_node_and_drops_deleted() -> None:
    table = DeploymentTable()
    running = record("d-1", "alice", DeploymentState.RUNNING, "n1", 2.0)
    pending = record("d-2", "alice", DeploymentState.PENDING, None, 1.0)
    table.load([running, pending, record("d-3", "bob", DeploymentState.STARTING, "n1", 3.0)])
    assert [r.deployment_id for r in table.select(client_id="alice")] == ["d-2", "d-1"]
    assert table.count("alice", VISIBLE) == 2
    assert [r.deployment_id for r in table.on_node("n1")] == ["d-1", "d-3"]
    # Moving d-1 touches the node it left and the one it joined.
    assert table.put(replace(running, node_id="n2")) == {"n1", "n2"}
    assert [r.deployment_id for r in table.on_node("n2")] == ["d-1"]
    # Pending holds no node; deleted is gone from every index.
    assert table.put(replace(running, state=DeploymentState.PENDING, node_id=None)) == {"n2"}
    assert table.on_node("n2") == []
    assert table.put(replace(pending, state=DeploymentState.DELETED)) == set()
    assert table.get("d-2") is None
    assert [r.deployment_id for r in table.select()] == ["d-1", "d-3"]
    assert table.count("alice", (DeploymentState.PENDING,)) == 1


def test_counts_by_state_follow_every_change_as_a_recount_does() -> None:
    # `count` is every deploy's quota check: kept per client and state, never a pass over
    # the client's deployments; after any changes it equals counting them.
    rng = random.Random(7)
    table = DeploymentTable()
    states = list(DeploymentState)
    for step in range(2000):
        deployment_id = f"d-{rng.randrange(60)}"
        client = table.get(deployment_id).client_id if table.get(deployment_id) else None
        client = client or rng.choice(["alice", "bob", "carol"])
        state = rng.choice(states)
        node = rng.choice(["n1", "n2"]) if state in ACTIVE else None
        table.put(record(deployment_id, client, state, node, float(step)))
        for who in ("alice", "bob", "carol"):
            for asked in (VISIBLE, (state,), (), (state, state)):
                mine = table.select(client_id=who)
                assert table.count(who, asked) == sum(r.state in asked for r in mine)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    async with local_broker(tmp_path) as running:
        yield running


def from_scratch(broker: Broker) -> dict[str, object]:
    """Every node as a rebuild of the whole view makes it."""
    rebuilt = ClusterSnapshot.of(
        broker.applier._node_snapshot(n, e) for n, e in broker.nodes.items()
    )
    return {node.node_id: node for node in rebuilt}


async def test_the_view_kept_node_by_node_is_the_one_a_rebuild_makes(broker: Broker) -> None:
    rng = random.Random(7)
    inventories = [
        inventory_from_capture(next(TOPOLOGIES.glob(f"{n}_*.txt")), spec)
        for n, spec in CAPTURES.items()
    ]
    sites = broker.network.sites
    for i in range(12):
        await broker.register_node(
            f"n{i}",
            f"127.0.0.1:{1000 + i}",
            sites[i % len(sites)],
            inventories[i % 5],
            ["docker"],
            [],
            secret=new_secret(),
        )
    placed: list[str] = []
    holds: list[tuple[str, int]] = []
    for step in range(300):
        action = rng.choice(["deploy", "deploy", "pending", "take", "hold", "load", "delete"])
        if action == "deploy":
            spec = DeploySpec(
                model_sha256=SHA,
                model_name="m",
                gpus=rng.choice([1, 1, 2]),
                priority=rng.choice(list(PriorityClass)[1:]),
                site=rng.choice(sites),
            )
            try:
                rec, _ = await broker.deployments._reserve(f"d-{step}", "alice", spec, epoch=1)
            except ResourceExhausted:
                continue
            placed.append(rec.deployment_id)
            if rng.random() < 0.7:
                await broker.deployments.update(
                    rec.deployment_id, state=DeploymentState.RUNNING, endpoint="e:1"
                )
        elif action == "pending" and placed:
            await broker.deployments.write_pending(rng.choice(placed), "test")
        elif action == "take" and placed:
            chosen = rng.choice(placed)
            if broker.applier.is_busy(chosen):
                broker.applier.untake(chosen)
            else:
                broker.applier.claim(chosen)
        elif action == "hold":
            if holds and rng.random() < 0.5:
                broker.applier.unhold(holds.pop())
            else:
                node = rng.choice(list(broker.nodes))
                free = sorted(broker.applier.view().node(node).free)
                if free:
                    key = (f"h-{step}", 2)
                    broker.applier.hold(key, Hold(node, (free[0],), 0, PriorityClass.STANDARD))
                    holds.append(key)
        elif action == "load":
            node = rng.choice(list(broker.nodes))
            broker.heartbeat(node, NodeSample(cpu_cores=4, cpu_used_cores=rng.random() * 4), [])
        elif action == "delete" and placed:
            gone = placed.pop(rng.randrange(len(placed)))
            broker.deployments.keep(
                await broker._core.db(broker._core.store.delete_deployment, gone)
            )
        view = broker.applier.view()
        assert {node.node_id: node for node in view} == from_scratch(broker), action
    stored = broker._core.store.list_deployments(states=VISIBLE)
    assert await broker.deployments.visible() == stored
    assert any(n.allocations for n in broker.applier.view())


async def one_node(broker: Broker) -> None:
    inventory = inventory_from_capture(next(TOPOLOGIES.glob("21_*.txt")), CAPTURES["21"])
    await broker.register_node(
        "n0", "127.0.0.1:1000", "site-a", inventory, ["docker"], [], secret=new_secret()
    )


def block_the_state_thread(broker: Broker) -> threading.Event:
    """Hold the state thread until the event is set: every store call queues behind."""
    go = threading.Event()
    broker._core.db_queued(go.wait, 10.0)
    return go


def spec(gpus: int = 1) -> DeploySpec:
    return DeploySpec(model_sha256=SHA, model_name="m", gpus=gpus, site="site-a")


async def test_a_decision_holds_its_gpus_until_its_write_is_durable(broker: Broker) -> None:
    """A first decision leaves the placement lock before its `starting` write commits: the
    next decision does not take its GPUs, and the record is in the table only once stored."""
    await one_node(broker)
    go = block_the_state_thread(broker)
    first = asyncio.create_task(broker.deployments._reserve("d-1", "alice", spec(), epoch=1))
    second = asyncio.create_task(broker.deployments._reserve("d-2", "alice", spec(), epoch=1))
    # Both decided, neither written: the lock is free.
    await until(lambda: len(broker.applier.holds) == 2, "both decisions")
    assert (
        broker.deployments._table.get("d-1") is None
        and broker.deployments._table.get("d-2") is None
    )
    assert not first.done() and not second.done()
    held = [hold.gpus for hold in broker.applier.holds.values()]
    assert not set(held[0]) & set(held[1])
    go.set()
    (one, _), (two, _) = await first, await second
    assert {one.gpus, two.gpus} == set(held)
    assert (
        broker.deployments._table.get("d-1") is one and broker.deployments._table.get("d-2") is two
    )
    assert broker._core.store.get_deployment("d-1") == one
    assert not broker.applier.holds and not broker.applier._creating


async def test_a_decision_whose_write_fails_frees_its_gpus_and_leaves_no_record(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    await one_node(broker)

    def disk_full(record: DeploymentRecord) -> None:
        raise StorageError("database or disk is full")

    with monkeypatch.context() as patched:
        patched.setattr(broker._core.store, "create_deployment", disk_full)
        with pytest.raises(StateUnavailable):
            await broker.deployments._reserve("d-1", "alice", spec(), epoch=1)
    assert (
        broker.deployments._table.get("d-1") is None
        and broker._core.store.get_deployment("d-1") is None
    )
    assert not broker.applier.holds and not broker.applier._creating
    largest, _ = broker.applier.view().largest()
    placed, _ = await broker.deployments._reserve("d-2", "alice", spec(gpus=largest), epoch=1)
    assert len(placed.gpus) == largest  # every GPU free again


async def test_decisions_not_yet_written_count_against_the_quota(broker: Broker) -> None:
    await one_node(broker)
    broker.limits.quotas = Quotas(deployments=1)
    go = block_the_state_thread(broker)
    first = asyncio.create_task(broker.deployments._reserve("d-1", "alice", spec(), epoch=1))
    await until(lambda: bool(broker.applier.holds), "the first decision")
    with pytest.raises(ResourceExhausted, match="has 1 deployments"):
        await broker.deployments._reserve("d-2", "alice", spec(), epoch=1)
    go.set()
    await first
    assert not broker.applier._creating


async def test_a_delete_awaits_its_commit_outside_the_placement_lock(broker: Broker) -> None:
    """While a delete's write waits on the state thread, another decision is taken (the
    lock is free) and the deployment is still in the table; once durable, it is gone."""
    await one_node(broker)
    record, _ = await broker.deployments._reserve("d-1", "alice", spec(), epoch=1)
    async with broker.applier._lock.use("test"):
        await broker.deployments.write_pending(record.deployment_id, "test")  # no replica to stop
    go = block_the_state_thread(broker)
    deleting = asyncio.create_task(broker.deployments.delete("alice", "d-1"))
    await until(lambda: broker.applier.is_busy("d-1"), "the delete's claim")
    await asyncio.sleep(0.05)  # the delete is at its write
    deciding = asyncio.create_task(broker.deployments._reserve("d-2", "alice", spec(), epoch=1))
    await until(lambda: bool(broker.applier.holds), "a decision beside the delete's write")
    assert broker.deployments._table.get("d-1") is not None and not deleting.done()
    go.set()
    await deleting
    await deciding
    assert broker.deployments._table.get("d-1") is None
    stored = broker._core.store.get_deployment("d-1")
    assert stored is not None and stored.state is DeploymentState.DELETED


async def test_a_deployments_request_is_parsed_once_however_often_it_is_read(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`values.spec_of`: the stored request of a deployment is parsed the first time it is
    read; placement's view made again, a requeue and the owners' reads after that reuse it
    (the same frozen value)."""
    parsed: list[str] = []
    parse = DeploySpec.from_json

    def counted(text: str) -> DeploySpec:
        parsed.append(text)
        return parse(text)

    monkeypatch.setattr(DeploySpec, "from_json", staticmethod(counted))
    values._parsed.cache_clear()
    await one_node(broker)
    wanted = [spec(), spec(gpus=2)]
    records = [
        (await broker.deployments._reserve(f"d-{i}", "alice", s, epoch=1))[0]
        for i, s in enumerate(wanted)
    ]
    for record in records:
        await broker.deployments.update(
            record.deployment_id, state=DeploymentState.RUNNING, endpoint="e:1"
        )
        broker.applier.claim(record.deployment_id)  # the node's entry made again
        broker.applier.view()
        broker.applier.untake(record.deployment_id)
        broker.applier.view()
        stored = broker.deployments.table.get(record.deployment_id)
        assert stored is not None and spec_of(stored) is spec_of(record)
    assert [spec_of(r) for r in records] == wanted
    assert sorted(parsed) == sorted({r.request_json for r in records})
