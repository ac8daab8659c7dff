"""`DeploymentTable`: the broker's deployments in memory, as the store has them.

The leading broker is the only writer of deployment records (a standby writes nothing, and a
leader that lost its lease is fenced out of the store), so once it has loaded them at start,
a copy it changes after each write the store commits *is* the stored state. Reading it costs
no round trip to the state thread, and it is indexed the way the broker asks: by client (the
quota check of every deploy, a client's list) and by node (placement's view of a node,
reconciling a node's heartbeat). Before it, every deploy and every heartbeat read rows of
every deployment from the store, which saturated one control plane at a few hundred nodes
(docs/benchmarks-history.md, "One control plane at scale").

Deleted deployments are not kept: their rows stay in the store (the audit trail), and the
few callers that want one read it there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable

from broker.state import DeploymentRecord, DeploymentState

ACTIVE = frozenset({DeploymentState.STARTING, DeploymentState.RUNNING})
"""Deployments that hold GPUs on a node."""


class DeploymentTable:
    """Deployment id -> record, for every deployment not deleted; see the module docstring.

    `put` returns the nodes whose allocations the change touched, so that placement's view
    of them can be brought up to date."""

    def __init__(self) -> None:
        self._records: dict[str, DeploymentRecord] = {}
        self._by_client: dict[str, set[str]] = {}
        self._states: dict[str, Counter[DeploymentState]] = {}
        """client id -> how many of its deployments are in each state (`count`, every
        deploy's quota check, without a pass over the client's deployments)."""
        self._on_node: dict[str, set[str]] = {}
        """node id -> the active deployments placed on it."""

    def __len__(self) -> int:
        return len(self._records)

    def load(self, records: Iterable[DeploymentRecord]) -> None:
        """Replace the contents with `records` (the store's, at start)."""
        self._records.clear()
        self._by_client.clear()
        self._states.clear()
        self._on_node.clear()
        for record in records:
            self.put(record)

    def put(self, record: DeploymentRecord) -> set[str]:
        """Keep `record` as the deployment's current one (a deleted one is dropped); the
        nodes it left or joined as an active deployment."""
        touched: set[str] = set()
        old = self._records.pop(record.deployment_id, None)
        if old is not None:
            self._by_client[old.client_id].discard(old.deployment_id)
            if not self._by_client[old.client_id]:
                del self._by_client[old.client_id]
                del self._states[old.client_id]
            else:
                self._states[old.client_id][old.state] -= 1
            if old.node_id and old.state in ACTIVE:
                self._on_node[old.node_id].discard(old.deployment_id)
                if not self._on_node[old.node_id]:
                    del self._on_node[old.node_id]
                touched.add(old.node_id)
        if record.state is DeploymentState.DELETED:
            return touched
        self._records[record.deployment_id] = record
        self._by_client.setdefault(record.client_id, set()).add(record.deployment_id)
        self._states.setdefault(record.client_id, Counter())[record.state] += 1
        if record.node_id and record.state in ACTIVE:
            self._on_node.setdefault(record.node_id, set()).add(record.deployment_id)
            touched.add(record.node_id)
        return touched

    def get(self, deployment_id: str) -> DeploymentRecord | None:
        """The deployment, None when unknown or deleted."""
        return self._records.get(deployment_id)

    def select(
        self, client_id: str | None = None, states: Collection[DeploymentState] | None = None
    ) -> list[DeploymentRecord]:
        """Deployments of one client or all, in `states` or any, oldest first (as the
        store lists them)."""
        ids = self._records.keys() if client_id is None else self._by_client.get(client_id, ())
        found = [self._records[i] for i in ids]
        if states is not None:
            found = [r for r in found if r.state in states]
        found.sort(key=lambda r: (r.created_at, r.deployment_id))
        return found

    def count(self, client_id: str, states: Collection[DeploymentState]) -> int:
        """How many of the client's deployments are in `states`."""
        counts = self._states.get(client_id)
        return 0 if counts is None else sum(counts[state] for state in set(states))

    def on_node(self, node_id: str) -> list[DeploymentRecord]:
        """The active (starting, running) deployments placed on the node, oldest first."""
        found = [self._records[i] for i in self._on_node.get(node_id, ())]
        found.sort(key=lambda r: (r.created_at, r.deployment_id))
        return found
