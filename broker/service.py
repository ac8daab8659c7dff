"""The broker's domain, behind one facade: `Broker` builds the owners and wires them.

Each owner is a module with its own state and intent-level operations; nobody else writes
its fields (tests/unit/test_broker_owners.py fails when a module reaches into another
object's private state):

- `broker.nodes.NodeRegistry`: the nodes, their secrets, liveness and resizes;
- `broker.applier.PlacementApplier`: the decision lock, placement's view of the cluster,
  the GPU holds and the deployments a move or a delete has taken; every placement decision
  is checked and applied there, one at a time;
- `broker.deployments.Deployments`: the deployment records and their watchers; deploy,
  place again, requeue, delete;
- `broker.moves.Moves`: a migration's steps (reserve, start, switch, abandon, release) and
  the migration records;
- `broker.standbys.StandbyPool`: pre-warmed replicas;
- `broker.reconciler.Reconciler`: what nodes report against what is expected;
- `broker.uploads.Uploads` and `broker.reports.OffloadReports`: models and offload reports;
- `broker.services.Services`: models published for many clients, their replicas (deployments
  of their owner) and which client is on which.

They share a `broker.core.Core`: the state store's one thread and the broker's own tasks.
The gRPC servicers in `broker.rpc` are thin layers over the facade and the owners.

Reads of deployments and of the cluster come from memory: the deployments as stored
(`DeploymentTable`, changed after every write the store commits) and placement's view of
the cluster, brought up to date node by node when a decision reads it. A deploy, a
heartbeat or a reconciliation reads no row of the store.

Durability: every change is written to the store before it is acted on or answered, so a
broker killed at any point restarts into a state it can reconcile with what the nodes
report. Heartbeats are kept in memory only (a lost node is written when it is lost).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from broker.applier import PlacementApplier
from broker.core import Core
from broker.deployment_table import DeploymentTable
from broker.deployments import Deployments
from broker.ids import NodeId
from broker.key_verifier import KeyVerifier
from broker.loop_lag import LoopLag
from broker.model_store import ModelStore
from broker.moves import Moves
from broker.network import EdgeNetwork
from broker.node_link import NodeLinkFactory
from broker.nodes import NodeEntry, NodeRegistry, Reported
from broker.ops.metrics import BrokerMetrics
from broker.placement import ClusterSnapshot
from broker.quotas import ClientLimits
from broker.reconciler import Reconciler
from broker.reports import OffloadReports
from broker.services import Services
from broker.standbys import StandbyPool
from broker.state import (
    NodeState,
    ServiceClientRecord,
    ServiceRecord,
    ServiceReplicaRecord,
    StateStore,
)
from broker.telemetry import LoadHistory, NodeSample
from broker.uploads import Uploads
from broker.values import BrokerSettings
from common.inventory import Inventory

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Broker:
    """The broker's domain (see the module docstring): the owners, built and wired."""

    def __init__(
        self,
        store: StateStore,
        models: ModelStore,
        network: EdgeNetwork,
        join_token: str,
        settings: BrokerSettings,
        metrics: BrokerMetrics,
        node_links: NodeLinkFactory,
    ) -> None:
        """`node_links`: how the broker gets its link to a node (`NodeClient`, over mutual
        TLS when the broker has a certificate)."""
        self._core = core = Core(store, metrics)
        self.models = models
        self.network = network
        self.settings = settings
        self.metrics = metrics
        self._join_token = join_token
        self._keys = KeyVerifier(store.client_for_api_key)
        self.limits = ClientLimits(settings.quotas, settings.max_staged_upload_bytes)
        """Per-client quotas and the upload and watch-stream slots they allow."""
        table = DeploymentTable()
        self.registry = NodeRegistry(
            core,
            network,
            node_links,
            metrics,
            lost_after_s=settings.lost_after_s,
            node_lease_s=settings.node_lease_s,
            stop_grace_ms=settings.stop_grace_ms,
            on_change=lambda node_id, load_only: self.applier.node_changed(node_id, load_only),
        )
        self.applier = PlacementApplier(self.registry, table, metrics)
        self.uploads = Uploads(core, models, self.limits)
        self.standbys = StandbyPool(core, self.registry, self.applier, table, metrics)
        self.deployments = Deployments(
            core,
            self.registry,
            self.applier,
            table,
            self.standbys,
            self.uploads,
            models=models,
            network=network,
            limits=self.limits,
            keys=self._keys,
            metrics=metrics,
            settings=settings,
        )
        self.moves = Moves(
            core, self.registry, self.applier, self.deployments, self.standbys, metrics
        )
        self.reconciler = Reconciler(
            core, self.registry, self.applier, self.deployments, self.standbys, settings
        )
        self.reports = OffloadReports(core)
        self.services = Services(
            core,
            self.registry,
            self.deployments,
            self.uploads,
            network,
            idle_s=settings.service_idle_s,
            queue_target_ms=settings.service_queue_target_ms,
        )

    @property
    def nodes(self) -> Mapping[str, NodeEntry]:
        """The nodes the broker knows, read-only: only the registry changes them."""
        return self.registry.nodes

    @property
    def load_history(self) -> LoadHistory:
        """What nodes reported in their heartbeats, the last few minutes of it."""
        return self.registry.load_history

    @property
    def loop_lag(self) -> LoopLag:
        """How late this event loop has run lately (`NodeRegistry.loop_lag`)."""
        return self.registry.loop_lag

    async def service_rows(
        self,
    ) -> tuple[list[ServiceRecord], list[ServiceReplicaRecord], list[ServiceClientRecord]]:
        """Every service, its replicas and its attached clients as the store has them now,
        for the ops view: read only (`Services` alone writes them)."""
        store = self._core.store
        return (
            await self._core.db(store.list_services),
            await self._core.db(store.list_service_replicas),
            await self._core.db(store.list_service_clients),
        )

    def background(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run `coro` as the broker's own task (cancelled by `close`); a failure is logged."""
        return self._core.background(coro, name)

    # --- start-up and shutdown -----------------------------------------------------------

    async def load(self) -> None:
        """Reload the nodes (they get a full heartbeat timeout to check in), the deployments
        (`Deployments.load`) and the previous broker's standbys (stopped) from the store."""
        await self.registry.load()
        await self.deployments.load()
        await self.standbys.load()
        await self.services.load()
        logger.info(
            "state loaded: %d node(s), %d deployment(s)",
            len(self.nodes),
            len(self.deployments.table.select()),
        )

    async def close(self) -> None:
        self.services.close()
        await self._core.cancel_tasks()
        await self.registry.close()
        self.deployments.close()
        self._keys.close()
        self._core.close()

    # --- authentication ------------------------------------------------------------------

    def check_join_token(self, supplied: str | None) -> bool:
        return supplied is not None and hmac.compare_digest(
            supplied.encode(), f"Bearer {self._join_token}".encode()
        )

    async def client_for(self, authorization: str | None, peer: str) -> str | None:
        """The client id an `authorization: Bearer <api key>` value belongs to, or None.
        The check runs off the state thread (`KeyVerifier`); ResourceExhausted when `peer`
        failed too many checks lately or too many keys wait for one."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return await self._keys.client_for(authorization.removeprefix("Bearer "), peer)

    def use_keys(self, keys: Sequence[str]) -> tuple[str, ...]:
        """Make `keys` (a parsed `--api-keys-file`) exactly the valid API keys, at once and
        without hashing (`KeyVerifier.use_keys`): a removed or replaced key is refused from
        the next call on, and the WatchDeployment streams opened with it end UNAUTHENTICATED.
        The ids of the clients whose key stopped working; their tokens at services'
        replicas stop working too, in the background, within a second or so
        (`Services.revoke`)."""
        stopped = self._keys.use_keys(keys)
        if stopped:
            self._core.background(self.services.revoke(stopped), "revoke-service-clients")
        return stopped

    # --- nodes ---------------------------------------------------------------------------

    async def register_node(
        self,
        node_id: str,
        address: str,
        site: str,
        inventory: Inventory,
        runtimes: Sequence[str],
        replicas: Reported,
        *,
        secret: str,
        certified: bool = False,
    ) -> None:
        """Record (or refresh) a node (`NodeRegistry.register`), then reconcile the replicas
        it reports, given as (replica id, state), in the background."""
        await self.registry.register(
            node_id, address, site, inventory, runtimes, secret=secret, certified=certified
        )
        logger.info(
            "node=%s registered site=%s gpus=%d replicas=%d",
            node_id,
            site,
            len(inventory.gpus),
            len(replicas),
        )
        self.reconciler.schedule(node_id, replicas)

    def heartbeat(self, node_id: str, sample: NodeSample, replicas: Reported) -> None:
        """Record that the node is alive and its load (`NodeRegistry.heartbeat`), at once;
        reconciling the replicas it reports runs after, in the background. NotFound when
        the node is unknown (it registers again)."""
        self.registry.heartbeat(node_id, sample)
        self.reconciler.schedule(node_id, replicas)

    async def mark_lost_nodes(self) -> list[NodeId]:
        """Mark the nodes silent too long as lost (`NodeRegistry.find_lost`), retire the
        standbys on them and fail the clients of service replicas there over; their ids."""
        lost = await self.registry.find_lost()
        self.standbys.on_nodes_lost(lost)
        self.services.on_nodes_lost(lost)
        return lost

    async def set_node_state(self, node_id: str, state: NodeState) -> None:
        """An operator's change of a node's state (draining): a decision of its own."""
        async with self.applier.use("node state"):
            await self.registry.set_state(node_id, state)

    async def snapshot(self) -> ClusterSnapshot:
        """The cluster as placement sees it now, for a policy's dry run outside the placement
        lock (the decision it leads to checks again, under the lock)."""
        return self.applier.view()
