"""The node registry: the nodes the broker knows, the secrets they are bound to, whether each
is live, and the resizes they report. It alone writes them (memory and the store's node
rows); the rest of the broker reads `NodeRegistry.nodes` and asks it by intent (register,
heartbeat, retire, find the lost, set a state).

Liveness is a lease: every heartbeat renews it, and so does a lease renewal (`renew`), which
a node sends between its usage samples. A node is lost when its lease runs out
(`lost_after_s` without a renewal or heartbeat: a daemon paused or hung keeps its connection
but stops renewing), or when its heartbeat stream broke (`stream_closed`) and it did not open
another, or renew, within `stream_grace_s` (a daemon killed, its host gone: noticed at the
next check, not a whole lease later).

With nodes on a port of their own (`--node-listen`), a node that can sends liveness beacons
(`broker.beacons`, UDP datagrams under a key its heartbeat stream was given, one each
heartbeat interval from its event loop): while they come, they are its liveness (the lease
`lost_after_s`, renewed by each), and its stream carries only a rare lease renewal and its
usage samples, the long lease `node_lease_s` (`--node-lease`) apart. A daemon paused or hung
stops beaconing and is lost after `lost_after_s`, one killed breaks its stream (the grace).
A node whose beacons never arrive (UDP filtered) keeps the long lease, which the node port's
rare HTTP/2 keepalive pings (`broker.server.NODE_KEEPALIVE`) back, and is logged. A node
that cannot beacon (an older daemon) renews every `lost_after_s / LEASE_RENEWALS` as on the
clients' port. A beacon costs the broker about 12 µs (`bench.ping_cost`; issue 51).

A change placement must see (a node registered, lost, back, drained, its load) is told to
`on_change(node_id, load_only)`: the placement applier (`broker.applier`) marks the node's
entry in its view stale.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from broker.beacons import BeaconReceiver
from broker.core import Core
from broker.errors import (
    AlreadyExists,
    Impossible,
    InvalidRequest,
    NodeUnavailable,
    NotFound,
    Unauthenticated,
    quote,
)
from broker.ids import NodeId
from broker.loop_lag import LoopLag
from broker.network import EdgeNetwork
from broker.node_link import NodeLink, NodeLinkFactory
from broker.ops.metrics import BrokerMetrics
from broker.state import NodeRecord, NodeState, ResizeRecord
from broker.telemetry import LoadHistory, NodeSample, Resize
from common.inventory import Gpu, Inventory, Link, LinkKind
from common.node_identity import NODE_SECRET_HEADER, proves, secret_sha256, well_formed
from common.topology import Topology

logger = logging.getLogger(__name__)

NODE_ID = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")
"""What a node id may be (it names the node in logs, metrics and replica endpoints)."""
_ADDRESS = re.compile(r"[^\s:]{1,253}:(\d{1,5})")
RESIZES_KEPT = 100
"""Resizes the store keeps per deployment (the most recent)."""
RESIZES_LISTED = 500
"""Resizes `NodeRegistry.resizes` returns at most."""
LEASE_RENEWALS = 2.5
"""Lease renewals a lease lasts (`NodeRegistry.renew_s`): one late renewal, or a node's event
loop stalled a second or two, is not a lost node."""
BEACONS_EXPECTED_S = 10.0
"""How long after its stream was given a beacon key a node whose beacons have not come is
logged (UDP to the node port filtered, most likely)."""
STREAM_GRACE_S = 2.0
"""How long a node whose heartbeat stream broke has to open another or renew (at most
`lost_after_s`): a node reopens a broken stream at once, and the lost-node check runs every
second."""
RESIZES_REMEMBERED = 4096
"""(node, event) pairs the broker remembers as recorded, to skip the store for the ones a
node repeats; one it forgot is recorded again harmlessly (the store ignores duplicates)."""


class ReplicaState(enum.StrEnum):
    """A replica as its node reports it."""

    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    EXITED = "exited"
    UNKNOWN = "unknown"
    """A state this broker does not know (a newer node's)."""


LIVE_REPLICA = frozenset({ReplicaState.STARTING, ReplicaState.READY, ReplicaState.STOPPING})
"""Replica states in which the process or container is there."""

Reported = Sequence[tuple[str, ReplicaState]]
"""The replicas a node reports, as (replica id, state)."""


@dataclass(slots=True)
class NodeEntry:
    """A node the broker knows, as of its last registration and heartbeat. Written by the
    registry alone (the reconciler records `replicas`, through `NodeRegistry.reported`)."""

    record: NodeRecord
    inventory: Inventory
    topology: Topology
    client: NodeLink
    last_heartbeat: float
    """time.monotonic() of the last registration or heartbeat."""
    replicas: frozenset[str] = frozenset()
    """The replica ids the node reported last."""
    load: float = 0.0
    stream: object | None = None
    """The node's open heartbeat stream (the token `stream_opened` was given); None when it
    has none."""
    stream_broken_at: float | None = None
    """time.monotonic() when its heartbeat stream broke, while it has opened no other since;
    None otherwise (and for a node on unary heartbeats, whose lease alone counts)."""
    beacon_id: bytes | None = None
    """The beacon key its open stream was given (`broker.beacons`); None without one."""
    beacon_issued_at: float = 0.0
    """time.monotonic() when `beacon_id` was issued; 0 once its missing beacons were logged
    (`BEACONS_EXPECTED_S`)."""
    beaconing: bool = False
    """Whether a beacon under `beacon_id` came: its beacons are its liveness."""


def inventory_to_json(inventory: Inventory) -> str:
    return json.dumps(
        {
            "gpus": [
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "name": g.name,
                    "memory_total_mib": g.memory_total_mib,
                    "numa_node": g.numa_node,
                }
                for g in inventory.gpus
            ],
            "links": [[a, b, str(link)] for (a, b), link in sorted(inventory.links.items())],
            "driver_version": inventory.driver_version,
            "cuda_version": inventory.cuda_version,
        }
    )


def inventory_from_json(text: str) -> Inventory:
    data = json.loads(text)
    links = {}
    for a, b, kind in data["links"]:
        links[(a, b)] = (
            Link(LinkKind.NV, int(kind[2:])) if kind.startswith("NV") else Link(LinkKind(kind))
        )
    return Inventory(
        gpus=tuple(Gpu(**g) for g in data["gpus"]),
        links=links,
        driver_version=data["driver_version"],
        cuda_version=data["cuda_version"],
    )


class NodeRegistry:
    """The nodes, their secrets, their liveness and their resizes (see the module
    docstring)."""

    def __init__(
        self,
        core: Core,
        network: EdgeNetwork,
        links: NodeLinkFactory,
        metrics: BrokerMetrics,
        *,
        lost_after_s: float,
        stop_grace_ms: int,
        on_change: Callable[[str, bool], None],
        stream_grace_s: float = STREAM_GRACE_S,
        node_lease_s: float | None = None,
    ) -> None:
        self._core = core
        self._network = network
        self._links = links
        self._metrics = metrics
        self.lost_after_s = lost_after_s
        """A node silent this long is lost (plus `loop_lag`): the lease."""
        self.node_lease_s = None if node_lease_s is None else max(node_lease_s, lost_after_s)
        """The lease of a node whose heartbeat stream is open on a port that pings it (HTTP/2
        keepalive breaks the stream of a node that stops answering); None where nodes share
        the clients' port, which is not pinged: `lost_after_s` is every node's lease."""
        self.stream_grace_s = min(stream_grace_s, lost_after_s)
        """A node whose heartbeat stream broke is lost after this long without another."""
        self._stop_grace_ms = stop_grace_ms
        self._on_change = on_change
        self._nodes: dict[str, NodeEntry] = {}
        self._secrets: dict[str, str] = {}
        """node id -> the sha256 of the node secret it is bound to (`common.node_identity`),
        as in the store: read on every heartbeat, so never a store round trip."""
        self._resizes_seen: dict[tuple[str, str], None] = {}
        """(node id, event id) of resizes recorded already, oldest first (bounded): a node
        repeats its recent ones in every heartbeat, and they need no store round trip."""
        self.load_history = LoadHistory()
        """What nodes reported in their heartbeats, the last few minutes of it."""
        self.loop_lag = LoopLag(window_s=lost_after_s)
        """How late this event loop has run lately (its monitor, `LoopLag.run`, is started
        with the lost-node check): a node gets that much more silence before it is lost."""
        self.beacons: BeaconReceiver | None = None
        """The beacons' socket (`use_beacons`); None: nodes renew on their streams."""
        self.beacon_interval_s = 1.0
        """How often nodes send a beacon (`use_beacons`)."""

    @property
    def nodes(self) -> Mapping[str, NodeEntry]:
        """The nodes the broker knows, read-only: only the registry changes them."""
        return MappingProxyType(self._nodes)

    async def load(self) -> None:
        """Reload the nodes the store knows (they get a full heartbeat timeout to check in)."""
        self._secrets = await self._core.db(self._core.store.node_secrets)
        for record in await self._core.db(self._core.store.list_nodes):
            if record.state is NodeState.LOST:
                continue
            try:
                inventory = inventory_from_json(record.inventory_json)
                self._network.add_node(record.node_id, record.site)
            except (ValueError, KeyError) as err:
                logger.error("node=%s in the state cannot be restored: %s", record.node_id, err)
                continue
            self._nodes[record.node_id] = NodeEntry(
                record,
                inventory,
                Topology.from_inventory(inventory),
                # No node secret until the node registers again: without TLS the broker
                # cannot call it before then (it keeps only the secret's hash).
                self._links(record.node_id, record.address, None),
                time.monotonic(),
            )
            self._on_change(record.node_id, False)

    async def close(self) -> None:
        for entry in self._nodes.values():
            await entry.client.close()

    async def register(
        self,
        node_id: str,
        address: str,
        site: str,
        inventory: Inventory,
        runtimes: Sequence[str],
        *,
        secret: str,
        certified: bool = False,
    ) -> NodeEntry:
        """Record (or refresh) a node; its entry. InvalidRequest for an unknown site or bad
        fields.

        `secret` is the node's secret (`common.node_identity`), `certified` whether the
        caller presented a TLS certificate for `node_id`. An unbound id (new, or retired) is
        bound to `secret`; a bound one registers only with its secret, or, `certified`, once
        the node holding it is no longer live (then bound to the new secret). Anything else
        is AlreadyExists naming the holder's address, and changes nothing: the broker never
        repoints a node without proof. Unauthenticated for a missing or malformed secret."""
        if not NODE_ID.fullmatch(node_id):
            raise InvalidRequest(f"node_id {quote(node_id)} must be 1-63 of a-z, 0-9, '.', '-'")
        address_match = _ADDRESS.fullmatch(address)
        if address_match is None or not 1 <= int(address_match.group(1)) <= 65535:
            raise InvalidRequest(f"address {quote(address)} is not host:port (port 1..65535)")
        if site not in self._network.sites:
            raise InvalidRequest(
                f"site {quote(site)} is not in the cluster file; known sites: "
                f"{', '.join(self._network.sites)}"
            )
        try:
            topology = Topology.from_inventory(inventory)
        except ValueError as err:
            raise InvalidRequest(f"inventory: {err}") from err
        if not well_formed(secret):
            raise Unauthenticated(
                f"missing or malformed node secret: send '{NODE_SECRET_HEADER}: <secret>' "
                "(offload node keeps it in its state dir)"
            )
        await self._claim(node_id, secret, certified)
        now = time.time()
        previous = self._nodes.get(node_id)
        record = NodeRecord(
            node_id=node_id,
            address=address,
            site=site,
            state=NodeState.READY,
            inventory_json=inventory_to_json(inventory),
            runtimes=tuple(runtimes),
            registered_at=now,
            last_heartbeat_at=now,
            usage_json="{}",
        )
        await self._core.db(self._core.store.upsert_node, record)
        self._network.add_node(node_id, site)
        if previous is not None and previous.record.address == address:
            client = previous.client
            client.secret = secret
        else:
            if previous is not None:
                await previous.client.close()
            client = self._links(node_id, address, secret)
        entry = NodeEntry(record, inventory, topology, client, time.monotonic())
        if previous is not None:
            # Its open stream, if any, goes on (a stream outlives a record). A stream that
            # broke in its previous life does not count against this one: the registration
            # is news of the node, and a node with no stream is live on its lease, as at its
            # first registration (or it was lost again before its new stream could open).
            entry.stream = previous.stream
            entry.beacon_id, entry.beacon_issued_at = previous.beacon_id, previous.beacon_issued_at
            entry.beaconing = previous.beaconing
        self._nodes[node_id] = entry
        self._on_change(node_id, False)
        return entry

    async def _claim(self, node_id: str, secret: str, certified: bool) -> None:
        """Check that the caller may register `node_id` (see `register`), binding the id to
        `secret` when it is unbound, or taken over with a certificate."""
        bound = self._secrets.get(node_id)
        if proves(secret, bound):
            return
        holder = self._nodes.get(node_id)
        live = holder is not None and self.is_live(holder)
        if bound is not None and (live or not certified):
            # A lost node is not in memory after a broker restart: its address is in the store.
            record = holder.record if holder is not None else None
            record = record or await self._core.db(self._core.store.get_node, node_id)
            where = f"at {record.address}" if record is not None else "(address unknown)"
            if live:
                raise AlreadyExists(
                    f"node id {node_id} is held by the live node {where}, and this daemon "
                    "does not have its node secret: give this daemon another --node-id (a "
                    "cloned host keeps the hostname as its id), or stop the other one"
                )
            raise AlreadyExists(
                f"node id {node_id} belongs to the node last {where}, no longer live, and "
                "this daemon does not have its node secret: if that host is gone for good "
                f"(or lost its state dir), retire the id (offload retire {node_id}) and "
                "start this daemon again"
            )
        fresh = secret_sha256(secret)
        bind = self._core.store.bind_node_secret
        if not await self._core.db(bind, node_id, bound, fresh, time.time()):
            # Bound meanwhile by a registration that was in flight: this daemon's own, retried
            # (a slow broker), proves the id; another daemon's does not.
            now = (await self._core.db(self._core.store.node_secrets)).get(node_id)
            if not proves(secret, now):
                raise AlreadyExists(
                    f"node id {node_id} was claimed by another daemon at the same moment"
                )
            assert now is not None
            fresh = now
        self._secrets[node_id] = fresh
        if bound is None:
            logger.info("node=%s bound to its node secret", node_id)
        else:
            logger.warning(
                "node=%s taken over by a daemon with its certificate and a new node secret "
                "(the previous holder was not live)",
                node_id,
            )

    def lease_s(self, entry: NodeEntry) -> float:
        """How long the node may be silent: `node_lease_s` on the node port once its stream
        was given a beacon key none of whose beacons came yet (or broke since: it has
        `stream_grace_s` from the break, however long ago the last rare renewal came), else
        `lost_after_s` (a beaconing node, and one that renews often)."""
        if (
            self.node_lease_s is not None
            and not entry.beaconing
            and (entry.beacon_id is not None or entry.stream_broken_at is not None)
        ):
            return self.node_lease_s
        return self.lost_after_s

    def is_live(self, entry: NodeEntry) -> bool:
        """Whether the node heartbeats: not lost, and heard within its lease (`lease_s`)."""
        silent = time.monotonic() - entry.last_heartbeat
        return entry.record.state is not NodeState.LOST and silent < self.lease_s(entry)

    def check(self, node_id: str, secret: str | None) -> None:
        """Check that `secret` is the one `node_id` is bound to, before a heartbeat is
        taken; no store round trip. NotFound otherwise (an unbound id: retired; another
        secret: the id was taken over): the node registers again, which tells it why. A
        broker that restarted learns the secret it calls the node's NodeAgent with here."""
        if not proves(secret, self._secrets.get(node_id)):
            raise NotFound(
                f"node {node_id} is not registered with this node secret; register again"
            )
        entry = self._nodes.get(node_id)
        if entry is not None and entry.client.secret is None:
            entry.client.secret = secret

    async def retire(self, node_id: str) -> None:
        """Free `node_id` for good: forget the secret it is bound to, so that the next daemon
        to register it binds it afresh (a host gone for good, or one that lost its state
        dir). Impossible while the node is live (stop its daemon, wait `lost_after_s`);
        NotFound for an id the broker never saw. Idempotent for a known id."""
        entry = self._nodes.get(node_id)
        if entry is not None and self.is_live(entry):
            raise Impossible(
                f"node {node_id} is live at {entry.record.address}: stop its daemon first; "
                f"it can be retired once it has been silent {self.lost_after_s:g}s"
            )
        known = await self._core.db(self._core.store.get_node, node_id)
        if known is None and node_id not in self._secrets:
            raise NotFound(f"node {node_id} is unknown")
        await self._core.db(self._core.store.forget_node_secret, node_id)
        self._secrets.pop(node_id, None)
        logger.warning("node=%s retired: the next daemon to register this id binds it", node_id)

    def use_beacons(self, receiver: BeaconReceiver, interval_s: float) -> None:
        """Take nodes' beacons from `receiver`, one each `interval_s` (only on the node port:
        with `node_lease_s`)."""
        if self.node_lease_s is None:
            raise ValueError("beacons are for nodes on a port of their own (--node-listen)")
        self.beacons, self.beacon_interval_s = receiver, interval_s

    def renew_s(self, beacons: bool) -> float:
        """How often a node renews its lease on its stream (RegisterResponse's
        `lease_renew_ms`): rarely when it beacons to a broker that takes them, else often
        enough for `lost_after_s`."""
        if beacons and self.beacons is not None and self.node_lease_s is not None:
            return self.node_lease_s / LEASE_RENEWALS
        return self.lost_after_s / LEASE_RENEWALS

    def issue_beacon(self, node_id: str, stream: object) -> tuple[bytes, bytes] | None:
        """A beacon key (id, key) for `stream`, the node's open stream (withdrawing its
        previous one); None without beacons or when `stream` is not the node's."""
        entry = self._nodes.get(node_id)
        if self.beacons is None or entry is None or entry.stream is not stream:
            return None
        self._withdraw(entry)
        beacon_id, key = self.beacons.issue(node_id)
        entry.beacon_id, entry.beacon_issued_at = beacon_id, time.monotonic()
        return beacon_id, key

    def _withdraw(self, entry: NodeEntry) -> None:
        if entry.beacon_id is not None and self.beacons is not None:
            self.beacons.withdraw(entry.beacon_id)
        entry.beacon_id, entry.beaconing = None, False

    def beaconed(self, node_id: str, beacon_id: bytes) -> None:
        """A beacon under `beacon_id` came from `node_id` (`BeaconReceiver`): its lease is
        renewed, and from now on its beacons are its liveness."""
        entry = self._nodes.get(node_id)
        if entry is None or entry.beacon_id != beacon_id:
            return
        if not entry.beaconing:
            entry.beaconing = True
            logger.debug("node=%s beacons", node_id)
        self.renew(node_id, beacon=True)

    def renew(self, node_id: str, beacon: bool = False) -> NodeEntry:
        """Renew the node's lease, at once (the liveness path never waits); a lost node is
        back. A beaconing node lost for its beacons' silence and heard again on its stream
        (not by a `beacon`) has lost its UDP path, not its life: its lease is its stream's
        again (`lease_s`) until a beacon comes, instead of being lost again at once. NotFound
        when the node is unknown (it registers again)."""
        entry = self._nodes.get(node_id)
        if entry is None:
            raise NotFound(f"node {node_id} is not registered; register again")
        entry.last_heartbeat = time.monotonic()
        if entry.record.state is NodeState.LOST:
            if entry.beaconing and not beacon:
                entry.beaconing = False
                logger.warning(
                    "node=%s: heard on its stream while its beacons are silent (UDP to port "
                    "%d lost?): its liveness is its lease, --node-lease %ss, until they come",
                    node_id,
                    self.beacons.port if self.beacons is not None else 0,
                    self.node_lease_s,
                )
            entry.record = replace(entry.record, state=NodeState.READY)
            self._on_change(node_id, False)
            set_state = self._core.store.set_node_state
            self._core.background(
                self._core.db(set_state, node_id, NodeState.READY), f"back-{node_id}"
            )
            logger.info("node=%s is back", node_id)
        return entry

    def stream_opened(self, node_id: str, stream: object) -> None:
        """The node heartbeats on `stream` now (any token the caller keeps for it)."""
        entry = self._nodes.get(node_id)
        if entry is not None:
            self._withdraw(entry)
            entry.stream, entry.stream_broken_at = stream, None

    def stream_closed(self, node_id: str, stream: object) -> None:
        """`stream` ended, however (the node's connection reset, the node went, the broker
        refused it): when it is the node's stream, the node has `stream_grace_s` to open
        another or renew its lease. A stream the node has replaced already changes nothing."""
        entry = self._nodes.get(node_id)
        if entry is not None and entry.stream is stream:
            self._withdraw(entry)
            entry.stream, entry.stream_broken_at = None, time.monotonic()

    async def stop_replica(
        self, node_id: str | None, replica: str, grace_ms: int | None = None
    ) -> None:
        """Stop a replica (draining it for `grace_ms`, by default `--stop-grace`); a node that
        is gone, lost or cannot is left to reconciliation (the replica is unclaimed there and
        stopped after the orphan grace)."""
        entry = self._nodes.get(node_id or "")
        if entry is None or entry.record.state is NodeState.LOST:
            return
        try:
            await entry.client.stop_replica(
                replica, self._stop_grace_ms if grace_ms is None else grace_ms
            )
        except NodeUnavailable as err:
            logger.warning("replica=%s: %s (the node reconciles it)", replica, err)

    def heartbeat(self, node_id: str, sample: NodeSample) -> NodeEntry:
        """Record that the node is alive (`renew`) and its load, at once and before anything
        that can wait: the liveness path never queues behind the store, placement or client
        calls. Its new resizes are recorded in the background. NotFound when the node is
        unknown (it registers again)."""
        entry = self.renew(node_id)
        if entry.load != sample.load:
            entry.load = sample.load
            self._on_change(node_id, True)
        self.load_history.record(node_id, sample, time.time())
        fresh = [r for r in sample.resizes if (node_id, r.event_id) not in self._resizes_seen]
        if fresh:
            self._core.background(self._record_resizes(node_id, fresh), f"resizes-{node_id}")
        return entry

    def reported(self, node_id: str, replicas: Reported) -> None:
        """Remember the replica ids the node reported last (reconciliation's record)."""
        entry = self._nodes.get(node_id)
        if entry is not None:
            entry.replicas = frozenset(rid for rid, _ in replicas)

    async def _record_resizes(self, node_id: str, resizes: Sequence[Resize]) -> None:
        """Keep the resizes a node reported that the store has not seen, once each."""
        records = [
            ResizeRecord(
                node_id=node_id,
                event_id=r.event_id,
                deployment_id=r.deployment_id,
                replica_id=r.replica_id,
                cpus_before=r.cpus_before,
                cpus_after=r.cpus_after,
                policy=r.policy,
                reason=r.reason,
                at=r.at,
            )
            for r in resizes
        ]
        added = await self._core.db(self._core.store.put_resizes, records, keep=RESIZES_KEPT)
        for r in resizes:
            self._resizes_seen[(node_id, r.event_id)] = None
        while len(self._resizes_seen) > RESIZES_REMEMBERED:
            self._resizes_seen.pop(next(iter(self._resizes_seen)))
        for record in added:
            self._metrics.count_resize(record.policy, record.cpus_after > record.cpus_before)
            logger.info(
                "deployment=%s replica=%s on node=%s resized %.2f -> %.2f cores (%s): %s",
                record.deployment_id,
                record.replica_id,
                node_id,
                record.cpus_before,
                record.cpus_after,
                record.policy,
                record.reason,
            )

    async def resizes(self, deployment_id: str | None = None) -> list[ResizeRecord]:
        """The recorded resizes of one deployment or all, oldest first (at most
        `RESIZES_KEPT` per deployment)."""
        list_resizes = self._core.store.list_resizes
        return await self._core.db(list_resizes, deployment_id, limit=RESIZES_LISTED)

    async def set_state(self, node_id: str, state: NodeState) -> None:
        """An operator's change of a node's state (draining); call under the placement
        lock (a decision of its own)."""
        entry = self._nodes[node_id]
        entry.record = replace(entry.record, state=state)
        self._on_change(node_id, False)
        await self._core.db(self._core.store.set_node_state, node_id, state)

    async def find_lost(self) -> list[NodeId]:
        """Mark as lost the nodes whose lease ran out (silent past `lease_s`) or whose
        heartbeat stream broke `stream_grace_s` ago with no other since, either plus how late
        this event loop ran lately (`loop_lag`); returns their ids. The decision is taken on
        the in-memory times alone, all nodes at once; only then is it written to the
        store."""
        now = time.monotonic()
        # Heartbeats wait unread while this loop is behind: silence that long is not the
        # node's (`broker.loop_lag`).
        lag = self.loop_lag.worst(now)
        lost: list[NodeId] = []
        spared = 0
        for node_id, entry in self._nodes.items():
            if entry.record.state is not NodeState.READY:
                continue
            silent = now - entry.last_heartbeat
            broken = None if entry.stream_broken_at is None else now - entry.stream_broken_at
            lease = self.lease_s(entry)
            self._expect_beacons(node_id, entry, now)
            if silent > lease:
                heard = "beacon or heartbeat" if entry.beaconing else "heartbeat"
                why, past = f"no {heard} for {silent:.1f}s", silent - lease
            elif broken is not None and broken > self.stream_grace_s:
                why = (
                    f"no heartbeat for {silent:.1f}s, its heartbeat stream broke {broken:.1f}s ago"
                )
                past = broken - self.stream_grace_s
            else:
                continue
            if past <= lag:
                spared += 1
                continue
            entry.record = replace(entry.record, state=NodeState.LOST)
            self._on_change(node_id, False)
            logger.error("node=%s lost: %s", node_id, why)
            lost.append(NodeId(node_id))
        if spared:
            logger.warning(
                "%d node(s) silent past their lease (--lost-after %gs, --node-lease %ss) or "
                "with a broken stream, but this broker's event loop ran up to %.1fs late: their "
                "heartbeats may be waiting to be read; not lost yet",
                spared,
                self.lost_after_s,
                "unused" if self.node_lease_s is None else f"{self.node_lease_s:g}",
                lag,
            )
        for node_id in lost:
            await self._core.db(self._core.store.set_node_state, node_id, NodeState.LOST)
        return lost

    def _expect_beacons(self, node_id: str, entry: NodeEntry, now: float) -> None:
        """Log, once per key, a node whose beacons have not come `BEACONS_EXPECTED_S` after its
        stream was given a key: it keeps the long lease (`lease_s`)."""
        issued = entry.beacon_issued_at
        if (
            self.beacons is None
            or entry.beaconing
            or not issued
            or now - issued < BEACONS_EXPECTED_S
        ):
            return
        entry.beacon_issued_at = 0.0
        logger.warning(
            "node=%s: no beacon came %gs after its stream was given a key (UDP to port %d "
            "filtered?): its liveness is its lease, --node-lease %gs",
            node_id,
            BEACONS_EXPECTED_S,
            self.beacons.port,
            self.node_lease_s,
        )
