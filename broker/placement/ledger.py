"""`PlacementLedger`: placement's view of the cluster, kept change by change.

The broker tells the ledger each change in placement's own terms, as it makes it: a node
registered or changed (`put_node`: its site, topology, readiness, runtimes, CUDA), its load
(`set_load`), a node gone (`remove_node`), an allocation added or re-prioritised
(`allocate`: a deployment placed, pinned while it starts or moves, a hold) and one released
(`release`). `snapshot()` hands placement a `ClusterSnapshot` with the nodes changed since
the last call made again and applied in one copy-on-write pass (`ClusterSnapshot.updated`).

What it replaces: making a changed node's entry again from the broker's records at the next
decision (every deployment on the node parsed back from its stored request, every hold of
the cluster scanned for the node's). Here a change only records the allocation; a node
changed several times between two decisions (a first decision's hold, then its record, then
the hold dropped) is made once, from the allocations the ledger holds, when placement next
reads it; nothing is parsed or scanned.

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

    __slots__ = ("_allocations", "_bases", "_changed", "_snapshot")

    def __init__(self) -> None:
        self._bases: dict[str, NodeSnapshot] = {}
        """node id -> the node with nothing on it (what `put_node` and `set_load` said)."""
        self._allocations: dict[str, dict[str, Allocation]] = {}
        """node id -> allocation id -> allocation, known nodes or not."""
        self._changed: set[str] = set()
        """Nodes added, changed or removed since `snapshot` last applied them."""
        self._snapshot = ClusterSnapshot.empty()

    def __len__(self) -> int:
        return len(self._bases)

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
        allocations on it stay. ValueError for fields `NodeSnapshot` refuses."""
        self._bases[node_id] = NodeSnapshot.idle(
            node_id,
            site,
            topology,
            ready=ready,
            runtimes=runtimes,
            cuda_version=cuda_version,
            load=load,
        )
        self._changed.add(node_id)

    def set_load(self, node_id: str, load: float) -> None:
        """The node's latest load (0..1); nothing for a node the ledger does not know.
        ValueError for a load outside 0..1."""
        base = self._bases.get(node_id)
        if base is not None and base.load != load:
            self._bases[node_id] = replace(base, load=load)
            self._changed.add(node_id)

    def remove_node(self, node_id: str) -> None:
        """Take the node out of placement's view (its allocations are kept, should it come
        back); idempotent."""
        if self._bases.pop(node_id, None) is not None:
            self._changed.add(node_id)

    def allocate(self, node_id: str, allocation: Allocation) -> None:
        """Hold `allocation` on the node, replacing the one of the same id there if any (the
        same deployment at another priority: pinned while it starts or is moved, unpinned
        after). Whether it fits is the decision's to know: `snapshot` refuses a node whose
        allocations do not fit it."""
        self._allocations.setdefault(node_id, {})[allocation.deployment_id] = allocation
        if node_id in self._bases:
            self._changed.add(node_id)

    def release(self, node_id: str, allocation_id: str) -> None:
        """Give back the allocation of that id on the node; idempotent."""
        held = self._allocations.get(node_id)
        if held is None or held.pop(allocation_id, None) is None:
            return
        if not held:
            del self._allocations[node_id]
        if node_id in self._bases:
            self._changed.add(node_id)

    def snapshot(self) -> ClusterSnapshot:
        """Every known node with its allocations, as one `ClusterSnapshot`: the previous one
        with the nodes changed since made again (the rest shared with it). ValueError, the
        previous snapshot kept and the changes still pending, when a node's allocations do
        not fit it (two holding one whole GPU: the records contradict each other)."""
        if self._changed:
            nodes = [
                _holding(self._bases[n], self._allocations.get(n, {}))
                for n in self._changed
                if n in self._bases
            ]
            gone = [n for n in self._changed if n not in self._bases]
            self._snapshot = self._snapshot.updated(nodes, removed=gone)
            self._changed.clear()
        return self._snapshot


def _holding(base: NodeSnapshot, held: Mapping[str, Allocation]) -> NodeSnapshot:
    """`base` holding `held`, in order of id. ValueError when they do not fit."""
    if not held:
        return base
    return base.with_allocations(held[key] for key in sorted(held))
