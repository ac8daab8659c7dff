"""Services (issue 52): one model published once for many clients. A service's replicas are
deployments of its owner (`DeploySpec.service` names the service: they stay at their site,
whatever their owner's moves), so placement, node failure, reconciliation and quotas treat
them as any other; this owner keeps which deployments are a service's replicas, which
client is on which replica with what token, and tells each replica's node the clients it
takes (`NodeLink.set_replica_clients`: the replica's clients file, `runtime.clients`).

It alone writes the `services`, `service_replicas` and `service_clients` rows. Every change
of one service (create, delete, a client attached) runs under that service's lock, and a
replica's client set is read and sent under that replica's, so a node never keeps an older
set than the store's.

A client is put on a running replica within the service's latency SLO of its site (the
nearest, then the least used), else on a replica started at its site (while the service
runs fewer than `max_replicas`), else on the nearest running one. Its token is its own: a
new one each time it attaches (the previous one stops working), kept in the store as its
SHA-256 only. When a replica is placed again (its node lost) or moved, its new copy is
given the same clients as soon as it runs.

Replicas follow demand: one is started where a client needs one (above), and, every
`SCALE_INTERVAL_S`, a running replica over a load target in every sample in force over the
last `SCALE_SUSTAIN_S` (those of that span and the one before it, which stood until the
next: a node sends its sample when it changes, else every `--sample-interval`, 20 s) gets
another at its site, while the service runs fewer than
`max_replicas` and none is starting, with the most recently attached half of its clients
switched to it (as a move's switch); then the service waits `SCALE_COOLDOWN_S`. The targets
(`over_targets`): the queue target (`--service-queue-target-ms`, against the queue-delay
p99 its node reports) and, for a service with a latency SLO, the SLO, against the
replica's own request-latency p99 (from a call's arrival at the replica to its answer: a
client sees that plus its network latency, so past the SLO there is past it for every
client of the replica); `--service-queue-target-ms 0` turns both off. A replica
with no client for `--service-idle-grace` is stopped (beyond `min_replicas_per_site`). Each
start and stop is recorded with its reason (`service_events`: `offload service show`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import secrets
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass

from broker.core import Core
from broker.deployments import Deployments, new_deployment_id
from broker.errors import (
    AlreadyExists,
    BrokerError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    quote,
)
from broker.ids import replica_id
from broker.network import EdgeNetwork
from broker.nodes import NodeRegistry
from broker.state import (
    ConstraintError,
    DeploymentRecord,
    DeploymentState,
    ScaleAction,
    ServiceClientRecord,
    ServiceEventRecord,
    ServiceRecord,
    ServiceReplicaRecord,
    StateError,
)
from broker.telemetry import DeploymentPoint, RequestFigures
from broker.uploads import Uploads
from broker.values import SERVICE_NAME, PlacementUpdate, ServiceSpec
from runtime.batching import PriorityClass as ClientClass
from runtime.clients import ClientEntry, check_client_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServiceReplica:
    """A replica of a service as it is now."""

    deployment_id: str
    site: str
    deployment: DeploymentRecord | None
    """None when its deployment is gone (deleted by its owner)."""
    clients: int


@dataclass(frozen=True, slots=True)
class ServiceView:
    """A service, its replicas and how many clients are on it."""

    record: ServiceRecord
    spec: ServiceSpec
    replicas: tuple[ServiceReplica, ...]
    clients: int
    events: tuple[ServiceEventRecord, ...] = ()
    """Its most recent scale decisions, oldest first (`Services.get` only)."""


SCALE_INTERVAL_S = 2.0
"""How often replicas' load is judged and idle replicas looked for (at most; a quarter of
the idle grace when that is shorter)."""
SCALE_SUSTAIN_S = 5.0
"""How long a replica must stay over a load target, every sample of it, before another is
started beside it: one slow batch is not demand."""
SCALE_COOLDOWN_S = 30.0
"""After a scale-up, how long its service waits before judging its replicas' load again:
the clients switched to the new replica, and the figures, settle first."""
EVENTS_SHOWN = 20
"""Scale decisions `Services.get` returns (the most recent)."""
SWITCH_DRAIN_S = 5.0
"""How long the replica a client was switched away from keeps taking its token: the calls
it sent before it heard of the switch finish there."""


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """A figure of a replica's requests that it should keep under a limit (`over_targets`)."""

    figure: str
    """The figure's name in a scale decision's reason ("queue delay", "latency")."""
    limit_ms: float
    name: str
    """The target's name in the reason ("target", "latency SLO")."""
    p99_ms: Callable[[RequestFigures], float | None]
    """Reads the figure's p99 (ms) from a sample; None when the sample has none."""


def queue_target(limit_ms: float) -> LoadTarget:
    """The requests' wait for their batch (`--service-queue-target-ms`)."""
    return LoadTarget("queue delay", limit_ms, "target", lambda f: f.queue_delay_p99_ms)


def latency_target(slo_ms: float) -> LoadTarget:
    """The replica's own request latency, arrival to answer (a service's latency SLO)."""
    return LoadTarget("latency", slo_ms, "latency SLO", lambda f: f.latency_p99_ms)


def over_targets(
    points: Sequence[DeploymentPoint], targets: Sequence[LoadTarget], now: float
) -> str | None:
    """What a replica's samples (`points`, oldest first; `now` in Unix seconds) show it
    over, for a scale decision's reason: each target that every sample in force over the
    last `SCALE_SUSTAIN_S` was past, with the figure's range and by how much, then the
    samples and their mean request rate. In force: the samples of that span, and the last
    one before it, which stood until the next (a node sends a sample when its load changes,
    otherwise only every `--sample-interval`, so a load that holds steady sends none for
    seconds at a time). None when no sample stood at the span's start (the load is not
    known for all of it). A sample without the figure (no request finished, no batch ran,
    the node could not read the replica's metrics) is not past its target."""
    start = now - SCALE_SUSTAIN_S
    standing = [p for p in points if p.at <= start][-1:]
    if not standing:
        return None
    window = standing + [p for p in points if p.at > start]
    sampled = [p.replica.requests for p in window if p.replica.requests is not None]
    if len(sampled) < len(window):
        return None
    passed: list[str] = []
    for target in targets:
        values = [target.p99_ms(f) for f in sampled]
        past = [v for v in values if v is not None and v > target.limit_ms]
        if len(past) < len(values):
            continue
        passed.append(
            f"its requests' {target.figure} p99 {min(past):g}-{max(past):g} ms, past the "
            f"{target.limit_ms:g} ms {target.name} by at least "
            f"{min(past) - target.limit_ms:g} ms"
        )
    if not passed:
        return None
    samples = "the one sample" if len(window) == 1 else f"all {len(window)} samples"
    return (
        f"{'; and '.join(passed)}; in {samples} in force over the last "
        f"{now - window[0].at:.1f} s, at "
        f"{statistics.fmean(f.rate_per_s for f in sampled):.0f} req/s"
    )


@dataclass(frozen=True, slots=True)
class Assignment:
    """A client put on a replica of a service (`Services.use`)."""

    service: str
    client_id: str
    replica: DeploymentRecord
    token: str
    """The client's own bearer token at the replica; the broker keeps only its SHA-256."""
    priority: ClientClass
    reason: str
    """Why this replica (or why one was started)."""
    epoch: int
    """Orders the client's assignments (`assignment_epoch`)."""


def token_sha256(token: str) -> str:
    """What a replica's clients file keeps of a client's token (`runtime.clients`)."""
    return hashlib.sha256(token.encode()).hexdigest()


def assignment_epoch(row: ServiceClientRecord, replica: DeploymentRecord | None) -> int:
    """The order of a client's assignments, as its updates carry it: the time it was put
    on its replica (µs), plus the replica's own epoch, so that a replica placed again, and
    a switch to another replica, each come after what the client had."""
    return int(row.attached_at * 1_000_000) + (replica.epoch if replica is not None else 0)


class Services:
    def __init__(
        self,
        core: Core,
        registry: NodeRegistry,
        deployments: Deployments,
        uploads: Uploads,
        network: EdgeNetwork,
        idle_s: float = 60.0,
        queue_target_ms: float = 50.0,
    ) -> None:
        self._core = core
        self._idle_s = idle_s
        """A replica with no client this long is stopped (beyond the per-site minimum)."""
        self._queue_target_ms = queue_target_ms
        """A replica whose queue delay p99 stays past this gets another beside it; 0: none
        is started on load."""
        self._cooldown_until: dict[str, float] = {}
        """Service name -> time.monotonic() before which its load is not judged again."""
        self._idle_since: dict[str, float] = {}
        """Replica deployment id -> time.monotonic() since when no client has been on it."""
        self._registry = registry
        self._deployments = deployments
        self._uploads = uploads
        self._network = network
        self._locks: dict[str, asyncio.Lock] = {}
        """Service name -> the lock its changes run under."""
        self._pushing: dict[str, asyncio.Lock] = {}
        """Replica deployment id -> the lock its client set is read and sent under."""
        self._following: dict[str, asyncio.Task[None]] = {}
        """Replica deployment id -> the task that gives each new copy of it its clients."""
        self._watchers: dict[tuple[str, str], set[asyncio.Queue[PlacementUpdate | None]]] = {}
        """(service, client id) -> the queues of that client's WatchService streams."""

    async def load(self) -> None:
        """Follow the replicas the store knows; forget those whose deployment is gone (a
        broker stopped between recording a replica and deploying it)."""
        for row in await self._core.db(self._core.store.list_service_replicas):
            record = await self._deployments.deployment(row.deployment_id)
            if record is None:
                await self._core.db(self._core.store.remove_service_replica, row.deployment_id)
                continue
            self._follow(row.deployment_id)
        self._core.background(self._sweep_forever(), "services-sweep")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(SCALE_INTERVAL_S, self._idle_s / 4))
            try:
                await self.scale()
                await self.sweep()
            except (BrokerError, StateError) as err:  # the next round tries again
                logger.warning("services: judging the replicas' load failed: %s", err)

    async def scale(self) -> list[str]:
        """Start a replica beside each one over a load target (see the module docstring),
        one per service at a time; the deployment ids started."""
        if not self._queue_target_ms:
            return []
        started: list[str] = []
        for record in await self._core.db(self._core.store.list_services):
            if time.monotonic() < self._cooldown_until.get(record.name, 0.0):
                continue
            spec = ServiceSpec.from_json(record.spec_json)
            try:
                async with self._lock(record.name):
                    new = await self._scale_service(record, spec)
            except BrokerError as err:  # judged again after the cooldown; others go on
                logger.warning(
                    "service=%s: no replica started beside a busy one: %s", record.name, err
                )
                continue
            if new is not None:
                started.append(new)
        return started

    async def _scale_service(self, record: ServiceRecord, spec: ServiceSpec) -> str | None:
        """One scale-up for the service if a replica of it is over a load target; the
        deployment id started. Under the service's lock."""
        store = self._core.store
        if await self._core.db(store.get_service, record.name) is None:
            return None  # deleted meanwhile
        rows = await self._core.db(store.list_service_replicas, record.name)
        clients = await self._core.db(store.list_service_clients, record.name)
        replicas = [(row, await self._deployments.deployment(row.deployment_id)) for row in rows]
        if len(rows) >= spec.max_replicas or any(
            d is not None and d.state in (DeploymentState.PENDING, DeploymentState.STARTING)
            for _, d in replicas
        ):
            return None
        for row, busy in replicas:
            on = [c for c in clients if c.deployment_id == row.deployment_id]
            if busy is None or busy.state is not DeploymentState.RUNNING or len(on) < 2:
                continue  # a single client cannot be split between replicas
            why = self._over_target(busy, len(on), spec)
            if why is None:
                continue
            self._cooldown_until[record.name] = time.monotonic() + SCALE_COOLDOWN_S
            new = await self._start_replica(record, spec, row.site, why)
            if new.state is DeploymentState.RUNNING:
                moving = sorted(on, key=lambda c: (c.attached_at, c.client_id))[len(on) // 2 :]
                now = time.time()
                moves = [
                    (c, dataclasses.replace(c, deployment_id=new.deployment_id, attached_at=now))
                    for c in moving
                ]
                await self._switch(
                    moves, new, spec, "a replica started beside yours, which was over its load"
                )
                logger.info(
                    "service=%s switched %d of %d client(s) from deployment=%s to %s",
                    record.name,
                    len(moves),
                    len(on),
                    busy.deployment_id,
                    new.deployment_id,
                )
            return new.deployment_id
        return None

    def _over_target(
        self, replica: DeploymentRecord, clients: int, spec: ServiceSpec
    ) -> str | None:
        """Why `replica` needs another beside it (`over_targets` on its samples from its
        node now: the queue target, and the service's latency SLO when it has one), or
        None."""
        targets = [queue_target(self._queue_target_ms)]
        if spec.latency_slo_ms:
            targets.append(latency_target(spec.latency_slo_ms))
        points = [
            p
            for p in self._registry.load_history.deployment_points(replica.deployment_id)
            if p.node_id == replica.node_id
        ]
        over = over_targets(points, targets, time.time())
        if over is None:
            return None
        return (
            f"replica {replica.deployment_id} on node {replica.node_id} over its load: "
            f"{over} from {clients} clients; half of them move to the new one"
        )

    async def sweep(self) -> list[str]:
        """Stop the replicas that have had no client for `idle_s`, beyond their service's
        `min_replicas_per_site` at their site (the oldest kept); the ids stopped."""
        store = self._core.store
        now = time.monotonic()
        stopped: list[str] = []
        for record in await self._core.db(store.list_services):
            spec = ServiceSpec.from_json(record.spec_json)
            async with self._lock(record.name):
                rows = await self._core.db(store.list_service_replicas, record.name)
                on = Counter(
                    c.deployment_id
                    for c in await self._core.db(store.list_service_clients, record.name)
                )
                kept_at: Counter[str] = Counter()
                for row in rows:  # oldest first: the oldest count toward the minimum
                    since = (
                        self._idle_since.setdefault(row.deployment_id, now)
                        if not on[row.deployment_id]
                        else self._idle_since.pop(row.deployment_id, None)
                    )
                    if since is None or now - since < self._idle_s:
                        kept_at[row.site] += 1
                        continue
                    if kept_at[row.site] < spec.min_replicas_per_site:
                        kept_at[row.site] += 1
                        continue
                    with contextlib.suppress(NotFound):
                        await self._deployments.delete(record.owner, row.deployment_id)
                    await self._core.db(store.remove_service_replica, row.deployment_id)
                    self._idle_since.pop(row.deployment_id, None)
                    stopped.append(row.deployment_id)
                    why = f"no client on it for {now - since:.0f} s (--service-idle-grace)"
                    await self._record(
                        record.name, ScaleAction.STOP, row.deployment_id, row.site, why
                    )
                    logger.info(
                        "service=%s replica deployment=%s at %s stopped: %s",
                        record.name,
                        row.deployment_id,
                        row.site,
                        why,
                    )
        return stopped

    async def counts(self) -> dict[str, tuple[Counter[str], int]]:
        """Service -> (its replicas by site, the clients on it), for the ops figures."""
        store = self._core.store
        counts: dict[str, tuple[Counter[str], int]] = {
            r.name: (Counter(), 0) for r in await self._core.db(store.list_services)
        }
        for row in await self._core.db(store.list_service_replicas):
            if row.service in counts:
                counts[row.service][0][row.site] += 1
        on = Counter(c.service for c in await self._core.db(store.list_service_clients))
        return {name: (sites, on[name]) for name, (sites, _) in counts.items()}

    def close(self) -> None:
        for task in self._following.values():
            task.cancel()

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def create(self, owner: str, name: str, spec: ServiceSpec) -> ServiceView:
        """Publish `spec` as service `name`, owned by `owner`, and start its first replicas
        (`min_replicas_per_site` at every site). InvalidRequest for a bad name or spec;
        NotFound for a model the owner has not uploaded; AlreadyExists for a taken name."""
        if not SERVICE_NAME.fullmatch(name):
            raise InvalidRequest(
                f"service name {quote(name)} must be 1-63 characters of lowercase letters, "
                "digits and '-', starting with a letter or digit"
            )
        spec.validate(self._network.sites)
        for client_id in spec.clients:
            try:
                check_client_id(client_id)
            except ValueError as err:
                raise InvalidRequest(f"clients: {err}") from None
        if not await self._uploads.owns(owner, spec.model_sha256):
            raise NotFound(f"model {spec.model_sha256} is not uploaded; call UploadModel first")
        record = ServiceRecord(
            name=name,
            owner=owner,
            model_sha256=spec.model_sha256,
            spec_json=spec.to_json(),
            created_at=time.time(),
        )
        async with self._lock(name):
            try:
                await self._core.db(self._core.store.create_service, record)
            except ConstraintError as err:
                if await self._core.db(self._core.store.get_service, name) is not None:
                    raise AlreadyExists(f"service {name} exists already") from None
                raise InvalidRequest(str(err)) from None
            logger.info("service=%s created by client=%s (%s)", name, owner, spec.model_name)
            for site in self._network.sites:
                for n in range(spec.min_replicas_per_site):
                    await self._start_replica(
                        record,
                        spec,
                        site,
                        f"min_replicas_per_site {spec.min_replicas_per_site} ({n + 1} of them "
                        f"at {site})",
                    )
        return await self.get(owner, name)

    async def _visible(self, client_id: str, name: str) -> tuple[ServiceRecord, ServiceSpec]:
        """The service if `client_id` owns it or may use it; NotFound otherwise (a service
        the caller may not see answers as one there never was)."""
        record = await self._core.db(self._core.store.get_service, name)
        if record is None:
            raise NotFound(f"service {quote(name)} not found")
        spec = ServiceSpec.from_json(record.spec_json)
        if client_id != record.owner and not spec.allows(client_id):
            raise NotFound(f"service {quote(name)} not found")
        return record, spec

    async def get(self, client_id: str, name: str) -> ServiceView:
        """The service with its most recent scale decisions."""
        record, _ = await self._visible(client_id, name)
        view = await self._view(record)
        return dataclasses.replace(view, events=tuple(await self.events(name, EVENTS_SHOWN)))

    async def events(self, name: str, limit: int) -> list[ServiceEventRecord]:
        """The service's `limit` most recent scale decisions, oldest first (read only: the
        ops view's too)."""
        return await self._core.db(self._core.store.list_service_events, name, limit)

    async def list(self, client_id: str) -> list[ServiceView]:
        """The services `client_id` owns or may use, by name."""
        views = []
        for record in await self._core.db(self._core.store.list_services):
            spec = ServiceSpec.from_json(record.spec_json)
            if client_id == record.owner or spec.allows(client_id):
                views.append(await self._view(record))
        return views

    async def _view(self, record: ServiceRecord) -> ServiceView:
        store = self._core.store
        rows = await self._core.db(store.list_service_replicas, record.name)
        clients = await self._core.db(store.list_service_clients, record.name)
        on = Counter(c.deployment_id for c in clients)
        replicas = [
            ServiceReplica(
                deployment_id=row.deployment_id,
                site=row.site,
                deployment=await self._deployments.deployment(row.deployment_id),
                clients=on[row.deployment_id],
            )
            for row in rows
        ]
        spec = ServiceSpec.from_json(record.spec_json)
        return ServiceView(record, spec, tuple(replicas), len(clients))

    async def delete(self, client_id: str, name: str) -> None:
        """Stop every replica of the service and forget it and its clients' assignments.
        NotFound for a service the caller cannot see (or one deleted already);
        PermissionDenied for one it may use but does not own."""
        async with self._lock(name):
            record, _ = await self._visible(client_id, name)
            if client_id != record.owner:
                raise PermissionDenied(
                    f"service {name} belongs to client {record.owner}: only it deletes it"
                )
            rows = await self._core.db(self._core.store.list_service_replicas, name)
            for row in rows:
                task = self._following.pop(row.deployment_id, None)
                if task is not None:
                    task.cancel()
                with contextlib.suppress(NotFound):
                    await self._deployments.delete(record.owner, row.deployment_id)
            clients = await self._core.db(self._core.store.list_service_clients, name)
            await self._core.db(self._core.store.delete_service, name)
        for client in clients:
            self._tell(client, None)
        self._locks.pop(name, None)
        logger.info("service=%s deleted by client=%s (%d replica(s))", name, client_id, len(rows))

    async def use(self, client_id: str, name: str, site: str, priority: ClientClass) -> Assignment:
        """Put `client_id` at `site` on the best replica of the service (see the module
        docstring) with a new token of its own. NotFound for a service it cannot see;
        PermissionDenied for one that does not allow it (the owner always may);
        InvalidRequest for an unknown site; ResourceExhausted when no replica runs and none
        can be started (the service at `max_replicas`, or no node with room: a replica
        placed later serves the next attach)."""
        record = await self._core.db(self._core.store.get_service, name)
        if record is None:
            raise NotFound(f"service {quote(name)} not found")
        spec = ServiceSpec.from_json(record.spec_json)
        if client_id != record.owner and not spec.allows(client_id):
            raise PermissionDenied(f"service {name} does not allow client {client_id}")
        if site not in self._network.sites:
            known = ", ".join(self._network.sites)
            raise InvalidRequest(f"site {quote(site)} is unknown; known sites: {known}")
        async with self._lock(name):
            replica, reason = await self._choose(record, spec, site)
            token = secrets.token_urlsafe(32)
            store = self._core.store
            before = await self._assignment(name, client_id)
            row = ServiceClientRecord(
                service=name,
                client_id=client_id,
                token_sha256=token_sha256(token),
                priority_class=priority,
                deployment_id=replica.deployment_id,
                site=site,
                attached_at=time.time(),
            )
            await self._core.db(store.put_service_client, row)
            await self._push(replica.deployment_id, spec)
            if before is not None and before.deployment_id != replica.deployment_id:
                await self._push(before.deployment_id, spec)  # the token it leaves behind
        logger.info(
            "service=%s client=%s at %s on deployment=%s (node %s): %s",
            name,
            client_id,
            site,
            replica.deployment_id,
            replica.node_id,
            reason,
        )
        return Assignment(
            name, client_id, replica, token, priority, reason, assignment_epoch(row, replica)
        )

    async def watch(self, client_id: str, name: str) -> AsyncIterator[PlacementUpdate]:
        """The client's assignment on the service, then one update per change (its replica
        placed again or moved, the client switched to another replica); ends when the
        service is deleted or the client taken off it. NotFound before its first attach."""
        row = await self._assignment(name, client_id)
        if row is None:
            raise NotFound(
                f"client {client_id} is on no replica of service {quote(name)}: UseService first"
            )
        queue: asyncio.Queue[PlacementUpdate | None] = asyncio.Queue()
        key = (name, client_id)
        self._watchers.setdefault(key, set()).add(queue)
        try:
            replica = await self._deployments.deployment(row.deployment_id)
            yield self._update(row, replica, "current")
            while (update := await queue.get()) is not None:
                yield update
        finally:
            queues = self._watchers.get(key, set())
            queues.discard(queue)
            if not queues:
                self._watchers.pop(key, None)

    async def _assignment(self, name: str, client_id: str) -> ServiceClientRecord | None:
        rows = await self._core.db(self._core.store.list_service_clients, name)
        return next((r for r in rows if r.client_id == client_id), None)

    @staticmethod
    def _update(
        row: ServiceClientRecord, replica: DeploymentRecord | None, reason: str
    ) -> PlacementUpdate:
        """What a client's WatchService stream says of its assignment `row` on `replica`
        (no token: the client's own stays)."""
        running = replica is not None and replica.state is DeploymentState.RUNNING
        return PlacementUpdate(
            deployment_id=row.deployment_id,
            endpoint=replica.endpoint if replica is not None and running else "",
            token="",
            epoch=assignment_epoch(row, replica),
            reason=reason,
            state=replica.state if replica is not None else DeploymentState.DELETED,
            node_id=(replica.node_id or "") if replica is not None else "",
        )

    def _tell(self, row: ServiceClientRecord, update: PlacementUpdate | None) -> None:
        for queue in self._watchers.get((row.service, row.client_id), ()):
            queue.put_nowait(update)

    async def on_location(self, client_id: str, site: str) -> None:
        """The client reports `site`: on each service it is on, put it on the best replica
        for that site (a running one, else one started there make-before-break: it keeps
        its replica meanwhile), in effect at the new replica before the client is told on
        its WatchService stream; the replica it left keeps taking its token for
        `SWITCH_DRAIN_S`."""
        store = self._core.store
        mine = [
            r for r in await self._core.db(store.list_service_clients) if r.client_id == client_id
        ]
        for row in mine:
            if row.site == site:
                continue
            record = await self._core.db(store.get_service, row.service)
            if record is None:
                continue
            spec = ServiceSpec.from_json(record.spec_json)
            async with self._lock(row.service):
                current = await self._assignment(row.service, client_id)
                if current is None or current.site == site:
                    continue
                try:
                    replica, reason = await self._choose(record, spec, site)
                except BrokerError as err:
                    logger.warning(
                        "service=%s client=%s stays on deployment=%s for %s: %s",
                        row.service,
                        client_id,
                        current.deployment_id,
                        site,
                        err,
                    )
                    continue
                if replica.deployment_id == current.deployment_id:
                    await self._core.db(
                        store.put_service_client, dataclasses.replace(current, site=site)
                    )
                    continue
                moved = dataclasses.replace(
                    current,
                    deployment_id=replica.deployment_id,
                    site=site,
                    attached_at=time.time(),
                )
                await self._switch(
                    [(current, moved)], replica, spec, f"switched for {site}: {reason}"
                )
            logger.info(
                "service=%s client=%s switched for %s: deployment=%s -> %s (node %s): %s",
                row.service,
                client_id,
                site,
                current.deployment_id,
                replica.deployment_id,
                replica.node_id,
                reason,
            )

    async def _switch(
        self,
        moves: Sequence[tuple[ServiceClientRecord, ServiceClientRecord]],
        replica: DeploymentRecord,
        spec: ServiceSpec,
        reason: str,
    ) -> None:
        """Put each client of `moves` (its record now, its record on `replica`) on
        `replica`: in effect there before the client is told on its WatchService stream;
        the replicas they left keep taking their tokens for `SWITCH_DRAIN_S`. Under the
        service's lock. A push the replica's node did not take puts the records back and
        raises (not taken there: its node unreachable, or not yet re-authenticated after a
        broker restart; the clients stay where they are)."""
        store = self._core.store
        for _, moved in moves:
            await self._core.db(store.put_service_client, moved)
        try:
            await self._push(replica.deployment_id, spec)
        except BaseException:
            for current, _ in moves:
                await self._core.db(store.put_service_client, current)
            raise
        for _, moved in moves:
            self._tell(moved, self._update(moved, replica, reason))
        for left in {current.deployment_id for current, _ in moves}:
            self._core.background(
                self._release(left, spec), f"release-{moves[0][0].service}-{left}"
            )

    async def _release(self, deployment_id: str, spec: ServiceSpec) -> None:
        """After the drain, tell the replica a client left its clients without it."""
        await asyncio.sleep(SWITCH_DRAIN_S)
        await self._push(deployment_id, spec)

    async def revoke(self, client_ids: Sequence[str]) -> None:
        """Take the clients off every service they are on (their API key was revoked or
        replaced): each replica they were on is told its clients without them, so their
        tokens stop working there; with a new key a client attaches again."""
        gone = set(client_ids)
        store = self._core.store
        for row in await self._core.db(store.list_service_clients):
            if row.client_id not in gone:
                continue
            record = await self._core.db(store.get_service, row.service)
            if record is None:
                continue
            async with self._lock(row.service):
                await self._core.db(store.delete_service_client, row.service, row.client_id)
                await self._push(row.deployment_id, ServiceSpec.from_json(record.spec_json))
            self._tell(row, None)
            logger.warning(
                "service=%s client=%s taken off deployment=%s: its API key stopped working",
                row.service,
                row.client_id,
                row.deployment_id,
            )

    async def _choose(
        self, record: ServiceRecord, spec: ServiceSpec, site: str
    ) -> tuple[DeploymentRecord, str]:
        """The replica for a client at `site`, and why; call under the service's lock."""
        store = self._core.store
        rows = await self._core.db(store.list_service_replicas, record.name)
        on = Counter(
            c.deployment_id for c in await self._core.db(store.list_service_clients, record.name)
        )
        running: list[tuple[float, int, DeploymentRecord]] = []
        waiting_here = False
        for row in rows:
            deployment = await self._deployments.deployment(row.deployment_id)
            if deployment is None:
                continue
            node_site = self._network.site_of(deployment.node_id or "")
            if deployment.state is DeploymentState.RUNNING and node_site is not None:
                running.append(
                    (self._latency(site, deployment), on[row.deployment_id], deployment)
                )
            elif row.site == site and deployment.state in (
                DeploymentState.PENDING,
                DeploymentState.STARTING,
            ):
                waiting_here = True
        running.sort(key=lambda r: (r[0], r[1], r[2].deployment_id))
        slo = spec.latency_slo_ms
        within = [r for r in running if not slo or r[0] <= slo]
        if within:
            latency, clients, chosen = within[0]
            return chosen, (
                f"a running replica {latency:.1f} ms from {site} on node {chosen.node_id}, "
                f"{clients} client(s) on it before"
            )
        if len(rows) < spec.max_replicas and not waiting_here:
            why = f"none within {slo:g} ms of {site}" if running else "none runs yet"
            started = await self._start_replica(
                record, spec, site, f"a client at {site} needs a replica: {why}"
            )
            if started.state is DeploymentState.RUNNING:
                return started, f"a replica started at {site} on node {started.node_id} ({why})"
        if running:
            latency, _, chosen = running[0]
            return chosen, (
                f"the nearest running replica, {latency:.1f} ms from {site} on node "
                f"{chosen.node_id}: beyond the service's {slo:g} ms, and no replica can be "
                f"started at {site} now"
            )
        raise ResourceExhausted(
            f"service {record.name} has no running replica and cannot start one at {site} "
            f"now ({len(rows)} of max_replicas {spec.max_replicas}"
            f"{', one pending there' if waiting_here else ''}); try again later"
        )

    async def _start_replica(
        self, record: ServiceRecord, spec: ServiceSpec, site: str, why: str
    ) -> DeploymentRecord:
        """Record a replica of the service at `site`, then deploy it (recorded first: a
        broker stopped in between forgets it at its next start, `load`), and the decision
        with `why`. The deployment as it ended (running, or pending with no node free); the
        deploy's error when it failed, the replica forgotten."""
        deployment_id = new_deployment_id()
        store = self._core.store
        await self._core.db(
            store.add_service_replica,
            ServiceReplicaRecord(deployment_id, record.name, site, time.time()),
        )
        try:
            deployment = await self._deployments.deploy(
                record.owner, spec.deploy_spec(site, record.name), deployment_id
            )
        except BrokerError:
            await self._core.db(store.remove_service_replica, deployment_id)
            raise
        self._follow(deployment_id)
        await self._record(record.name, ScaleAction.START, deployment_id, site, why)
        logger.info(
            "service=%s replica deployment=%s at %s: %s on node %s; started because %s",
            record.name,
            deployment_id,
            site,
            deployment.state,
            deployment.node_id,
            why,
        )
        return deployment

    async def _record(
        self, service: str, action: ScaleAction, deployment_id: str, site: str, why: str
    ) -> None:
        """Keep a scale decision for `offload service show` (a service deleted meanwhile
        keeps none)."""
        event = ServiceEventRecord(service, time.time(), action, deployment_id, site, why)
        with contextlib.suppress(ConstraintError):
            await self._core.db(self._core.store.add_service_event, event)

    def _follow(self, deployment_id: str) -> None:
        if deployment_id not in self._following:
            self._following[deployment_id] = self._core.background(
                self._follow_replica(deployment_id), f"service-replica-{deployment_id}"
            )

    async def _follow_replica(self, deployment_id: str) -> None:
        """Give each new copy of the replica (placed again, moved) its clients once it
        runs; forget the replica once its deployment is deleted."""
        queue = self._deployments.watchers.add(deployment_id)
        try:
            while (update := await queue.get()) is not None:
                if update.state is DeploymentState.RUNNING:
                    record = await self._service_of(deployment_id)
                    if record is not None:
                        await self._push(deployment_id, ServiceSpec.from_json(record.spec_json))
                        await self._tell_clients(deployment_id)
                elif update.state is DeploymentState.PENDING:
                    await self._fail_over(deployment_id, update.reason)
            await self._core.db(self._core.store.remove_service_replica, deployment_id)
        finally:
            self._deployments.watchers.remove(deployment_id, queue)
            self._following.pop(deployment_id, None)

    def on_nodes_lost(self, lost: Collection[str]) -> None:
        """Fail the clients of the replicas on nodes just lost over to running replicas
        elsewhere (`_fail_over`), at once: the replicas themselves are placed again (a
        failover move), which takes a start."""
        for deployment_id in self._following:
            replica = self._deployments.table.get(deployment_id)
            if replica is not None and replica.node_id in lost:
                self._core.background(
                    self._fail_over(deployment_id, f"node {replica.node_id} lost"),
                    f"service-failover-{deployment_id}",
                )

    async def _fail_over(self, deployment_id: str, why: str) -> None:
        """The replica stopped serving and waits to be placed again (its node lost, it was
        preempted or requeued): put each of its clients on another running replica of the
        service within the SLO of the client's site (the nearest, then the least used) at
        once, as a switch; a client with none in reach waits for the replica's next copy
        (`_follow_replica`), as before."""
        record = await self._service_of(deployment_id)
        if record is None:
            return
        spec = ServiceSpec.from_json(record.spec_json)
        store = self._core.store
        async with self._lock(record.name):
            clients = await self._core.db(store.list_service_clients, record.name)
            stranded = [c for c in clients if c.deployment_id == deployment_id]
            if not stranded:
                return
            on = Counter(c.deployment_id for c in clients)
            running: list[DeploymentRecord] = []
            for replica in await self._core.db(store.list_service_replicas, record.name):
                other = await self._deployments.deployment(replica.deployment_id)
                entry = self._registry.nodes.get(other.node_id or "") if other else None
                if (
                    other is not None
                    and entry is not None
                    and other.deployment_id != deployment_id
                    and other.state is DeploymentState.RUNNING
                    and self._registry.is_live(entry)
                    and self._network.site_of(entry.record.node_id) is not None
                ):
                    running.append(other)
            now = time.time()
            moves: dict[str, list[tuple[ServiceClientRecord, ServiceClientRecord]]] = {}
            for row in stranded:
                slo = spec.latency_slo_ms
                distances = [(self._latency(row.site, r), r) for r in running]
                reach = [
                    (latency, on[r.deployment_id], r.deployment_id, r)
                    for latency, r in distances
                    if not slo or latency <= slo
                ]
                if not reach:
                    continue
                *_, target = min(reach, key=lambda t: t[:3])
                on[target.deployment_id] += 1
                moved = dataclasses.replace(
                    row, deployment_id=target.deployment_id, attached_at=now
                )
                moves.setdefault(target.deployment_id, []).append((row, moved))
            for target_id, pairs in moves.items():
                target = next(r for r in running if r.deployment_id == target_id)
                try:
                    await self._switch(
                        pairs, target, spec, f"your replica stopped serving ({why}): failed over"
                    )
                except BrokerError as err:  # they wait for the replica's next copy
                    logger.warning(
                        "service=%s: %d client(s) of deployment=%s not failed over to %s: %s",
                        record.name,
                        len(pairs),
                        deployment_id,
                        target_id,
                        err,
                    )
                    continue
                logger.info(
                    "service=%s failed %d client(s) over from deployment=%s (%s) to %s (node %s)",
                    record.name,
                    len(pairs),
                    deployment_id,
                    why,
                    target_id,
                    target.node_id,
                )

    def _latency(self, site: str, replica: DeploymentRecord) -> float:
        """One-way latency from `site` to the replica's node (the cluster file's); call
        for a replica whose node has a site."""
        node_site = self._network.site_of(replica.node_id or "") or site
        return self._network.latency_ms(site, node_site, replica.node_id or "")

    async def _tell_clients(self, deployment_id: str) -> None:
        """Tell the clients on the replica where it runs now (placed again, moved)."""
        replica = await self._deployments.deployment(deployment_id)
        rows = await self._core.db(
            self._core.store.list_service_clients, deployment_id=deployment_id
        )
        for row in rows:
            self._tell(row, self._update(row, replica, "the replica runs here now"))

    async def _service_of(self, deployment_id: str) -> ServiceRecord | None:
        for row in await self._core.db(self._core.store.list_service_replicas):
            if row.deployment_id == deployment_id:
                return await self._core.db(self._core.store.get_service, row.service)
        return None

    async def _push(self, deployment_id: str, spec: ServiceSpec) -> None:
        """Send the replica's node the replica's clients as the store has them now."""
        async with self._pushing.setdefault(deployment_id, asyncio.Lock()):
            deployment = await self._deployments.deployment(deployment_id)
            if deployment is None or deployment.state is not DeploymentState.RUNNING:
                return  # its next copy gets them once it runs (`_follow_replica`)
            entry = self._registry.nodes.get(deployment.node_id or "")
            if entry is None:
                return
            rows = await self._core.db(
                self._core.store.list_service_clients, deployment_id=deployment_id
            )
            clients: Sequence[ClientEntry] = [
                ClientEntry(
                    client_id=row.client_id,
                    priority_class=row.priority_class,
                    token_sha256=row.token_sha256,
                    max_rps=spec.max_rps_per_client,
                )
                for row in rows
            ]
            replica = replica_id(deployment_id, deployment.epoch)
            if not await entry.client.set_replica_clients(replica, clients):
                logger.warning(
                    "replica=%s on node=%s is gone: its next copy gets its clients",
                    replica,
                    deployment.node_id,
                )
