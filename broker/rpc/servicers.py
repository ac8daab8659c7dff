"""`offload.v1.NodeRegistry` and `offload.v1.EdgeBroker`: thin methods over `Broker`.

NodeRegistry calls carry the cluster's join token, EdgeBroker calls a client's API key, both
as `authorization: Bearer ...`; a missing or wrong one is UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import cast

import grpc

from broker.errors import InvalidRequest, NotFound, Unauthenticated
from broker.migrations import Migrations
from broker.model_store import Upload
from broker.placement import PriorityClass
from broker.rpc.convert import inventory_from_proto
from broker.rpc.status import mapped_errors
from broker.service import Broker, DeploySpec
from broker.state import DeploymentRecord, MigrationRecord, MigrationTrigger
from migration.mechanism import Strategy
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from protos.offload.v1 import node_pb2 as npb

_REPLICA_STATES = {
    npb.REPLICA_STATE_STARTING: "starting",
    npb.REPLICA_STATE_READY: "ready",
    npb.REPLICA_STATE_STOPPING: "stopping",
    npb.REPLICA_STATE_EXITED: "exited",
}


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode()
    return None


def _replicas(replicas: list[npb.Replica]) -> list[tuple[str, str]]:
    return [(r.replica_id, _REPLICA_STATES.get(r.state, "unknown")) for r in replicas]


class NodeRegistryServicer(pb_grpc.NodeRegistryServicer):
    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def _check(self, context: grpc.aio.ServicerContext) -> None:
        if not self._broker.check_join_token(_authorization(context)):
            raise Unauthenticated(
                "missing or wrong join token: send 'authorization: Bearer <join token>' "
                "(the broker's --join-token-file)"
            )

    @mapped_errors
    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        self._check(context)
        await self._broker.register_node(
            request.node_id,
            request.address,
            request.site,
            inventory_from_proto(request.inventory),
            list(request.runtimes),
            _replicas(list(request.replicas)),
        )
        settings = self._broker.settings
        return pb.RegisterResponse(
            heartbeat_interval_ms=round(settings.heartbeat_interval_s * 1000),
            lost_after_ms=round(settings.lost_after_s * 1000),
        )

    @mapped_errors
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        self._check(context)
        gpus = request.usage.gpus
        load = sum(g.utilization_pct for g in gpus) / (100 * len(gpus)) if gpus else 0.0
        await self._broker.heartbeat(request.node_id, load, _replicas(list(request.replicas)))
        return pb.HeartbeatResponse()

    @mapped_errors
    async def FetchModel(
        self, request: pb.FetchModelRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[npb.ModelChunk]:
        self._check(context)
        chunks = self._broker.model_chunks(request.sha256)
        first = True
        while (data := await asyncio.to_thread(next, chunks, None)) is not None:
            yield npb.ModelChunk(sha256=request.sha256 if first else "", data=data)
            first = False


def deployment_message(record: DeploymentRecord) -> pb.Deployment:
    return pb.Deployment(
        deployment_id=record.deployment_id,
        endpoint=record.endpoint,
        token=record.token,
        epoch=record.epoch,
        node_id=record.node_id or "",
        gpu_uuids=record.gpu_uuids,
        model_name=record.model_name,
        state=str(record.state),
        reason=record.reason,
        explanation_json=record.explanation_json,
        client_id=record.client_id,
        site=record.site,
        priority=cast(pb.PriorityClass, record.priority),
        model_sha256=record.model_sha256,
    )


def deploy_spec(request: pb.DeployRequest) -> DeploySpec:
    priority = request.priority or pb.PRIORITY_CLASS_STANDARD
    try:
        priority_class = PriorityClass(priority)
    except ValueError:
        raise InvalidRequest(f"unknown priority class {priority}") from None
    return DeploySpec(
        model_sha256=request.model_sha256,
        model_name=request.model_name,
        site=request.site,
        gpus=request.gpus,
        gpu_memory_mib=request.gpu_memory_mib,
        p2p_required=request.p2p_required,
        cpus=request.cpus,
        memory_mib=request.memory_mib,
        priority=priority_class,
        latency_slo_ms=request.latency_slo_ms,
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
        reason=m.reason,
        downtime_ms=-1.0 if m.downtime_ms is None else m.downtime_ms,
        failed_requests=-1 if m.failed_requests is None else m.failed_requests,
    )


def _strategy(name: str) -> Strategy:
    if name in ("", "make_before_break"):
        return Strategy.MAKE_BEFORE_BREAK
    if name == "stop_start":
        return Strategy.STOP_START
    raise InvalidRequest(f"strategy {name!r}: use make_before_break or stop_start")


async def _migration(migrations: Migrations, migration_id: str) -> pb.Migration:
    broker = migrations.broker
    for m in await broker.db(broker.store.list_migrations):
        if m.migration_id == migration_id:
            return migration_message(m)
    raise NotFound(f"migration {migration_id} not found")


class EdgeBrokerServicer(pb_grpc.EdgeBrokerServicer):
    def __init__(self, broker: Broker, migrations: Migrations) -> None:
        self._broker = broker
        self._migrations = migrations

    async def _client(self, context: grpc.aio.ServicerContext) -> str:
        client_id = await self._broker.client_for(_authorization(context))
        if client_id is None:
            raise Unauthenticated(
                "missing or wrong API key: send 'authorization: Bearer <client id>.<secret>'"
            )
        return client_id

    @mapped_errors
    async def UploadModel(
        self, request_iterator: AsyncIterator[npb.ModelChunk], context: grpc.aio.ServicerContext
    ) -> pb.UploadModelResponse:
        await self._client(context)
        upload: Upload | None = None
        name = ""
        try:
            async for chunk in request_iterator:
                if upload is None:
                    if not chunk.sha256:
                        raise InvalidRequest("the first chunk must carry the model's sha256")
                    upload = self._broker.begin_upload(chunk.sha256)
                    name = chunk.name
                elif chunk.sha256 and chunk.sha256 != upload.sha256:
                    raise InvalidRequest("a later chunk declares a different sha256")
                await asyncio.to_thread(self._broker.write_upload, upload, chunk.data)
            if upload is None:
                raise InvalidRequest("the upload stream is empty")
            sha, size, deduplicated = await self._broker.finish_upload(upload, name)
        except BaseException:
            if upload is not None:
                upload.abort()
            raise
        return pb.UploadModelResponse(sha256=sha, size_bytes=size, deduplicated=deduplicated)

    @mapped_errors
    async def Deploy(
        self, request: pb.DeployRequest, context: grpc.aio.ServicerContext
    ) -> pb.Deployment:
        client_id = await self._client(context)
        if request.client_id and request.client_id != client_id:
            raise InvalidRequest(
                f"client_id {request.client_id!r} is not the API key's client {client_id!r}"
            )
        record = await self._broker.deploy(client_id, deploy_spec(request))
        return deployment_message(record)

    @mapped_errors
    async def GetDeployment(
        self, request: pb.GetDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> pb.Deployment:
        client_id = await self._client(context)
        return deployment_message(await self._broker.get(client_id, request.deployment_id))

    @mapped_errors
    async def ListDeployments(
        self, request: pb.ListDeploymentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDeploymentsResponse:
        client_id = await self._client(context)
        records = await self._broker.list(client_id)
        return pb.ListDeploymentsResponse(deployments=[deployment_message(r) for r in records])

    @mapped_errors
    async def DeleteDeployment(
        self, request: pb.DeleteDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteDeploymentResponse:
        client_id = await self._client(context)
        await self._broker.delete(client_id, request.deployment_id)
        return pb.DeleteDeploymentResponse()

    @mapped_errors
    async def WatchDeployment(
        self, request: pb.WatchDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PlacementUpdate]:
        client_id = await self._client(context)
        async for update in self._broker.watch(client_id, request.deployment_id):
            yield pb.PlacementUpdate(
                deployment_id=update.deployment_id,
                endpoint=update.endpoint,
                token=update.token,
                epoch=update.epoch,
                reason=update.reason,
                migration_id=update.migration_id,
                state=str(update.state),
            )

    @mapped_errors
    async def ReportLocation(
        self, request: pb.ReportLocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportLocationResponse:
        client_id = await self._client(context)
        if request.client_id and request.client_id != client_id:
            raise InvalidRequest(
                f"client_id {request.client_id!r} is not the API key's client {client_id!r}"
            )
        started = await self._migrations.on_location(client_id, request.site)
        return pb.ReportLocationResponse(migration_id=started[0] if started else "")

    @mapped_errors
    async def AckSwitch(
        self, request: pb.AckSwitchRequest, context: grpc.aio.ServicerContext
    ) -> pb.AckSwitchResponse:
        client_id = await self._client(context)
        await self._broker.get(client_id, request.deployment_id)
        self._migrations.on_ack(request.deployment_id, request.epoch)
        return pb.AckSwitchResponse()

    @mapped_errors
    async def ReportObservation(
        self, request: pb.ObservationReport, context: grpc.aio.ServicerContext
    ) -> pb.ObservationAck:
        client_id = await self._client(context)
        await self._migrations.on_observation(
            client_id,
            request.deployment_id,
            request.migration_id,
            request.longest_gap_ms,
            request.failed_requests,
        )
        return pb.ObservationAck()

    @mapped_errors
    async def Migrate(
        self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> pb.Migration:
        client_id = await self._client(context)
        migration_id = await self._migrations.migrate(
            request.deployment_id,
            request.to_node,
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
        await self._broker.get(client_id, request.deployment_id)
        records = await self._broker.db(self._broker.store.list_migrations, request.deployment_id)
        return pb.ListMigrationsResponse(migrations=[migration_message(m) for m in records])


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
        started = await self._migrations.drain(request.node_id)
        return pb.DrainNodeResponse(migration_ids=started)

    @mapped_errors
    async def Migrate(
        self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> pb.Migration:
        self._check(context)
        migration_id = await self._migrations.migrate(
            request.deployment_id, request.to_node, _strategy(request.strategy)
        )
        return await _migration(self._migrations, migration_id)

    @mapped_errors
    async def ListMigrations(
        self, request: pb.ListMigrationsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListMigrationsResponse:
        self._check(context)
        broker = self._migrations.broker
        records = await broker.db(broker.store.list_migrations, request.deployment_id or None)
        return pb.ListMigrationsResponse(migrations=[migration_message(m) for m in records])
