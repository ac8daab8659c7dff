"""The placement applier: the one place placement decisions are checked and applied.

Every decision that reads and changes placement (place a deployment, reserve a move's
target, reserve a standby, requeue, switch, release) runs under its lock (`use`), on its
view of the cluster (`view`: the nodes as the registry has them, the deployments as stored,
and what is held beyond the records), one decision at a time: the check and the write are
under the same lock, never a check outside it. The view is kept up to date node by node:
the owners tell it what changed (`node_changed`, `records_changed`, `hold`, `claim`), and
only the stale nodes' entries are made again when a decision reads it. It owns the holds
(GPUs held for a replica beyond the records: a move's target, a switched move's source, a
first decision's until durable) and which deployments a move or a delete has taken."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from types import MappingProxyType

from broker.errors import Busy
from broker.nodes import NodeEntry, NodeRegistry
from broker.ops.metrics import BrokerMetrics
from broker.placement import (
    Allocation,
    ClusterSnapshot,
    NodeSnapshot,
    PriorityClass,
)
from broker.state import (
    DeploymentRecord,
    DeploymentState,
    NodeState,
)
from broker.timed_lock import TimedLock
from broker.values import (
    DeploymentReader,
    Hold,
    Standby,
    allocation_terms,
)


class PlacementApplier:
    """The one place placement decisions are checked and applied (see the module
    docstring): the decision lock, placement's view of the cluster, and what that view
    counts beyond the records (holds, deployments taken, first decisions not yet durable)."""

    def __init__(
        self, registry: NodeRegistry, table: DeploymentReader, metrics: BrokerMetrics
    ) -> None:
        self._registry = registry
        self._table = table
        self._lock = TimedLock(metrics.observe_placement_lock)
        """Held by every decision that reads and changes placement (deploy, place again,
        evict, reserve a move, switch, give up a move): one at a time, each naming its use
        for the lock's metrics."""
        self._placement = ClusterSnapshot.empty()
        """Placement's view of the cluster, up to date but for the `_stale` nodes."""
        self._stale: set[str] = set()
        """Nodes whose entry in `_placement` is out of date: their node entry, deployments,
        holds or a deployment's being taken by a move changed since it was made."""
        self._reloaded: set[str] = set()
        """Nodes whose load alone changed since their entry in `_placement` was made (every
        heartbeat's: the entry is copied with the new load, not made again)."""
        self._holds: dict[tuple[str, int], Hold] = {}
        """(deployment id, epoch) -> GPUs held for that replica beyond the records."""
        self._busy: set[str] = set()
        """Deployments being migrated or deleted: no other move or eviction takes them, and
        reconciliation leaves them alone (their replicas come and go on purpose)."""
        self._creating: dict[str, int] = {}
        """Client id -> its first decisions whose `starting` write is not durable yet
        (`Deployments.deploy`): its quota counts them."""

    def use(self, name: str) -> AbstractAsyncContextManager[None]:
        """The decision lock, for one decision named `name` (its metrics' label): the view
        read, the decision made and its writes queued, one decision at a time."""
        return self._lock.use(name)

    def node_changed(self, node_id: str, load_only: bool) -> None:
        """The registry's news (`NodeRegistry`'s `on_change`): the node's entry is stale."""
        (self._reloaded if load_only else self._stale).add(node_id)

    def records_changed(self, node_ids: Iterable[str]) -> None:
        """Deployments on these nodes changed in the table (`Deployments.keep`)."""
        self._stale.update(node_ids)

    def view(self, standbys: Iterable[Standby] = ()) -> ClusterSnapshot:
        """The cluster as placement sees it now (the stale nodes made again first); with
        `standbys` (`StandbyPool.held`), those standbys too (at the lowest priority: a
        standby's own placement sees them, a real one does not, and takes their GPUs at
        will: `StandbyPool.take_under`)."""
        if self._stale or self._reloaded:
            nodes = [
                self._node_snapshot(n, self._registry.nodes[n])
                for n in self._stale
                if n in self._registry.nodes
            ]
            for n in self._reloaded - self._stale:
                old, entry = self._placement.get(n), self._registry.nodes.get(n)
                if old is not None and entry is not None:
                    nodes.append(replace(old, load=entry.load))
            gone = [n for n in self._stale if n not in self._registry.nodes]
            self._placement = self._placement.updated(nodes, removed=gone)
            self._stale, self._reloaded = set(), set()
        view = self._placement
        for standby in standbys:
            node = view.get(standby.node_id)
            if node is not None:
                view = view.with_node(
                    node.with_allocation(
                        Allocation(
                            standby.allocation_id,
                            PriorityClass.STANDBY,
                            standby.record.gpus,
                            standby.memory_mib,
                        )
                    )
                )
        return view

    def _node_snapshot(self, node_id: str, entry: NodeEntry) -> NodeSnapshot:
        """The node as placement sees it: its deployments' allocations and the holds on it.
        What no decision may take away (a replica starting, a deployment being moved or
        deleted, a hold) is entered at the top priority, so nothing preempts it."""
        node = NodeSnapshot.idle(
            node_id,
            entry.record.site,
            entry.topology,
            ready=entry.record.state is NodeState.READY,
            runtimes=entry.record.runtimes,
            cuda_version=entry.inventory.cuda_version,
            load=entry.load,
        )
        allocations = []
        for d in self._table.on_node(node_id):
            priority, memory_mib = allocation_terms(d)
            pinned = d.state is DeploymentState.STARTING or d.deployment_id in self._busy
            allocations.append(
                Allocation(
                    d.deployment_id,
                    PriorityClass.CRITICAL if pinned else priority,
                    d.gpus,
                    memory_mib,
                )
            )
        for (deployment_id, epoch), hold in self._holds.items():
            if hold.node_id == node_id:
                allocations.append(
                    Allocation(
                        f"{deployment_id}@{epoch}",
                        PriorityClass.CRITICAL,
                        hold.gpus,
                        hold.memory_mib,
                    )
                )
        return node.with_allocations(allocations)

    @property
    def holds(self) -> Mapping[tuple[str, int], Hold]:
        """(deployment id, epoch) -> GPUs held beyond the records, read-only."""
        return MappingProxyType(self._holds)

    def hold(self, key: tuple[str, int], hold: Hold) -> None:
        """Hold GPUs for the replica `key` (deployment id, epoch) beyond the records."""
        self._holds[key] = hold
        self._stale.add(hold.node_id)

    def unhold(self, key: tuple[str, int]) -> None:
        """Drop the hold of `key`, if any (idempotent)."""
        hold = self._holds.pop(key, None)
        if hold is not None:
            self._stale.add(hold.node_id)

    def is_busy(self, deployment_id: str) -> bool:
        """Whether a move or a delete holds the deployment now."""
        return deployment_id in self._busy

    def claim(self, deployment_id: str) -> None:
        """Mark a deployment taken by a move or a delete, its allocation pinned (call under
        `use`). Busy when it is taken already."""
        if deployment_id in self._busy:
            raise Busy(
                f"deployment {deployment_id} is being migrated or deleted; "
                "retry when that has finished"
            )
        self._busy.add(deployment_id)
        self._stale_where(deployment_id)

    def untake(self, deployment_id: str) -> None:
        """Give back a deployment `claim` took (idempotent)."""
        self._busy.discard(deployment_id)
        self._stale_where(deployment_id)

    def _stale_where(self, deployment_id: str) -> None:
        record = self._table.get(deployment_id)
        if record is not None and record.node_id:
            self._stale.add(record.node_id)

    def creating(self, client_id: str) -> int:
        """The client's first decisions whose `starting` write is not durable yet."""
        return self._creating.get(client_id, 0)

    def hold_creation(self, record: DeploymentRecord, memory_mib: int) -> None:
        """Hold a first decision's GPUs, and count it against its client's quota, until
        `creation_settled` (its `starting` write durable or failed)."""
        assert record.node_id is not None
        self.hold(
            (record.deployment_id, record.epoch),
            Hold(record.node_id, record.gpus, memory_mib, PriorityClass.CRITICAL),
        )
        self._creating[record.client_id] = self._creating.get(record.client_id, 0) + 1

    def creation_settled(self, record: DeploymentRecord) -> None:
        """Drop what `hold_creation` held."""
        self.unhold((record.deployment_id, record.epoch))
        left = self._creating.pop(record.client_id) - 1
        if left:
            self._creating[record.client_id] = left
