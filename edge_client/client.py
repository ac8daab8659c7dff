"""`OffloadClient`: upload a model, deploy it, and infer on its replica, following the
deployment wherever the broker places it. `SyncOffloadClient` is the same, blocking.

Paths:

- Broker calls (EdgeBroker, `authorization: Bearer <api key>`) each have a deadline. The
  idempotent ones (upload, get, delete, report location, ack, observation) are retried with
  backoff while the broker answers UNAVAILABLE (it restarts), for up to `broker_retry_s`. Deploy is
  not idempotent (a second one would place a second deployment): it waits for the broker to
  be reachable within its deadline and is sent again only when a standby refused it.
- Several brokers (`broker="A,B"`, one PostgreSQL state, one leader): broker calls go to one
  address until it answers UNAVAILABLE, then to the leader a standby named in its refusal
  (`common.brokers`), else to the next address; a deploy passes over a broker it cannot
  connect to within `BROKER_CONNECT_S`.
- Inference goes straight to the replica (Open Inference Protocol, `authorization: Bearer
  <replica token>`); the broker is not on this path, so it keeps working while the broker is
  down. A call that fails with UNAVAILABLE, or CANCELLED by the other side (a replica racing
  its own shutdown), is sent once more on the newest endpoint (inference is idempotent).
- After deploy or attach a background task keeps a WatchDeployment stream open; an update
  with a newer epoch and an endpoint switches the client to it (a new channel; the old one is
  closed once its calls in flight finish), then the client acknowledges it (AckSwitch). The
  stream is reopened with backoff when it breaks, and renewed every `watch_renew_s` (its
  deadline).
- Adaptive offload (`edge_client.adaptive`): with a local copy of the model
  (`local_model=PATH`, `edge_client.local`), each request goes to the replica or runs on the
  device, by the policy (`remote`, `local`, `fastest`, `remote-then-local`) and the measured
  figures; local inference runs in a worker thread. Under `fastest` and `remote-then-local`
  a request the replica fails (unreachable, refused, past its deadline, no endpoint) is
  served locally at once, so neither a dead broker nor a dead node reaches the application;
  the replica is probed again with backoff. `stats().offload` counts the decisions and their
  reasons; they are reported to the broker every `offload_report_s` (ObservationReport with
  no migration id and its `offload` field).
- An update carrying a migration id opens an observation window (`edge_client.observer`),
  and, with the update's `prepared_ms`, a span reaching back to the broker's decision; when
  the window closes the client reports both gaps (ReportObservation) and keeps them for
  `stats()`.

Every gRPC error becomes an `edge_client.errors.OffloadError` through one table,
`STATUS_ERRORS`; `grpc.RpcError` never leaves this module. With `tls_ca` the broker channel
is TLS and the broker's certificate must chain to that CA; a failed handshake (a broker
certificate that does not) is never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
import numpy as np

from common.brokers import (
    BrokerAddresses,
    leader_hint,
    parse_broker_addresses,
    refused_by_standby,
)
from common.content import file_sha256
from edge_client.adaptive import (
    AdaptiveSettings,
    Decision,
    OffloadChooser,
    OffloadStats,
    Policy,
    Reason,
    Target,
    parse_policy,
)
from edge_client.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidInput,
    NotConnected,
    NotDeployed,
    NotFound,
    OffloadError,
    PermissionDenied,
    ResourceExhausted,
    ServerError,
    Unauthenticated,
    Unavailable,
)
from edge_client.local import LocalModel
from edge_client.observer import DEFAULT_WINDOW_S, ClientStats, GapObserver
from edge_client.rpc.tensors import infer_request, response_arrays
from protos.inference import grpc_service_pb2 as ipb
from protos.inference import grpc_service_pb2_grpc as ipb_grpc
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from protos.offload.v1 import node_pb2 as npb
from runtime.pem import TlsIdentity, read_pem
from runtime.tensors import TensorSpec
from runtime.tls import is_handshake_failure, open_channel

logger = logging.getLogger(__name__)

T = TypeVar("T")

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 64 << 20
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
BROKER_CONNECT_S = 1.0
"""With several brokers, how long a deploy waits to connect to one before trying the next."""
FINAL_REPORT_S = 1.0
"""How long `close` waits for the broker to take the last offload report."""
_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)

STATUS_ERRORS: Mapping[grpc.StatusCode, type[OffloadError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}
"""gRPC status -> our error; any status not listed is a ServerError."""

_RETRIED_ONCE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
"""Inference statuses sent once more on the newest endpoint."""

_FALLS_BACK = (Unavailable, DeadlineExceeded)
"""Remote failures a local model serves instead, under the policies that fall back."""

_PRIORITIES = {
    "best-effort": pb.PRIORITY_CLASS_BEST_EFFORT,
    "best_effort": pb.PRIORITY_CLASS_BEST_EFFORT,
    "standard": pb.PRIORITY_CLASS_STANDARD,
    "critical": pb.PRIORITY_CLASS_CRITICAL,
}


def _mapped(err: grpc.aio.AioRpcError, action: str) -> OffloadError:
    kind = STATUS_ERRORS.get(err.code(), ServerError)
    return kind(f"{action}: {err.code().name} {err.details()}{tls_hint(err)}")


def tls_hint(err: grpc.aio.AioRpcError) -> str:
    """What an UNAVAILABLE that TLS explains means, to append to its message; "" else."""
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return ""
    if is_handshake_failure(err.details()):
        return (
            " (the TLS handshake failed: is the server's certificate signed by the CA given,"
            " and are both valid now?)"
        )
    if "socket closed" in (err.details() or "").lower():
        return " (closed at once: the server may serve TLS while this client speaks plaintext)"
    return ""


@dataclass(frozen=True, slots=True)
class Deployment:
    """A deployment as the client follows it."""

    deployment_id: str
    endpoint: str
    """host:port of the replica of `epoch`; empty while it has none (pending)."""
    token: str
    """The replica's bearer token."""
    epoch: int
    """Incremented at each placement change (re-placement, migration)."""
    node_id: str
    """The node of `epoch`; empty for a moment after a switch, until the client has read
    the deployment again."""
    state: str
    """One of "pending", "starting", "running", "failed"."""
    model_name: str
    endpoint_ca: str = ""
    """PEM of the CA the replica's certificate chains to: inference goes over TLS with it;
    empty: plaintext."""


@dataclass(frozen=True, slots=True)
class OffloadClientStats(ClientStats):
    """`ClientStats` (every request, wherever it ran) and where requests ran, and why."""

    offload: OffloadStats


def _deployment(message: pb.Deployment) -> Deployment:
    return Deployment(
        deployment_id=message.deployment_id,
        endpoint=message.endpoint,
        token=message.token,
        epoch=message.epoch,
        node_id=message.node_id,
        state=message.state,
        model_name=message.model_name,
        endpoint_ca=message.endpoint_ca_pem,
    )


class _Race:
    """The two sides of a raced probe: the first to answer is the application's."""

    def __init__(self) -> None:
        self._claimed = False

    def claim(self) -> bool:
        """True for the first side to answer, False after."""
        first, self._claimed = not self._claimed, True
        return first


class _Replica:
    """One epoch's endpoint: its channel, and the calls in flight on it."""

    def __init__(
        self, endpoint: str, token: str, epoch: int, migration_id: str = "", ca: str = ""
    ) -> None:
        """`ca`: PEM of the CA the replica's certificate chains to (TLS); empty: plaintext."""
        self.endpoint = endpoint
        self.epoch = epoch
        self.migration_id = migration_id
        """The migration that switched to it ("" for the first placement)."""
        self.answered = False
        """Whether it has answered a request yet."""
        self.channel = open_channel(
            endpoint, TlsIdentity(ca=ca.encode()) if ca else None, options=_CHANNEL_OPTIONS
        )
        # Connect now rather than on the first call, so that the first call after a switch
        # finds the connection (usually) up.
        self.channel.get_state(try_to_connect=True)
        self._stub = ipb_grpc.GRPCInferenceServiceStub(self.channel)
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def metadata(self, model_name: str, timeout_s: float) -> ipb.ModelMetadataResponse:
        """ModelMetadata on this replica; AioRpcError as gRPC raises it."""
        return await self._stub.ModelMetadata(
            ipb.ModelMetadataRequest(name=model_name), metadata=self._metadata, timeout=timeout_s
        )

    async def infer(
        self, request: ipb.ModelInferRequest, timeout_s: float
    ) -> ipb.ModelInferResponse:
        """ModelInfer on this replica; AioRpcError as gRPC raises it."""
        self._in_flight += 1
        self.idle.clear()
        try:
            return await self._stub.ModelInfer(request, metadata=self._metadata, timeout=timeout_s)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.idle.set()


class OffloadClient:
    """One edge device's client of the broker, and of the replica of its deployment.

    It follows one deployment at a time: the last one `deploy` or `attach` returned. Use it
    as `async with OffloadClient(...) as client:`, or call `connect()` and `close()`.
    Concurrent `infer` calls are fine; they share one channel per replica.
    """

    def __init__(
        self,
        broker: str | Sequence[str],
        api_key: str,
        *,
        call_timeout_s: float = 10.0,
        deploy_timeout_s: float = 300.0,
        broker_retry_s: float = 30.0,
        switch_wait_s: float = 2.0,
        watch_renew_s: float = 60.0,
        observation_window_s: float = DEFAULT_WINDOW_S,
        local_model: Path | str | None = None,
        policy: str | None = None,
        local_threads: int = 0,
        adaptive: AdaptiveSettings | None = None,
        offload_report_s: float = 10.0,
        tls_ca: Path | str | None = None,
    ) -> None:
        """`broker` is host:port, or several ("A,B" or a sequence) for brokers sharing one state:
        broker calls go to one until it fails, then to the leader a standby named or the next one
        (inference goes to the replica, never through a broker). Timeouts in seconds:
        `call_timeout_s` is the deadline of each inference attempt and each quick broker call;
        `deploy_timeout_s` of an upload or a deploy (which returns once the replica is ready);
        `broker_retry_s` how long an idempotent broker call keeps retrying UNAVAILABLE;
        `switch_wait_s` how long a failed inference waits for a newer endpoint before its retry;
        `watch_renew_s` the deadline of the WatchDeployment stream, which is then reopened at once;
        `observation_window_s` the window after a migration's update (`edge_client.observer`).

        Adaptive offload (`edge_client.adaptive`): `local_model` is an ONNX file the device
        runs itself (the deployment's model, or a smaller one with the same inputs and
        outputs), loaded by `connect()` on the CPU with `local_threads` intra-op threads (0:
        the CPUs this process may use, a container's CPU limit included); `policy` is
        "remote", "local", "fastest" or "remote-then-local" (None: "fastest" with a local
        model, else "remote"); `adaptive` tunes the estimates and
        probes; `offload_report_s` how often the decisions are reported to the broker (0:
        never).

        `tls_ca`: a PEM file of the CA the broker's certificate must chain to; the broker
        channel is TLS with it, plaintext without (None). Blocking (reads the file).

        InvalidInput for an unknown policy, a policy that needs a local model without one,
        a local model file that does not exist, a `tls_ca` that cannot be read or holds no
        PEM certificate (an expired or foreign CA fails the handshake: Unavailable, not
        retried), or a `broker` that is not host:port."""
        try:
            self._brokers = BrokerAddresses(parse_broker_addresses(broker, "broker"))
        except ValueError as err:
            raise InvalidInput(str(err)) from None
        self._tls: TlsIdentity | None = None
        if tls_ca is not None:
            # Read, not parsed: gRPC takes the PEM bytes and checks the chain and its dates
            # at the handshake, whose failure is final (never retried; `tls_hint` says why),
            # so a device needs no `cryptography` for TLS (`pip install edge-offload`).
            try:
                ca = read_pem(Path(tls_ca), "tls_ca")
            except ValueError as err:
                raise InvalidInput(str(err)) from None
            if b"-----BEGIN CERTIFICATE-----" not in ca:
                raise InvalidInput(f"tls_ca {tls_ca} holds no PEM certificate")
            self._tls = TlsIdentity(ca=ca)
        self._metadata = (("authorization", f"Bearer {api_key}"),)
        self._call_timeout_s = call_timeout_s
        self._deploy_timeout_s = deploy_timeout_s
        self._broker_retry_s = broker_retry_s
        self._switch_wait_s = switch_wait_s
        self._watch_renew_s = watch_renew_s
        self._observer = GapObserver(window_s=observation_window_s)
        self._channels: dict[str, grpc.aio.Channel] = {}
        """One per broker address called so far, kept open until `close`."""
        self._connected = False
        self._closing = False
        self._deployment: Deployment | None = None
        self._service: str | None = None
        """The service whose replica `_deployment` is (`use_service`); None for a
        deployment of this client's own."""
        self._replica: _Replica | None = None
        self._retiring: set[_Replica] = set()
        self._watch_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._races: set[asyncio.Task[Any]] = set()
        """The sides of raced probes still running (also in `_tasks`)."""
        # Replaced by a fresh event each time it is set: a waiter wakes on the next one.
        self._switched = asyncio.Event()
        self._succeeded = asyncio.Event()
        self._local_path = Path(local_model) if local_model is not None else None
        if self._local_path is not None and not self._local_path.is_file():
            raise InvalidInput(f"local model {self._local_path}: no such file")
        self._chooser = OffloadChooser(
            parse_policy(policy, self._local_path is not None),
            adaptive,
            self._local_path.name if self._local_path else "",
        )
        self._local_threads = local_threads
        self._local: LocalModel | None = None
        self._offload_report_s = offload_report_s
        self._offload_task: asyncio.Task[None] | None = None
        self._offload_refused = False
        self._session = uuid.uuid4().hex[:16]

    async def connect(self) -> None:
        """Open the broker channel (no call is made: a wrong key shows on the first call)
        and load the local model, if any (InvalidInput when it cannot be loaded).
        Idempotent."""
        if self._closing:
            raise NotConnected("the client is closed; make a new one")
        if self._local_path is not None and self._local is None:
            self._local = await asyncio.to_thread(
                LocalModel.load, self._local_path, self._local_threads
            )
        self._connected = True

    async def close(self) -> None:
        """Stop following (cancels every background task) and close every channel; calls in
        flight end with NotConnected. Idempotent. Observations still open are not reported;
        offload decisions are, once, within `FINAL_REPORT_S`."""
        if not self._closing and self._offload_task is not None and not self._offload_refused:
            deployment = self._deployment
            if deployment is not None:
                with contextlib.suppress(grpc.aio.AioRpcError, OffloadError):
                    summary = self._chooser.summary()
                    await self._send_offload(deployment.deployment_id, summary, FINAL_REPORT_S)
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        replicas = [*self._retiring, *([self._replica] if self._replica else [])]
        for replica in replicas:
            await replica.channel.close()
        self._retiring.clear()
        for channel in self._channels.values():
            await channel.close()

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def probes_settled(self) -> int:
        """Wait until no probe this client sent is still out, and return how many it waited
        for: the losing side of a raced probe (the replica over a slow link) runs on after
        the application has its answer, and its figure is recorded when it comes. For a
        caller that must not change anything under it: a benchmark that changes the
        emulated link between its blocks, a test that reads the figures."""
        waited = 0
        while self._races:
            out = set(self._races)
            waited += len(out)
            await asyncio.wait(out)
        return waited

    @property
    def deployment(self) -> Deployment | None:
        """The deployment followed now, at its current epoch; None before deploy/attach."""
        return self._deployment

    def stats(self) -> OffloadClientStats:
        """Requests, failures, latency percentiles (of every request, remote or local), the
        closed migration observations, and where requests ran and why (`offload`)."""
        base = self._observer.stats()
        return OffloadClientStats(
            **{f.name: getattr(base, f.name) for f in fields(base)},
            offload=self._chooser.summary(),
        )

    # --- broker calls ------------------------------------------------------------------

    @property
    def broker(self) -> str:
        """The broker address called now."""
        return self._brokers.current

    def _channel(self) -> grpc.aio.Channel:
        """The current broker's channel; NotConnected before connect() and after close()."""
        if not self._connected or self._closing:
            raise NotConnected("the client is not connected: call connect() (or use async with)")
        address = self._brokers.current
        if address not in self._channels:
            self._channels[address] = open_channel(address, self._tls, options=_CHANNEL_OPTIONS)
        return self._channels[address]

    def _broker(self) -> pb_grpc.EdgeBrokerStub:
        """The current broker's stub; NotConnected before connect() and after close()."""
        return pb_grpc.EdgeBrokerStub(self._channel())

    def _broker_failed(self, err: grpc.aio.AioRpcError | None) -> None:
        """A broker call failed UNAVAILABLE (`err`; None: the broker could not be reached):
        the next call goes to the leader it named, or to the next broker address."""
        before = self._brokers.current
        hint = leader_hint(err.trailing_metadata()) if err is not None else None
        after = self._brokers.failed(hint)
        if after != before:
            logger.info("broker %s unavailable; calling broker %s", before, after)

    async def _retrying(
        self, action: str, call: Callable[[pb_grpc.EdgeBrokerStub], Awaitable[T]]
    ) -> T:
        """`call(stub)` until it succeeds, retrying UNAVAILABLE with backoff for up to
        `broker_retry_s`, each retry on the broker `_broker_failed` picks (a standby's leader
        at once, without backoff); every other status (and the last UNAVAILABLE) is raised
        mapped."""
        give_up = time.monotonic() + self._broker_retry_s
        backoff = BACKOFF_MIN_S
        while True:
            try:
                return await call(self._broker())
            except grpc.aio.AioRpcError as err:
                if (
                    err.code() != grpc.StatusCode.UNAVAILABLE
                    or is_handshake_failure(err.details())
                    or time.monotonic() > give_up
                ):
                    raise _mapped(err, action) from err
                logger.warning(
                    "broker %s unavailable (%s); retrying %s in %.1fs",
                    self.broker,
                    err.details(),
                    action,
                    backoff,
                )
                self._broker_failed(err)
                if leader_hint(err.trailing_metadata()) is not None:
                    continue  # a standby named the leader: call it now
            await asyncio.sleep(backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def upload_model(self, path: Path) -> str:
        """Upload an ONNX model (streamed in 1 MiB chunks) and return its sha256, which the
        client computes. Idempotent: content the broker already has is not stored twice
        (logged as deduplicated). InvalidInput when the broker refuses the file (not ONNX);
        OSError when it cannot be read here."""
        self._broker()  # connected?
        sha = await asyncio.to_thread(file_sha256, path, CHUNK_BYTES)

        async def chunks() -> AsyncIterator[npb.ModelChunk]:
            stream = await asyncio.to_thread(path.open, "rb")
            try:
                first = True
                while data := await asyncio.to_thread(stream.read, CHUNK_BYTES):
                    if first:
                        yield npb.ModelChunk(sha256=sha, name=path.stem, data=data)
                        first = False
                    else:
                        yield npb.ModelChunk(data=data)
            finally:
                stream.close()

        reply = await self._retrying(
            f"upload {path.name}",
            lambda stub: stub.UploadModel(
                chunks(), metadata=self._metadata, timeout=self._deploy_timeout_s
            ),
        )
        logger.info(
            "model %s (%s, %d bytes) %s",
            reply.sha256[:12],
            path.name,
            reply.size_bytes,
            "was already at the broker (deduplicated)" if reply.deduplicated else "uploaded",
        )
        return str(reply.sha256)

    async def deploy(
        self,
        model_sha256: str,
        model_name: str,
        *,
        gpus: int = 0,
        gpu_memory_mib: int = 0,
        p2p: bool = False,
        cpus: float = 0,
        memory_mib: int = 0,
        priority: str = "standard",
        latency_slo_ms: float = 0,
        cpus_min: float = 0,
        cpus_max: float = 0,
        site: str,
    ) -> Deployment:
        """Deploy an uploaded model for a client at `site`; returns once the replica is
        ready, and follows it from then on. When the first start fails for a reason that is
        not the replica's (its node lost or unreachable mid-start), the broker answers the
        deployment pending and places it again: this waits for that placement too, and
        returns the deployment still pending only when `deploy_timeout_s` ran out first
        (it stays followed). `priority` is "best-effort", "standard" or
        "critical"; `gpu_memory_mib` is per GPU (0: whole GPUs). Not retried (a retry could
        place a second deployment): it waits for an unreachable broker within
        `deploy_timeout_s`. NotFound when the model was not uploaded; ResourceExhausted when
        nothing fits now; FailedPrecondition when nothing ever could; InvalidInput for an
        unknown site or priority. `cpus_min`/`cpus_max`: the CPU floor and ceiling a node's
        resource manager keeps the replica within while it re-divides the node's CPU (0: half
        of `cpus`, and the node's cores)."""
        self._broker()  # connected?
        if priority not in _PRIORITIES:
            raise InvalidInput(
                f"priority {priority!r} is unknown; use best-effort, standard or critical"
            )
        request = pb.DeployRequest(
            model_sha256=model_sha256,
            model_name=model_name,
            gpus=gpus,
            gpu_memory_mib=gpu_memory_mib,
            p2p_required=p2p,
            cpus=cpus,
            memory_mib=memory_mib,
            priority=_PRIORITIES[priority],
            latency_slo_ms=latency_slo_ms,
            cpus_min=cpus_min,
            cpus_max=cpus_max,
            site=site,
        )
        give_up = time.monotonic() + self._deploy_timeout_s
        reply = await self._deploy_once(request, f"deploy {model_name}", give_up)
        deployment = _deployment(reply)
        await self._follow(deployment)
        if not deployment.endpoint:
            deployment = await self._placed_again(deployment, reply.reason, give_up)
        logger.info(
            "deployment=%s epoch=%d %s at %s on node=%s",
            deployment.deployment_id,
            deployment.epoch,
            deployment.state,
            deployment.endpoint or "-",
            deployment.node_id or "-",
        )
        await self._offload_to(deployment)
        return deployment

    async def _placed_again(
        self, deployment: Deployment, reason: str, give_up: float
    ) -> Deployment:
        """The followed `deployment`, answered pending, once its watch switched to a replica
        (read back from the broker), or as it is at `give_up` (monotonic)."""
        logger.warning(
            "deployment=%s is %s (%s): the broker places it again; waiting up to %.0f s",
            deployment.deployment_id,
            deployment.state,
            reason,
            max(0.0, give_up - time.monotonic()),
        )
        if self._replica is None:  # a switch sets it, and nothing but `_follow` unsets it
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, give_up - time.monotonic())):
                    await self._switched.wait()
        if self._replica is None:
            return self._deployment or deployment
        placed = await self._get_deployment(deployment.deployment_id)
        current = self._deployment  # after the call: a later switch is kept
        if current is not None and current.epoch == placed.epoch:
            self._deployment = placed  # the node's name, which a switch does not carry
        return placed

    async def _get_deployment(self, deployment_id: str) -> Deployment:
        reply = await self._retrying(
            f"get deployment {deployment_id}",
            lambda stub: stub.GetDeployment(
                pb.GetDeploymentRequest(deployment_id=deployment_id),
                metadata=self._metadata,
                timeout=self._call_timeout_s,
            ),
        )
        return _deployment(reply)

    async def _deploy_once(
        self, request: pb.DeployRequest, action: str, give_up: float
    ) -> pb.Deployment:
        """Send `request` to the leading broker once: it goes only over a connected channel
        (a broker that cannot be reached within `BROKER_CONNECT_S`, when there are several,
        is passed over for the next), and is sent again only when a standby refused it (it
        did nothing), until `give_up` (monotonic). Any other failure is raised mapped: the
        deploy may have been placed."""
        several = len(self._brokers.all) > 1
        while True:
            left = give_up - time.monotonic()
            channel = self._channel()
            try:
                await asyncio.wait_for(
                    channel.channel_ready(), min(left, BROKER_CONNECT_S) if several else left
                )
            except TimeoutError:
                if time.monotonic() >= give_up:
                    raise DeadlineExceeded(
                        f"{action}: no broker reachable within {self._deploy_timeout_s:g} s"
                    ) from None
                self._broker_failed(None)
                continue
            try:
                return await pb_grpc.EdgeBrokerStub(channel).Deploy(
                    request, metadata=self._metadata, timeout=max(0.0, left)
                )
            except grpc.aio.AioRpcError as err:
                if not (
                    err.code() == grpc.StatusCode.UNAVAILABLE
                    and refused_by_standby(err.details())
                    and time.monotonic() < give_up
                ):
                    raise _mapped(err, action) from err
                hinted = leader_hint(err.trailing_metadata()) is not None
                self._broker_failed(err)
            if not hinted:
                await asyncio.sleep(BACKOFF_MIN_S)

    async def attach(self, deployment_id: str) -> Deployment:
        """Follow an existing deployment of this client (as deploy does for a new one).
        NotFound when there is none (or it is another client's)."""
        deployment = await self._get_deployment(deployment_id)
        await self._follow(deployment)
        await self._offload_to(deployment)
        return deployment

    async def delete(self, deployment_id: str) -> bool:
        """Delete one of this client's deployments: the broker stops its replica, which frees
        its GPUs, and frees its place in the client's quota (`--max-deployments-per-client`);
        a pending or failed deployment is only marked deleted. When it is the deployment this
        client follows, the client stops following it (`infer` raises NotDeployed until the
        next deploy or attach). True when this call deleted it; False when it was deleted
        already (deleting twice is fine).

        Idempotent, so retried while the broker answers UNAVAILABLE, as the other idempotent
        calls are; a retry after a delete the broker did but could not answer returns False.
        Its deadline is `deploy_timeout_s`: the broker drains the replica before it stops it,
        and finishes the delete even when the call is abandoned. NotFound for an id there
        never was; PermissionDenied for another client's deployment; FailedPrecondition while
        it is being migrated or deleted by another call (the same call succeeds once that has
        finished)."""
        reply = await self._retrying(
            f"delete deployment {deployment_id}",
            lambda stub: stub.DeleteDeployment(
                pb.DeleteDeploymentRequest(deployment_id=deployment_id),
                metadata=self._metadata,
                timeout=self._deploy_timeout_s,
            ),
        )
        current = self._deployment
        if current is not None and current.deployment_id == deployment_id:
            await self._unfollow()
        if reply.already_deleted:
            logger.info("deployment=%s was deleted already", deployment_id)
        else:
            logger.info("deployment=%s deleted", deployment_id)
        return not reply.already_deleted

    async def create_service(
        self,
        name: str,
        model_sha256: str,
        model_name: str,
        *,
        gpus: int = 0,
        gpu_memory_mib: int = 0,
        cpus: float = 0,
        memory_mib: int = 0,
        clients: Sequence[str] = (),
        any_client: bool = False,
        min_replicas_per_site: int = 0,
        max_replicas: int = 0,
        latency_slo_ms: float = 0,
        max_rps_per_client: float = 0,
    ) -> pb.Service:
        """Publish an uploaded model as service `name` for many clients, owned by this one:
        `clients` (their client ids) may use it besides this client, or `any_client`;
        `min_replicas_per_site` replicas are kept at every site (0: started on demand), at
        most `max_replicas` in all (0: the broker's default, 16); a client is put on a
        replica at most `latency_slo_ms` from its site, else one is started there (0: any
        replica in reach); `max_rps_per_client` limits each client's calls at a replica (0:
        no limit). Returns once the first replicas run. Not retried (it may have been
        created). AlreadyExists for a taken name; NotFound when the model was not uploaded;
        InvalidInput for a bad name or field."""
        spec = pb.ServiceSpec(
            model_sha256=model_sha256,
            model_name=model_name,
            gpus=gpus,
            gpu_memory_mib=gpu_memory_mib,
            cpus=cpus,
            memory_mib=memory_mib,
            clients=list(clients),
            any_client=any_client,
            min_replicas_per_site=min_replicas_per_site,
            max_replicas=max_replicas,
            latency_slo_ms=latency_slo_ms,
            max_rps_per_client=max_rps_per_client,
        )
        try:
            return await self._broker().CreateService(
                pb.CreateServiceRequest(name=name, spec=spec),
                metadata=self._metadata,
                timeout=self._deploy_timeout_s,
            )
        except grpc.aio.AioRpcError as err:
            raise _mapped(err, f"create service {name}") from err

    async def get_service(self, name: str) -> pb.Service:
        """A service this client owns or may use, with its replicas; NotFound otherwise."""
        return await self._retrying(
            f"get service {name}",
            lambda stub: stub.GetService(
                pb.GetServiceRequest(name=name),
                metadata=self._metadata,
                timeout=self._call_timeout_s,
            ),
        )

    async def list_services(self) -> list[pb.Service]:
        """The services this client owns or may use."""
        reply = await self._retrying(
            "list services",
            lambda stub: stub.ListServices(
                pb.ListServicesRequest(), metadata=self._metadata, timeout=self._call_timeout_s
            ),
        )
        return list(reply.services)

    async def delete_service(self, name: str) -> None:
        """Delete a service this client owns: its replicas stop, and every client's
        assignment and token with them. NotFound when there is none (or it was deleted);
        PermissionDenied for one this client may use but does not own."""
        await self._retrying(
            f"delete service {name}",
            lambda stub: stub.DeleteService(
                pb.DeleteServiceRequest(name=name),
                metadata=self._metadata,
                timeout=self._deploy_timeout_s,
            ),
        )

    async def use_service(self, name: str, *, site: str, priority: str = "standard") -> Deployment:
        """Put this client on the best replica of service `name` for a client at `site` (the
        broker starts one there when none is in reach) and send inference there from now
        on, with a token of this client's own and calls of class `priority` ("best-effort",
        "standard" or "critical"); returns the replica as a Deployment (`node_id`: the node
        that serves this client). Each call gives a new token, and the previous one stops
        working. The client follows its assignment from then on (WatchService): a replica
        placed again or moved, and a switch to another site's replica after
        `report_location`, take its calls there. NotFound for a service this client cannot
        see; PermissionDenied for one that does not allow it; ResourceExhausted when no
        replica runs and none can start now; InvalidInput for an unknown site or
        priority."""
        self._broker()  # connected?
        if priority not in _PRIORITIES:
            raise InvalidInput(
                f"priority {priority!r} is unknown; use best-effort, standard or critical"
            )
        request = pb.UseServiceRequest(name=name, site=site, priority=_PRIORITIES[priority])
        reply = await self._retrying(
            f"use service {name}",
            lambda stub: stub.UseService(
                request, metadata=self._metadata, timeout=self._deploy_timeout_s
            ),
        )
        deployment = Deployment(
            deployment_id=reply.deployment_id,
            endpoint=reply.endpoint,
            token=reply.token,
            epoch=reply.epoch,
            node_id=reply.node_id,
            state="running",
            model_name=reply.model_name,
            endpoint_ca=reply.endpoint_ca_pem,
        )
        await self._follow(deployment, service=name)
        logger.info(
            "service=%s: on deployment=%s epoch=%d at %s on node=%s (%s)",
            name,
            deployment.deployment_id,
            deployment.epoch,
            deployment.endpoint,
            deployment.node_id,
            reply.reason,
        )
        return deployment

    async def report_location(self, site: str) -> str | None:
        """Tell the broker where this client is now; the id of the migration it started, or
        None when it started none. InvalidInput for an unknown site."""
        self._broker()  # connected?
        reported_at = time.monotonic()
        reply = await self._retrying(
            f"report location {site}",
            lambda stub: stub.ReportLocation(
                pb.ReportLocationRequest(site=site),
                metadata=self._metadata,
                timeout=self._call_timeout_s,
            ),
        )
        migration_id = str(reply.migration_id) or None
        if migration_id is not None:
            self._observer.reported(migration_id, reported_at)
        logger.info("location site=%s reported; migration=%s", site, migration_id)
        return migration_id

    # --- adaptive offload --------------------------------------------------------------

    async def _offload_to(self, deployment: Deployment) -> None:
        """With a local model: check that it can stand in for the deployment's (the
        replica's ModelMetadata; skipped with a warning when the replica does not answer),
        and report the decisions periodically. InvalidInput when it cannot stand in: the
        local model is then dropped and every request goes to the replica."""
        if self._local is None:
            return
        if self._offload_task is not None:
            self._offload_task.cancel()
            await asyncio.gather(self._offload_task, return_exceptions=True)
            self._offload_task = None
        replica = self._replica
        if replica is not None:
            try:
                metadata = await replica.metadata(deployment.model_name, self._call_timeout_s)
            except grpc.aio.AioRpcError as err:
                logger.warning(
                    "deployment=%s: the local model is not checked against the replica's "
                    "(ModelMetadata: %s %s)",
                    deployment.deployment_id,
                    err.code().name,
                    err.details(),
                )
            else:
                try:
                    self._local.check_stands_in_for(
                        _specs(metadata.inputs),
                        _specs(metadata.outputs),
                        f"deployment {deployment.deployment_id} ({deployment.model_name})",
                    )
                except InvalidInput as err:
                    self._local = None
                    self._chooser = OffloadChooser(Policy.REMOTE, self._chooser.settings)
                    raise InvalidInput(
                        f"{err}. The deployment is followed; every request goes to its replica"
                    ) from err
        if self._offload_report_s > 0:
            self._offload_task = self._spawn(
                self._report_offload(deployment.deployment_id),
                f"offload-report-{deployment.deployment_id}",
            )

    async def _report_offload(self, deployment_id: str) -> None:
        """Every `offload_report_s`, when anything changed (counts, estimates, reachability),
        send the decisions to the broker (one attempt each: the next period sends newer
        figures; `close` sends the last ones). A broker that refuses them (INVALID_ARGUMENT,
        UNIMPLEMENTED: it predates offload reports) is not asked again."""
        sent: OffloadStats | None = None
        while True:
            await asyncio.sleep(self._offload_report_s)
            summary = self._chooser.summary()
            if summary == sent:
                continue
            try:
                await self._send_offload(deployment_id, summary, self._call_timeout_s)
            except grpc.aio.AioRpcError as err:
                if err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED):
                    logger.warning(
                        "deployment=%s: the broker refuses offload reports (%s %s); they stay "
                        "in stats() only",
                        deployment_id,
                        err.code().name,
                        err.details(),
                    )
                    self._offload_refused = True
                    return
                logger.debug("deployment=%s: offload report not sent: %s", deployment_id, err)
                continue
            sent = summary

    async def _send_offload(
        self, deployment_id: str, summary: OffloadStats, timeout_s: float
    ) -> None:
        report = pb.ObservationReport(
            deployment_id=deployment_id, offload=_offload_message(self._session, summary)
        )
        await self._broker().ReportObservation(report, metadata=self._metadata, timeout=timeout_s)

    # --- following the deployment ------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    async def _follow(self, deployment: Deployment, service: str | None = None) -> None:
        """Make `deployment` the one inference goes to, and watch its placement (for a
        `service`'s replica: this client's assignment on the service)."""
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
        old = self._replica
        self._deployment = deployment
        self._service = service
        self._replica = (
            _Replica(
                deployment.endpoint,
                deployment.token,
                deployment.epoch,
                ca=deployment.endpoint_ca,
            )
            if deployment.endpoint
            else None
        )
        if old is not None:
            self._retire(old)
        self._watch_task = self._spawn(
            self._watch(deployment.deployment_id, service), f"watch-{deployment.deployment_id}"
        )

    async def _unfollow(self) -> None:
        """Follow no deployment: stop watching it, stop reporting offload decisions for it,
        and close its replica's channel once its calls in flight finish."""
        for task in (self._watch_task, self._offload_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._watch_task = self._offload_task = None
        if self._replica is not None:
            self._retire(self._replica)
        self._deployment = self._replica = self._service = None

    async def _watch(self, deployment_id: str, service: str | None = None) -> None:
        """Apply the deployment's placement updates (a `service`'s: this client's
        assignment's) until it is deleted, the broker refuses the stream for good, or the
        client closes."""
        backoff = BACKOFF_MIN_S
        broken = False
        while True:
            call = (
                self._broker().WatchService(
                    pb.WatchServiceRequest(name=service),
                    metadata=self._metadata,
                    timeout=self._watch_renew_s,
                )
                if service is not None
                else self._broker().WatchDeployment(
                    pb.WatchDeploymentRequest(deployment_id=deployment_id),
                    metadata=self._metadata,
                    timeout=self._watch_renew_s,
                )
            )
            try:
                async for update in call:
                    if broken:
                        logger.info(
                            "watch deployment=%s reopened (epoch=%d)", deployment_id, update.epoch
                        )
                        broken = False
                    backoff = BACKOFF_MIN_S
                    self._apply(update)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue  # the stream's own deadline: renew it
                if err.code() not in _RETRIED_ONCE:
                    logger.error(
                        "watch deployment=%s refused (%s %s): no more placement updates",
                        deployment_id,
                        err.code().name,
                        err.details(),
                    )
                    return
                logger.warning(
                    "watch deployment=%s broke (%s %s); reopening in %.1fs",
                    deployment_id,
                    err.code().name,
                    err.details(),
                    backoff,
                )
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    self._broker_failed(err)
                broken = True
                await asyncio.sleep(backoff)
                backoff = min(BACKOFF_MAX_S, backoff * 2)
                continue
            finally:
                call.cancel()
            logger.warning("deployment=%s was deleted: no more placement updates", deployment_id)
            return

    def _apply(self, update: pb.PlacementUpdate) -> None:
        """One placement update: observe a migration, switch to a newer epoch's endpoint."""
        current = self._deployment
        assert current is not None
        # How long the broker prepared the migration: the span window opens that long ago
        # (the observer ignores a value that is not a finite non-negative number).
        prepared_s = update.prepared_ms / 1000 if update.HasField("prepared_ms") else None
        if update.migration_id and self._observer.migration(
            current.deployment_id, update.migration_id, time.monotonic(), prepared_s
        ):
            self._spawn(
                self._report_observation(update.migration_id),
                f"observe-{update.migration_id}",
            )
        if update.epoch > current.epoch and update.endpoint:
            self._switch(update)
        elif update.epoch >= current.epoch:
            state = update.state or current.state
            self._deployment = replace(current, state=state)
            if update.epoch > current.epoch or state != current.state:
                logger.info(
                    "deployment=%s epoch=%d %s (%s); inference stays on epoch=%d",
                    current.deployment_id,
                    update.epoch,
                    state,
                    update.reason,
                    current.epoch,
                )

    def _switch(self, update: pb.PlacementUpdate) -> None:
        """Send new calls to the update's endpoint from now on; acknowledge it; close the
        old channel once its calls in flight finish. Synchronous: no call can start on the
        old replica after this returns."""
        current = self._deployment
        assert current is not None
        old = self._replica
        token = update.token or current.token  # a service's: the client's own stays
        self._replica = _Replica(
            update.endpoint,
            token,
            update.epoch,
            update.migration_id,
            update.endpoint_ca_pem,
        )
        self._deployment = replace(
            current,
            deployment_id=update.deployment_id or current.deployment_id,
            endpoint=update.endpoint,
            endpoint_ca=update.endpoint_ca_pem,
            token=token,
            epoch=update.epoch,
            node_id=update.node_id,
            state=update.state or "running",
        )
        logger.info(
            "deployment=%s switched to epoch=%d at %s (%s, migration=%s)",
            current.deployment_id,
            update.epoch,
            update.endpoint,
            update.reason,
            update.migration_id or "-",
        )
        self._switched.set()
        self._switched = asyncio.Event()
        if old is not None:
            self._retire(old)
        if self._service is None:  # a service's replica is its owner's to acknowledge
            self._spawn(
                self._acknowledge(current.deployment_id, update.epoch),
                f"ack-{current.deployment_id}-{update.epoch}",
            )

    def _retire(self, replica: _Replica) -> None:
        self._retiring.add(replica)

        async def drain() -> None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._call_timeout_s):
                    await replica.idle.wait()
            self._retiring.discard(replica)
            await replica.channel.close()

        self._spawn(drain(), f"retire-{replica.endpoint}-{replica.epoch}")

    async def _acknowledge(self, deployment_id: str, epoch: int) -> None:
        """AckSwitch (the broker may drain the old replica now), then read the deployment
        again for the new node id. Failures are logged: without an ack the broker drains on
        its own timeout."""
        try:
            await self._retrying(
                f"acknowledge epoch {epoch}",
                lambda stub: stub.AckSwitch(
                    pb.AckSwitchRequest(deployment_id=deployment_id, epoch=epoch),
                    metadata=self._metadata,
                    timeout=self._call_timeout_s,
                ),
            )
        except OffloadError as err:
            logger.warning("deployment=%s epoch=%d: %s", deployment_id, epoch, err)
        try:
            reply = await self._retrying(
                f"get deployment {deployment_id}",
                lambda stub: stub.GetDeployment(
                    pb.GetDeploymentRequest(deployment_id=deployment_id),
                    metadata=self._metadata,
                    timeout=self._call_timeout_s,
                ),
            )
        except OffloadError as err:
            logger.warning("deployment=%s epoch=%d: %s", deployment_id, epoch, err)
            return
        current = self._deployment
        if current is not None and (current.deployment_id, current.epoch) == (
            deployment_id,
            reply.epoch,
        ):
            self._deployment = replace(current, node_id=reply.node_id)

    async def _report_observation(self, migration_id: str) -> None:
        """Wait for the migration's window to close, then report it to the broker."""
        await asyncio.sleep(self._observer.window_s)
        while True:
            succeeded = self._succeeded
            observation = self._observer.close(migration_id, time.monotonic())
            if observation is not None:
                break
            await succeeded.wait()
        logger.info(
            "deployment=%s migration=%s observed: longest gap %.1f ms across the switch, "
            "%s over the whole migration, %d of %d request(s) failed, %d retried",
            observation.deployment_id,
            migration_id,
            observation.longest_gap_ms,
            "-" if observation.span_gap_ms is None else f"{observation.span_gap_ms:.1f} ms",
            observation.failed_requests,
            observation.requests,
            observation.retried_requests,
        )
        report = pb.ObservationReport(
            deployment_id=observation.deployment_id,
            migration_id=migration_id,
            longest_gap_ms=observation.longest_gap_ms,
            failed_requests=observation.failed_requests,
            requests=observation.requests,
            span_gap_ms=observation.span_gap_ms,
        )
        try:
            await self._retrying(
                f"report the observation of migration {migration_id}",
                lambda stub: stub.ReportObservation(
                    report, metadata=self._metadata, timeout=self._call_timeout_s
                ),
            )
        except OffloadError as err:
            logger.warning("migration=%s: %s (kept in stats() only)", migration_id, err)

    # --- inference ---------------------------------------------------------------------

    async def _newest_replica(self, failed: _Replica | None) -> _Replica:
        """The replica to send to now: when it is still `failed` (or there is none), wait up
        to `switch_wait_s` for a switch first. Unavailable when there is no endpoint."""
        if self._replica is failed:
            switched = self._switched
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._switch_wait_s):
                    await switched.wait()
        if self._replica is None:
            deployment = self._deployment
            assert deployment is not None
            raise Unavailable(
                f"deployment {deployment.deployment_id} has no endpoint now "
                f"(epoch {deployment.epoch}, {deployment.state})"
            )
        return self._replica

    async def infer(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] = ()
    ) -> dict[str, np.ndarray]:
        """Run the deployment's model on `inputs` (by input name) and return the outputs by
        name (`outputs` empty: all of them), on the replica or on the local model as the
        policy decides (`stats().offload` says where and why). Idempotent, so a remote call
        that fails with UNAVAILABLE or CANCELLED (not by us) is sent once more, on the newest
        endpoint (waiting up to `switch_wait_s` for one when the endpoint has not changed).
        Under `fastest` and `remote-then-local` a request the replica fails (unreachable,
        refused, past its deadline, no endpoint, no deployment yet) is served by the local
        model at once instead, with no wait; a probe of a replica that is down or far slower
        than the local model runs beside it and the first answer is returned
        (`edge_client.adaptive`). Each remote attempt has the deadline
        `call_timeout_s`. Raises an OffloadError: InvalidInput for tensors the model refuses,
        Unavailable when the retry failed too (and nothing falls back), NotDeployed before
        deploy or attach (unless the request runs locally)."""
        self._broker()  # connected?
        started = time.monotonic()
        decision = self._chooser.choose(started)
        deployment = self._deployment
        request = None
        if deployment is not None and decision.target == Target.REMOTE:
            # Only for the replica: the local model takes the arrays as they are.
            try:
                request = infer_request(deployment.model_name, inputs, outputs)
            except ValueError as err:
                if decision.local_reason is not None:
                    self._chooser.race_over()  # this request's race: it never started
                self._chooser.remote_abandoned()
                raise InvalidInput(f"inputs cannot be encoded: {err}") from err
        if decision.local_reason is not None and self._local is not None:
            local_reason = decision.local_reason
            return await self._race(decision, local_reason, request, inputs, outputs, started)
        if decision.target == Target.REMOTE:
            fallback = self._chooser.can_fall_back and self._local is not None
            try:
                return await self._infer_remote(decision, request, started, fallback)
            except _FALLS_BACK as err:
                if not fallback or self._closing:
                    raise
                logger.debug("%s; served by the local model", err)
        return await self._infer_local(decision, inputs, outputs, started)

    async def _race(
        self,
        decision: Decision,
        local_reason: Reason,
        request: ipb.ModelInferRequest | None,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        started: float,
    ) -> dict[str, np.ndarray]:
        """A probe of the replica raced against the local model (`Decision.local_reason`):
        both run at once and the first answer is the application's. Neither side is
        cancelled when the other answers: the later one's figure is recorded (uncounted)
        when it comes; `close` cancels what is left. Raises the local side's error when both
        fail (the replica's when only it could say why)."""
        race = _Race()
        remote = self._racer(self._infer_remote(decision, request, started, True, race))
        remote.add_done_callback(lambda _: self._chooser.race_over())
        local_decision = Decision(Target.LOCAL, local_reason)
        local = self._racer(self._infer_local(local_decision, inputs, outputs, started, race))
        errors: dict[asyncio.Task[Any], BaseException] = {}
        pending: set[asyncio.Task[Any]] = {local, remote}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.cancelled():
                    errors[task] = NotConnected("the client was closed during the call")
                elif (error := task.exception()) is not None:
                    errors[task] = error
                else:
                    answer: dict[str, np.ndarray] = task.result()
                    return answer
        self._observer.record(started, time.monotonic(), ok=False)
        raise errors.get(local) or errors[remote]

    def _racer(
        self, coro: Coroutine[Any, Any, dict[str, np.ndarray]]
    ) -> asyncio.Task[dict[str, np.ndarray]]:
        """One side of a race, owned by the client (`close` cancels it); its error is the
        race's to raise, or expected (the losing side of a probe), so it is not logged."""
        task = asyncio.create_task(coro, name="offload-race")
        self._tasks.add(task)
        self._races.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._races.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _infer_remote(
        self,
        decision: Decision,
        request: ipb.ModelInferRequest | None,
        started: float,
        fallback: bool,
        race: _Race | None = None,
    ) -> dict[str, np.ndarray]:
        """One request on the replica (and its one retry). With `fallback` a failure the
        local model can serve is raised without being recorded (the local answer will be),
        and the retry goes only to a newer endpoint that is already there. In a `race` it
        records nothing the application sees unless its answer comes first."""
        answered = False
        retried = False
        try:
            if request is None:
                raise NotDeployed("no deployment to infer on: call deploy() or attach() first")
            timeout_s = self._call_timeout_s
            if self._chooser.probing_down_remote:
                timeout_s = min(timeout_s, self._chooser.settings.probe_timeout_s)
            replica = self._replica
            if replica is None and fallback:
                raise Unavailable("the deployment has no endpoint now")
            replica = replica or await self._newest_replica(None)
            try:
                response = await replica.infer(request, timeout_s)
            except grpc.aio.AioRpcError as err:
                newer = self._replica is not None and self._replica is not replica
                if err.code() not in _RETRIED_ONCE or self._closing or (fallback and not newer):
                    raise self._infer_error(err, replica) from err
                retried = True
                replica = await self._newest_replica(replica)
                logger.debug(
                    "%s; retrying on epoch=%d at %s",
                    err.code().name,
                    replica.epoch,
                    replica.endpoint,
                )
                try:
                    response = await replica.infer(request, timeout_s)
                except grpc.aio.AioRpcError as again:
                    raise self._infer_error(again, replica) from again
            try:
                arrays = response_arrays(response)
            except ValueError as err:
                raise InvalidInput(f"outputs cannot be decoded: {err}") from err
        except OffloadError as err:
            answered = True
            if isinstance(err, (*_FALLS_BACK, NotDeployed)):
                self._chooser.remote_failed(time.monotonic())
            else:
                self._chooser.remote_abandoned()
            # A request with no deployment to go to was never sent: it is not counted.
            served_locally = fallback and isinstance(err, (*_FALLS_BACK, NotDeployed))
            if not (served_locally or isinstance(err, NotDeployed) or race):
                self._observer.record(started, time.monotonic(), ok=False, retried=retried)
            raise
        finally:
            if not answered:
                self._chooser.remote_abandoned()
        finished = time.monotonic()
        counted = race is None or race.claim()
        self._chooser.remote_succeeded(decision, finished - started, counted)
        if counted:
            self._observer.record(started, finished, ok=True, retried=retried)
        if not replica.answered:
            replica.answered = True
            if replica.migration_id:
                self._observer.served(replica.migration_id, finished)
        self._succeeded.set()
        self._succeeded = asyncio.Event()
        return arrays

    async def _infer_local(
        self,
        decision: Decision,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        started: float,
        race: _Race | None = None,
    ) -> dict[str, np.ndarray]:
        """One request on the local model, in a worker thread (in a `race`, as
        `_infer_remote`)."""
        local = self._local
        assert local is not None  # the chooser picks local only with a local model
        begun = time.monotonic()
        try:
            arrays = await asyncio.to_thread(local.run, inputs, outputs)
        except OffloadError:
            if race is None:
                self._observer.record(started, time.monotonic(), ok=False)
            raise
        finished = time.monotonic()
        counted = race is None or race.claim()
        self._chooser.local_succeeded(decision, finished - begun, counted)
        if counted:
            self._observer.record(started, finished, ok=True)
        self._succeeded.set()
        self._succeeded = asyncio.Event()
        return arrays

    def _infer_error(self, err: grpc.aio.AioRpcError, replica: _Replica) -> OffloadError:
        if self._closing:
            return NotConnected("the client was closed during the call")
        return _mapped(err, f"infer on epoch {replica.epoch} at {replica.endpoint}")


def _specs(tensors: Sequence[ipb.ModelMetadataResponse.TensorMetadata]) -> list[TensorSpec]:
    return [
        TensorSpec(t.name, t.datatype, tuple(t.shape), (None,) * len(t.shape)) for t in tensors
    ]


def _offload_message(session: str, summary: OffloadStats) -> pb.OffloadSummary:
    return pb.OffloadSummary(
        session=session,
        policy=summary.policy.value,
        local_model=summary.local_model,
        decisions=[
            pb.OffloadDecisionCount(
                target=d.target.value, reason=d.reason.value, requests=d.requests
            )
            for d in summary.decisions
        ],
        remote_requests=summary.remote_requests,
        local_requests=summary.local_requests,
        fallbacks=summary.fallbacks,
        remote_estimate_ms=summary.remote_estimate_ms or 0.0,
        local_estimate_ms=summary.local_estimate_ms or 0.0,
        remote_reachable=summary.remote_reachable,
    )


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.error("%s failed", task.get_name(), exc_info=error)


class SyncOffloadClient:
    """`OffloadClient` for scripts: the same methods, blocking. The client runs on a
    private event loop in a background thread; call `close()` (or use `with`) to stop it.
    Methods may be called from any thread, one at a time or concurrently."""

    def __init__(self, broker: str, api_key: str, **options: Any) -> None:
        """`options` are OffloadClient's keyword arguments. Connects (no broker call)."""
        self._client = OffloadClient(broker, api_key, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="offload-client", daemon=True
        )
        self._thread.start()
        self._run(self._client.connect())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise NotConnected("the client is closed; make a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Close the client and stop its thread. Idempotent."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close())
            self._run(self._loop.shutdown_asyncgens())
            self._run(self._loop.shutdown_default_executor())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def deployment(self) -> Deployment | None:
        return self._client.deployment

    def stats(self) -> OffloadClientStats:
        return self._run(self._stats())

    async def _stats(self) -> OffloadClientStats:
        return self._client.stats()

    def upload_model(self, path: Path) -> str:
        return self._run(self._client.upload_model(path))

    def deploy(
        self,
        model_sha256: str,
        model_name: str,
        *,
        gpus: int = 0,
        gpu_memory_mib: int = 0,
        p2p: bool = False,
        cpus: float = 0,
        memory_mib: int = 0,
        priority: str = "standard",
        latency_slo_ms: float = 0,
        cpus_min: float = 0,
        cpus_max: float = 0,
        site: str,
    ) -> Deployment:
        return self._run(
            self._client.deploy(
                model_sha256,
                model_name,
                gpus=gpus,
                gpu_memory_mib=gpu_memory_mib,
                p2p=p2p,
                cpus=cpus,
                memory_mib=memory_mib,
                priority=priority,
                latency_slo_ms=latency_slo_ms,
                cpus_min=cpus_min,
                cpus_max=cpus_max,
                site=site,
            )
        )

    def attach(self, deployment_id: str) -> Deployment:
        return self._run(self._client.attach(deployment_id))

    def infer(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] = ()
    ) -> dict[str, np.ndarray]:
        return self._run(self._client.infer(inputs, outputs))

    def delete(self, deployment_id: str) -> bool:
        return self._run(self._client.delete(deployment_id))

    def report_location(self, site: str) -> str | None:
        return self._run(self._client.report_location(site))

    def use_service(self, name: str, *, site: str, priority: str = "standard") -> Deployment:
        return self._run(self._client.use_service(name, site=site, priority=priority))
