"""`PlacementLedger`: placement's view of the cluster, kept change by change.

The broker tells the ledger each change in placement's own terms, as it makes it: a node
registered or changed (`put_node`: its site, topology, readiness, runtimes, CUDA), its load
(`set_load`), a node gone (`remove_node`), an allocation added or re-prioritised
(`allocate`: a deployment placed, pinned while it starts or moves, a hold) and one released
(`release`). `snapshot()` hands placement a `ClusterSnapshot` with the nodes changed since
the last call applied in one copy-on-write pass (`ClusterSnapshot.updated`).

What it replaces: marking a node stale and, at the next decision, making its entry again
from the broker's records (every deployment on the node parsed back from its stored request,
every hold of the cluster scanned for the node's). Here a change costs one `NodeSnapshot` of
the node it touches, made from the allocations the ledger already holds; nothing is parsed
or scanned, and a change is checked when it is made (ValueError: it does not fit), not at
the next decision.

Allocations may name a node the ledger does not know yet (a deployment loaded from the
store before its node registers again): they are kept, and the node holds them once
`put_node` adds it. A node holds its allocations in order of id, so a node built change by
change equals the node built at once from the same allocations. Not thread-safe: one owner
(the broker's placement applier) calls it, on the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from broker.placement.model import Allocation, NodeSnapshot
from broker.placement.snapshot import ClusterSnapshot
from common.topology import Topology


class PlacementLedger:
    """Nodes and their allocations as placement sees them (see the module docstring)."""

    __slots__ = ("_allocations", "_bases", "_changed", "_nodes", "_snapshot")

    def __init__(self) -> None:
        self._bases: dict[str, NodeSnapshot] = {}
        """node id -> the node with nothing on it (what `put_node` and `set_load` said)."""
        self._nodes: dict[str, NodeSnapshot] = {}
        """node id -> the node as placement sees it now: its base holding its allocations."""
        self._allocations: dict[str, dict[str, Allocation]] = {}
        """node id -> allocation id -> allocation, known nodes or not."""
        self._changed: set[str] = set()
        """Nodes added, changed or removed since `snapshot` last applied them."""
        self._snapshot = ClusterSnapshot.empty()

    def __len__(self) -> int:
        return len(self._nodes)

    def node(self, node_id: str) -> NodeSnapshot | None:
        """The node as placement sees it now; None for a node the ledger does not know."""
        return self._nodes.get(node_id)

    def allocations(self, node_id: str) -> Mapping[str, Allocation]:
        """The allocations on a node (known or not), by id."""
        return dict(self._allocations.get(node_id, {}))

    def put_node(
        self,
        node_id: str,
        site: str,
        topology: Topology,
        *,
        ready: bool,
        runtimes: Iterable[str],
        cuda_version: str,
        load: float,
    ) -> None:
        """Add the node, or change what it is (registered again, drained, lost, back); the
        allocations on it stay. ValueError (nothing changed) when they do not fit it."""
        base = NodeSnapshot.idle(
            node_id,
            site,
            topology,
            ready=ready,
            runtimes=runtimes,
            cuda_version=cuda_version,
            load=load,
        )
        self._nodes[node_id] = _holding(base, self._allocations.get(node_id, {}))
        self._bases[node_id] = base
        self._changed.add(node_id)

    def set_load(self, node_id: str, load: float) -> None:
        """The node's latest load (0..1); nothing for a node the ledger does not know.
        ValueError for a load outside 0..1."""
        node = self._nodes.get(node_id)
        if node is not None and node.load != load:
            self._nodes[node_id] = replace(node, load=load)
            self._bases[node_id] = replace(self._bases[node_id], load=load)
            self._changed.add(node_id)

    def remove_node(self, node_id: str) -> None:
        """Take the node out of placement's view (its allocations are kept, should it come
        back); idempotent."""
        if self._nodes.pop(node_id, None) is not None:
            del self._bases[node_id]
            self._changed.add(node_id)

    def allocate(self, node_id: str, allocation: Allocation) -> None:
        """Hold `allocation` on the node, replacing the one of the same id there if any (the
        same deployment at another priority: pinned while it starts or is moved, unpinned
        after). ValueError (nothing changed) when it does not fit the node."""
        held = {**self._allocations.get(node_id, {}), allocation.deployment_id: allocation}
        self._apply(node_id, held)

    def release(self, node_id: str, allocation_id: str) -> None:
        """Give back the allocation of that id on the node; idempotent."""
        held = self._allocations.get(node_id, {})
        if allocation_id in held:
            self._apply(node_id, {k: a for k, a in held.items() if k != allocation_id})

    def snapshot(self) -> ClusterSnapshot:
        """Every known node with its allocations, as one `ClusterSnapshot`: the previous one
        with the nodes changed since applied (the rest shared with it)."""
        if self._changed:
            nodes = [self._nodes[n] for n in self._changed if n in self._nodes]
            gone = [n for n in self._changed if n not in self._nodes]
            self._snapshot = self._snapshot.updated(nodes, removed=gone)
            self._changed.clear()
        return self._snapshot

    def _apply(self, node_id: str, held: dict[str, Allocation]) -> None:
        """The node's allocations become `held` (checked first: ValueError, nothing changed,
        when they do not fit a known node)."""
        base = self._bases.get(node_id)
        if base is not None:
            self._nodes[node_id] = _holding(base, held)
            self._changed.add(node_id)
        if held:
            self._allocations[node_id] = held
        else:
            self._allocations.pop(node_id, None)


def _holding(base: NodeSnapshot, held: Mapping[str, Allocation]) -> NodeSnapshot:
    """`base` holding `held`, in order of id. ValueError when they do not fit."""
    return base.with_allocations(held[key] for key in sorted(held))
