"""`offload.v1.NodeRegistry` and `offload.v1.EdgeBroker`: thin methods over `Broker`.

NodeRegistry calls carry the cluster's join token, EdgeBroker calls a client's API key, both
as `authorization: Bearer ...`; a missing or wrong one is UNAUTHENTICATED. Over TLS a node
also presents a certificate (its port requires one, signed by the broker's CA): one for
another node id is PERMISSION_DENIED. A node's registrations and heartbeats also show its
node secret (`offload-node-secret`), which `Broker.register_node` binds the id to.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import cast

import grpc

from broker.errors import InvalidRequest, PermissionDenied, Unauthenticated, client_text, quote
from broker.migrations import Migrations
from broker.nodes import NodeRegistry, ReplicaState
from broker.quotas import within_idle_timeout
from broker.rpc import validate
from broker.rpc.convert import inventory_from_proto, node_sample_from_proto, offload_from_proto
from broker.rpc.service_messages import (
    assignment_message,
    client_class,
    service_message,
    service_spec,
)
from broker.rpc.status import mapped_errors
from broker.service import Broker
from broker.state import DeploymentRecord, MigrationRecord, MigrationTrigger
from broker.uploads import ClientUpload
from broker.values import DeploySpec, PlacementUpdate
from common.node_identity import NODE_SECRET_HEADER
from migration.mechanism import Strategy
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from protos.offload.v1 import node_pb2 as npb
from runtime.tls import peer_common_name

RESIZES_SHOWN = 10
"""Resizes GetDeployment returns (the most recent)."""

_REPLICA_STATES = {
    npb.REPLICA_STATE_STARTING: ReplicaState.STARTING,
    npb.REPLICA_STATE_READY: ReplicaState.READY,
    npb.REPLICA_STATE_STOPPING: ReplicaState.STOPPING,
    npb.REPLICA_STATE_EXITED: ReplicaState.EXITED,
}


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    return _metadata(context, "authorization")


def _metadata(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


def _replicas(replicas: list[npb.Replica]) -> list[tuple[str, ReplicaState]]:
    validate.count("replicas", replicas, validate.MAX_REPLICAS)
    return [
        (
            validate.replica_id(f"replicas[{i}].replica_id", r.replica_id),
            _REPLICA_STATES.get(r.state, ReplicaState.UNKNOWN),
        )
        for i, r in enumerate(replicas)
    ]


def _runtimes(runtimes: list[str]) -> list[str]:
    validate.count("runtimes", runtimes, validate.MAX_LIST)
    return [validate.identifier(f"runtimes[{i}]", r) for i, r in enumerate(runtimes)]


class NodeRegistryServicer(pb_grpc.NodeRegistryServicer):
    def __init__(self, broker: Broker, *, node_certificates: bool = False) -> None:
        """`node_certificates`: served on a mutual-TLS port, so every caller presented a
        certificate the listener verified; its common name must be the node id."""
        self._broker = broker
        self._node_certificates = node_certificates

    def _check(self, context: grpc.aio.ServicerContext, node_id: str | None = None) -> str | None:
        """The join token, and over mutual TLS a certificate for `node_id` (any node's
        certificate when None): its name; None without mutual TLS."""
        if not self._broker.check_join_token(_authorization(context)):
            raise Unauthenticated(
                "missing or wrong join token: send 'authorization: Bearer <join token>' "
                "(the broker's --join-token-file)"
            )
        return self._check_certificate(context, node_id)

    def _check_certificate(
        self, context: grpc.aio.ServicerContext, node_id: str | None = None
    ) -> str | None:
        """Over mutual TLS, a certificate for `node_id` (any node's when None): its name;
        None without mutual TLS."""
        if not self._node_certificates:
            return None
        name = peer_common_name(context)
        if name is None:
            raise Unauthenticated(
                "nodes must present a certificate signed by the broker's CA "
                "(offload node --tls-cert/--tls-key/--tls-ca)"
            )
        self._check_name(name, node_id)
        return name

    @staticmethod
    def _check_name(name: str | None, node_id: str | None) -> None:
        """A certificate named `name` (None: none asked for) may speak for `node_id`."""
        if name is not None and node_id is not None and name != node_id:
            raise PermissionDenied(
                f"this certificate is for node {quote(name)}, not {quote(node_id)}: issue one "
                "whose name is the node id (offload certs issue NODE_ID ...)"
            )

    @mapped_errors
    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        self._check(context, request.node_id)
        await self._broker.register_node(
            request.node_id,
            request.address,
            request.site,
            inventory_from_proto(request.inventory),
            _runtimes(list(request.runtimes)),
            _replicas(list(request.replicas)),
            secret=_metadata(context, NODE_SECRET_HEADER) or "",
            certified=self._node_certificates,
        )
        settings = self._broker.settings
        return pb.RegisterResponse(
            heartbeat_interval_ms=round(settings.heartbeat_interval_s * 1000),
            lost_after_ms=round(settings.lost_after_s * 1000),
            lease_renew_ms=round(self._broker.registry.renew_s(request.beacons) * 1000),
        )

    @mapped_errors
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        self._check(context, request.node_id)
        self._beat(request, _metadata(context, NODE_SECRET_HEADER))
        return pb.HeartbeatResponse()

    @mapped_errors
    async def Heartbeats(
        self, requests: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        """Heartbeat, one message each, on one call: the token is checked once, when the
        stream opens; each message's node must be the certificate's, and bound to the
        stream's node secret. The stream is the node's liveness: the registry is told when
        it ends, however it ends (`NodeRegistry.stream_closed`). A first message that asks
        for beacons is answered with a key for this stream, where the broker takes them."""
        # The connection's certificate cannot change within the call: read once (gRPC
        # copies the whole auth context, PEM and all, at each read).
        certificate = self._check(context)
        secret = _metadata(context, NODE_SECRET_HEADER)
        registry = self._broker.registry
        stream = object()
        streaming: str | None = None
        try:
            async for request in requests:
                self._check_name(certificate, request.node_id)
                node_id = self._beat(request, secret)
                if node_id == streaming:
                    yield pb.HeartbeatResponse()
                    continue
                if streaming is not None:
                    registry.stream_closed(streaming, stream)
                registry.stream_opened(node_id, stream)
                streaming = node_id
                issued = registry.issue_beacon(node_id, stream) if request.beacons else None
                yield pb.HeartbeatResponse(beacon=_beacon(registry, issued))
        finally:
            if streaming is not None:
                registry.stream_closed(streaming, stream)

    def _beat(self, request: pb.HeartbeatRequest, secret: str | None) -> str:
        """Take one heartbeat or lease renewal; the node's id."""
        node_id = validate.node_id("node_id", request.node_id)
        self._broker.registry.check(node_id, secret)
        if request.lease_only:
            self._broker.registry.renew(node_id)
            return node_id
        sample = node_sample_from_proto(request.usage)
        self._broker.heartbeat(node_id, sample, _replicas(list(request.replicas)))
        return node_id

    @mapped_errors
    async def FetchModel(
        self, request: pb.FetchModelRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[npb.ModelChunk]:
        self._check(context)
        sha256 = validate.sha256("sha256", request.sha256)
        chunks = self._broker.uploads.model_chunks(sha256)
        first = True
        while (data := await asyncio.to_thread(next, chunks, None)) is not None:
            yield npb.ModelChunk(sha256=sha256 if first else "", data=data)
            first = False


def _beacon(registry: NodeRegistry, issued: tuple[bytes, bytes] | None) -> pb.Beacon | None:
    """The beacon key `issued` for a stream, as the node is told it; None without one."""
    if issued is None or registry.beacons is None:
        return None
    beacon_id, key = issued
    return pb.Beacon(
        port=registry.beacons.port,
        id=beacon_id,
        key=key,
        interval_ms=round(registry.beacon_interval_s * 1000),
    )


def deployment_message(record: DeploymentRecord, endpoint_ca: str = "") -> pb.Deployment:
    """The client's view of a deployment; `endpoint_ca` (PEM) goes with an endpoint whose
    replica serves TLS."""
    return pb.Deployment(
        endpoint_ca_pem=endpoint_ca if record.endpoint else "",
        deployment_id=record.deployment_id,
        endpoint=record.endpoint,
        token=record.token,
        epoch=record.epoch,
        node_id=record.node_id or "",
        gpu_uuids=record.gpu_uuids,
        model_name=record.model_name,
        state=str(record.state),
        # Cleaned again on the way out: a reason stored by an older broker may carry a
        # node's raw text.
        reason=client_text(record.reason),
        explanation_json=record.explanation_json,
        client_id=record.client_id,
        site=record.site,
        priority=cast(pb.PriorityClass, record.priority),
        model_sha256=record.model_sha256,
    )


def deploy_spec(request: pb.DeployRequest) -> DeploySpec:
    """The request's spec, every field within its bounds (`broker.rpc.validate`); the
    domain checks the rest (`DeploySpec.validate`)."""
    return DeploySpec(
        model_sha256=validate.sha256("model_sha256", request.model_sha256),
        model_name=request.model_name,
        site=validate.site("site", request.site),
        gpus=request.gpus,
        gpu_memory_mib=validate.integer(
            "gpu_memory_mib", request.gpu_memory_mib, 0, validate.MAX_GPU_MEMORY_MIB
        ),
        p2p_required=request.p2p_required,
        cpus=validate.number("cpus", request.cpus, 0, validate.MAX_CPUS),
        memory_mib=validate.integer("memory_mib", request.memory_mib, 0, validate.MAX_MEMORY_MIB),
        priority=validate.priority(request.priority),
        latency_slo_ms=validate.number(
            "latency_slo_ms", request.latency_slo_ms, 0, validate.MAX_LATENCY_SLO_MS
        ),
        cpus_min=validate.number("cpus_min", request.cpus_min, 0, validate.MAX_CPUS),
        cpus_max=validate.number("cpus_max", request.cpus_max, 0, validate.MAX_CPUS),
    )


def migration_message(m: MigrationRecord) -> pb.Migration:
    return pb.Migration(
        migration_id=m.migration_id,
        deployment_id=m.deployment_id,
        trigger=str(m.trigger),
        source_node=m.source_node,
        target_node=m.target_node,
        strategy=str(m.strategy),
        state=str(m.state),
        timeline=[
            pb.MigrationEvent(event=e["event"], at=e["at"]) for e in json.loads(m.timeline_json)
        ],
        outcome=m.outcome,
        reason=client_text(m.reason),
        downtime_ms=-1.0 if m.downtime_ms is None else m.downtime_ms,
        failed_requests=-1 if m.failed_requests is None else m.failed_requests,
        span_gap_ms=-1.0 if m.span_gap_ms is None else m.span_gap_ms,
        prewarmed=m.prewarmed,
    )


def _same_client(declared: str, client_id: str) -> None:
    """A request's optional `client_id` must be the API key's."""
    if declared and validate.identifier("client_id", declared) != client_id:
        raise InvalidRequest(
            f"client_id {quote(declared)} is not the API key's client {quote(client_id)}"
        )


def _to_node(request: pb.MigrateRequest) -> str:
    """The target node of a migration; empty: the best that fits."""
    return validate.node_id("to_node", request.to_node) if request.to_node else ""


def _strategy(name: str) -> Strategy:
    if name in ("", "make_before_break"):
        return Strategy.MAKE_BEFORE_BREAK
    if name == "stop_start":
        return Strategy.STOP_START
    raise InvalidRequest(f"strategy {quote(name)}: use make_before_break or stop_start")


async def _migration(migrations: Migrations, migration_id: str) -> pb.Migration:
    return migration_message(await migrations.broker.moves.get_migration(migration_id))


class EdgeBrokerServicer(pb_grpc.EdgeBrokerServicer):
    def __init__(self, broker: Broker, migrations: Migrations, endpoint_ca: str = "") -> None:
        """`endpoint_ca`: PEM of the CA replicas' certificates chain to (the broker's own
        --tls-ca: its nodes' certificates chain to it, and replicas serve theirs), sent with
        every endpoint; empty: replicas serve plaintext."""
        self._broker = broker
        self._migrations = migrations
        self._endpoint_ca = endpoint_ca

    async def _client(self, context: grpc.aio.ServicerContext) -> str:
        client_id = await self._broker.client_for(_authorization(context), context.peer())
        if client_id is None:
            raise Unauthenticated(
                "missing or wrong API key: send 'authorization: Bearer <client id>.<secret>'"
            )
        return client_id

    @mapped_errors
    async def UploadModel(
        self, request_iterator: AsyncIterator[npb.ModelChunk], context: grpc.aio.ServicerContext
    ) -> pb.UploadModelResponse:
        client_id = await self._client(context)
        limits = self._broker.limits
        upload: ClientUpload | None = None
        name = ""
        try:
            with limits.uploads.hold(client_id):
                chunks = within_idle_timeout(request_iterator, limits.quotas.upload_idle_timeout_s)
                async for chunk in chunks:
                    if upload is None:
                        if not chunk.sha256:
                            raise InvalidRequest("the first chunk must carry the model's sha256")
                        name = validate.name("name", chunk.name) if chunk.name else ""
                        upload = await self._broker.uploads.begin_upload(
                            client_id, validate.sha256("sha256", chunk.sha256)
                        )
                    elif chunk.sha256 and chunk.sha256 != upload.upload.sha256:
                        raise InvalidRequest("a later chunk declares a different sha256")
                    await self._broker.uploads.write_upload(upload, chunk.data)
                if upload is None:
                    raise InvalidRequest("the upload stream is empty")
                sha, size, deduplicated = await self._broker.uploads.finish_upload(upload, name)
        finally:
            if upload is not None:
                self._broker.uploads.end_upload(upload)
        return pb.UploadModelResponse(sha256=sha, size_bytes=size, deduplicated=deduplicated)

    @mapped_errors
    async def Deploy(
        self, request: pb.DeployRequest, context: grpc.aio.ServicerContext
    ) -> pb.Deployment:
        client_id = await self._client(context)
        _same_client(request.client_id, client_id)
        record = await self._broker.deployments.deploy(client_id, deploy_spec(request))
        self._migrations.on_deployed(record)
        return deployment_message(record, self._endpoint_ca)

    @mapped_errors
    async def GetDeployment(
        self, request: pb.GetDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> pb.Deployment:
        client_id = await self._client(context)
        deployment_id = validate.identifier("deployment_id", request.deployment_id)
        message = deployment_message(
            await self._broker.deployments.get(client_id, deployment_id), self._endpoint_ca
        )
        resizes = await self._broker.registry.resizes(deployment_id)
        message.resizes.extend(
            npb.ResizeEvent(
                event_id=r.event_id,
                replica_id=r.replica_id,
                deployment_id=r.deployment_id,
                cpus_before=r.cpus_before,
                cpus_after=r.cpus_after,
                policy=r.policy,
                reason=r.reason,
                at=r.at,
            )
            for r in resizes[-RESIZES_SHOWN:]
        )
        return message

    @mapped_errors
    async def ListDeployments(
        self, request: pb.ListDeploymentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDeploymentsResponse:
        client_id = await self._client(context)
        records = await self._broker.deployments.list(client_id)
        return pb.ListDeploymentsResponse(
            deployments=[deployment_message(r, self._endpoint_ca) for r in records]
        )

    @mapped_errors
    async def DeleteDeployment(
        self, request: pb.DeleteDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteDeploymentResponse:
        client_id = await self._client(context)
        deleted = await self._broker.deployments.delete(
            client_id, validate.identifier("deployment_id", request.deployment_id)
        )
        return pb.DeleteDeploymentResponse(already_deleted=not deleted)

    @mapped_errors
    async def WatchDeployment(
        self, request: pb.WatchDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PlacementUpdate]:
        client_id = await self._client(context)
        deployment_id = validate.identifier("deployment_id", request.deployment_id)
        with self._broker.limits.watch_streams.hold(client_id):
            updates = self._broker.deployments.watch(
                client_id, deployment_id, _authorization(context)
            )
            async for update in updates:
                yield self._update_message(update)

    def _update_message(self, update: PlacementUpdate) -> pb.PlacementUpdate:
        return pb.PlacementUpdate(
            deployment_id=update.deployment_id,
            endpoint=update.endpoint,
            token=update.token,
            epoch=update.epoch,
            reason=update.reason,
            migration_id=update.migration_id,
            state=str(update.state),
            prepared_ms=update.prepared_ms,
            endpoint_ca_pem=self._endpoint_ca if update.endpoint else "",
            node_id=update.node_id,
        )

    @mapped_errors
    async def ReportLocation(
        self, request: pb.ReportLocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportLocationResponse:
        client_id = await self._client(context)
        _same_client(request.client_id, client_id)
        started = await self._migrations.on_location(
            client_id, validate.site("site", request.site)
        )
        return pb.ReportLocationResponse(migration_id=started[0] if started else "")

    @mapped_errors
    async def AckSwitch(
        self, request: pb.AckSwitchRequest, context: grpc.aio.ServicerContext
    ) -> pb.AckSwitchResponse:
        client_id = await self._client(context)
        deployment_id = validate.identifier("deployment_id", request.deployment_id)
        epoch = validate.epoch("epoch", request.epoch)
        await self._broker.deployments.get(client_id, deployment_id)
        self._migrations.on_ack(deployment_id, epoch)
        return pb.AckSwitchResponse()

    @mapped_errors
    async def ReportObservation(
        self, request: pb.ObservationReport, context: grpc.aio.ServicerContext
    ) -> pb.ObservationAck:
        """A migration's observation (`migration_id` set), an offload summary (`offload`
        set), or both; every field is checked before either is recorded."""
        client_id = await self._client(context)
        deployment_id = validate.identifier("deployment_id", request.deployment_id)
        summary = offload_from_proto(request.offload) if request.HasField("offload") else None
        validate.integer("requests", request.requests, 0, validate.MAX_REQUESTS)
        gap_ms = validate.number("longest_gap_ms", request.longest_gap_ms, 0, validate.MAX_GAP_MS)
        failed = validate.integer(
            "failed_requests", request.failed_requests, 0, validate.MAX_REQUESTS
        )
        span_gap_ms = None
        if request.HasField("span_gap_ms"):  # unset from an older client
            span_gap_ms = validate.span_gap(request.span_gap_ms, gap_ms)
        if request.migration_id:
            await self._migrations.on_observation(
                client_id,
                deployment_id,
                validate.identifier("migration_id", request.migration_id),
                gap_ms,
                failed,
                span_gap_ms=span_gap_ms,
            )
        elif summary is None:
            raise InvalidRequest(
                "the report has neither a migration_id (a migration's observation) nor an "
                "offload summary"
            )
        elif gap_ms or failed or request.requests or span_gap_ms is not None:
            raise InvalidRequest(
                "longest_gap_ms, span_gap_ms, failed_requests and requests describe a "
                "migration: give its migration_id"
            )
        if summary is not None:
            await self._broker.reports.record_offload(client_id, deployment_id, summary)
        return pb.ObservationAck()

    @mapped_errors
    async def Migrate(
        self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> pb.Migration:
        client_id = await self._client(context)
        migration_id = await self._migrations.migrate(
            validate.identifier("deployment_id", request.deployment_id),
            _to_node(request),
            _strategy(request.strategy),
            MigrationTrigger.OPERATOR,
            client_id=client_id,
        )
        return await _migration(self._migrations, migration_id)

    @mapped_errors
    async def ListMigrations(
        self, request: pb.ListMigrationsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListMigrationsResponse:
        client_id = await self._client(context)
        deployment_id = validate.identifier("deployment_id", request.deployment_id)
        await self._broker.deployments.get(client_id, deployment_id)
        records = await self._broker.moves.list_migrations(deployment_id)
        return pb.ListMigrationsResponse(migrations=[migration_message(m) for m in records])

    @mapped_errors
    async def CreateService(
        self, request: pb.CreateServiceRequest, context: grpc.aio.ServicerContext
    ) -> pb.Service:
        client_id = await self._client(context)
        view = await self._broker.services.create(
            client_id, request.name, service_spec(request.spec)
        )
        return service_message(view)

    @mapped_errors
    async def GetService(
        self, request: pb.GetServiceRequest, context: grpc.aio.ServicerContext
    ) -> pb.Service:
        client_id = await self._client(context)
        return service_message(await self._broker.services.get(client_id, request.name))

    @mapped_errors
    async def ListServices(
        self, request: pb.ListServicesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListServicesResponse:
        client_id = await self._client(context)
        views = await self._broker.services.list(client_id)
        return pb.ListServicesResponse(services=[service_message(v) for v in views])

    @mapped_errors
    async def DeleteService(
        self, request: pb.DeleteServiceRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteServiceResponse:
        client_id = await self._client(context)
        await self._broker.services.delete(client_id, request.name)
        return pb.DeleteServiceResponse()

    @mapped_errors
    async def UseService(
        self, request: pb.UseServiceRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServiceAssignment:
        client_id = await self._client(context)
        assignment = await self._broker.services.use(
            client_id,
            request.name,
            validate.site("site", request.site),
            client_class(request.priority),
        )
        return assignment_message(assignment, self._endpoint_ca)

    @mapped_errors
    async def WatchService(
        self, request: pb.WatchServiceRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PlacementUpdate]:
        client_id = await self._client(context)
        with self._broker.limits.watch_streams.hold(client_id):
            async for update in self._broker.services.watch(client_id, request.name):
                yield self._update_message(update)


class OperatorServicer(pb_grpc.OperatorServicer):
    """Cluster operations, authenticated by the join token (the cluster's own secret)."""

    def __init__(self, migrations: Migrations) -> None:
        self._migrations = migrations

    def _check(self, context: grpc.aio.ServicerContext) -> None:
        if not self._migrations.broker.check_join_token(_authorization(context)):
            raise Unauthenticated("operator calls need 'authorization: Bearer <join token>'")

    @mapped_errors
    async def DrainNode(
        self, request: pb.DrainNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainNodeResponse:
        self._check(context)
        started = await self._migrations.drain(validate.node_id("node_id", request.node_id))
        return pb.DrainNodeResponse(migration_ids=started)

    @mapped_errors
    async def RetireNode(
        self, request: pb.RetireNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RetireNodeResponse:
        self._check(context)
        await self._migrations.broker.registry.retire(validate.node_id("node_id", request.node_id))
        return pb.RetireNodeResponse()

    @mapped_errors
    async def Migrate(
        self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> pb.Migration:
        self._check(context)
        migration_id = await self._migrations.migrate(
            validate.identifier("deployment_id", request.deployment_id),
            _to_node(request),
            _strategy(request.strategy),
        )
        return await _migration(self._migrations, migration_id)

    @mapped_errors
    async def ListMigrations(
        self, request: pb.ListMigrationsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListMigrationsResponse:
        self._check(context)
        broker = self._migrations.broker
        deployment_id = request.deployment_id
        if deployment_id:
            validate.identifier("deployment_id", deployment_id)
        records = await broker.moves.list_migrations(deployment_id or None)
        return pb.ListMigrationsResponse(migrations=[migration_message(m) for m in records])
