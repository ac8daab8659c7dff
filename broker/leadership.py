"""One broker leads: the lease that elects it, the standby that waits, the loss that ends it.

Brokers sharing one PostgreSQL state (`--state postgresql://...`) take the store's lease
`LEASE_NAME` before they serve as the broker; its holder text (`Holder`) names the process
and the addresses clients and nodes should use. The others stand by (`Standby`): they listen
on the same kinds of ports and refuse every call with UNAVAILABLE, "standby broker; the leader
is at HOST:PORT", the leader's address in the trailing metadata (`common.brokers`), and their
`/healthz` answers 503 with the role and the leader; they try to take the lease every quarter
of its ttl.

The leader (`Leadership`) renews the lease every third of its ttl, on a connection and a
thread of its own (client work never delays a renewal), and fences every write of the
broker's store with its term (`StateStore.fence`). It stops leading the only safe way, at
once and for good: when a renewal finds the lease gone, when a fenced write finds it lost,
or when no renewal has succeeded for a whole ttl (by this machine's monotonic clock, from
before the last successful renewal was sent: the database's expiry cannot be earlier), it
logs why and exits the process with `EXIT_LEASE_LOST` (crash-only: its supervisor starts it
again, as a standby). A leader paused past its lease (SIGSTOP) and resumed commits nothing:
its writes are fenced, and its watchdog thread ends it as soon as it runs again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from broker.state import Lease, LeaseLost, StateError, StateStore
from common.brokers import LEADER_METADATA_KEY, STANDBY_MESSAGE
from protos.offload.v1 import broker_pb2 as pb

logger = logging.getLogger(__name__)

LEASE_NAME = "broker"
EXIT_LEASE_LOST = 3
"""The exit status of a leader that lost its lease."""
DEFAULT_LEASE_TTL_S = 3.0
_CLIENT_SERVICES = ("offload.v1.EdgeBroker", "offload.v1.Operator")
_NODE_SERVICES = ("offload.v1.NodeRegistry",)


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds (or wants) the lease: stored as its text (`text`)."""

    id: str
    """Unique per process."""
    broker: str
    """host:port clients call (EdgeBroker, Operator)."""
    nodes: str
    """host:port nodes register on (NodeRegistry): `broker` unless `--node-listen`."""

    @classmethod
    def new(cls, broker: str, nodes: str) -> Holder:
        return cls(f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}", broker, nodes)

    def text(self) -> str:
        return json.dumps({"id": self.id, "broker": self.broker, "nodes": self.nodes})

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder of a lease's holder text; None for text another program wrote."""
        try:
            fields = json.loads(text)
            holder = cls(str(fields["id"]), str(fields["broker"]), str(fields["nodes"]))
        except (ValueError, TypeError, KeyError):
            return None
        return holder


def lose_leadership(reason: str) -> None:
    """Log why, flush the logs and end the process now with `EXIT_LEASE_LOST`: nothing of
    the broker may act a moment longer (callable from any thread)."""
    logger.critical("lost the broker lease: %s; exiting (restart me: I will stand by)", reason)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_LEASE_LOST)


class Leadership:
    """The lease of the leading broker, kept until the process ends. `store` is the lease's
    own store (a connection not shared with the broker's work); its calls run on a thread of
    their own."""

    def __init__(
        self,
        store: StateStore,
        lease: Lease,
        sent_at: float,
        ttl_s: float,
        lose: Callable[[str], None] = lose_leadership,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`lease`: as `acquire_lease` returned it, `sent_at` being when (by `clock`) that
        call was sent: the local deadline counts from it. `lose` ends leadership."""
        self._store = store
        self.lease = lease
        self._ttl_s = ttl_s
        self._lose = lose
        self._clock = clock
        self._valid_until = sent_at + ttl_s
        self._lost = threading.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "broker-lease")

    def on_fence_lost(self, err: LeaseLost) -> None:
        """For `StateStore.fence`: a fenced write found the lease lost."""
        self._give_up(f"a write was refused: {err}")

    def _give_up(self, reason: str) -> None:
        if not self._lost.is_set():
            self._lost.set()
            self._lose(reason)

    async def keep(self) -> None:
        """Renew every third of the ttl until cancelled; with a watchdog thread that ends
        leadership once a whole ttl passed without a successful renewal."""
        watchdog = threading.Thread(target=self._watch, name="broker-lease-watchdog", daemon=True)
        watchdog.start()
        loop = asyncio.get_running_loop()
        try:
            while not self._lost.is_set():
                await asyncio.sleep(self._ttl_s / 3)
                sent = self._clock()
                try:
                    renewed = await loop.run_in_executor(
                        self._executor, self._store.renew_lease, self.lease, self._ttl_s
                    )
                except StateError as err:
                    logger.warning(
                        "renewing the broker lease (term %d) failed: %s", self.lease.term, err
                    )
                    continue
                if renewed is None:
                    self._give_up(f"term {self.lease.term} was taken over or expired")
                    return
                self.lease = renewed
                self._valid_until = sent + self._ttl_s
        finally:
            self._lost.set()  # stops the watchdog: leadership ends with this loop

    def _watch(self) -> None:
        while not self._lost.wait(min(0.1, self._ttl_s / 10)):
            if self._clock() > self._valid_until:
                self._give_up(f"not renewed for {self._ttl_s:g} s (term {self.lease.term})")

    async def release(self) -> None:
        """Hand the lease back at a clean stop, so a standby need not wait for its expiry."""
        self._lost.set()
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._store.release_lease, self.lease
            )
        except StateError as err:
            logger.warning("releasing the broker lease failed (it expires by itself): %s", err)
        self._executor.shutdown(wait=False)


async def acquire(
    store: StateStore, holder: Holder, ttl_s: float, standby: Standby | None
) -> tuple[Lease, float]:
    """Try to take the lease every quarter of `ttl_s` until it is this holder's; meanwhile
    tell `standby` who leads. The lease, and when (`time.monotonic`) the call that took it was
    sent. StateError is logged and retried (the database may be down)."""
    announced: Holder | None = None
    while True:
        try:
            sent = time.monotonic()
            lease = await asyncio.to_thread(store.acquire_lease, LEASE_NAME, holder.text(), ttl_s)
            if lease is not None:
                logger.info("took the broker lease: term %d, holder %s", lease.term, holder.id)
                return lease, sent
            current = await asyncio.to_thread(store.get_lease, LEASE_NAME)
        except StateError as err:
            logger.warning("cannot reach the state to take the broker lease: %s", err)
            current = None
        leader = Holder.parse(current.holder) if current is not None else None
        if standby is not None:
            standby.leader = leader
        if leader is not None and leader != announced:
            logger.info(
                "standing by: the leader is %s (clients %s, nodes %s, term %d)",
                leader.id,
                leader.broker,
                leader.nodes,
                current.term if current is not None else 0,
            )
            announced = leader
        await asyncio.sleep(ttl_s / 4)


class Standby:
    """What a standby broker serves: every gRPC method of the broker refused with
    UNAVAILABLE and the leader's address (`leader`, kept current by `acquire`)."""

    def __init__(self) -> None:
        self.leader: Holder | None = None

    def handler(self, node_port: bool, also_nodes: bool = False) -> grpc.GenericRpcHandler:
        """The refusing handler of a port: the nodes' (`node_port`) or the clients' (with
        NodeRegistry too when `also_nodes`: no port of its own)."""
        services: tuple[str, ...] = _NODE_SERVICES if node_port else _CLIENT_SERVICES
        if also_nodes:
            services = services + _NODE_SERVICES
        return _Refusal(self, services, node_port)

    def message(self, node_port: bool) -> tuple[str, str]:
        """What a refusal says, and the leader's address for this kind of port ("" unknown)."""
        leader = self.leader
        if leader is None:
            return f"{STANDBY_MESSAGE}; no leader yet, try again shortly", ""
        address = leader.nodes if node_port else leader.broker
        return f"{STANDBY_MESSAGE}; the leader is at {address}", address


class _Refusal(grpc.GenericRpcHandler):
    def __init__(self, standby: Standby, services: tuple[str, ...], node_port: bool) -> None:
        self._standby = standby
        self._node_port = node_port
        self._methods: dict[str, Callable[..., grpc.RpcMethodHandler]] = {}
        factories = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        for service in pb.DESCRIPTOR.services_by_name.values():
            if service.full_name in services:
                for method in service.methods:
                    self._methods[f"/{service.full_name}/{method.name}"] = factories[
                        (method.client_streaming, method.server_streaming)
                    ]

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        factory = self._methods.get(handler_call_details.method)
        return factory(self._refuse) if factory is not None else None

    async def _refuse(self, request: object, context: grpc.aio.ServicerContext) -> None:
        message, address = self._standby.message(self._node_port)
        metadata = ((LEADER_METADATA_KEY, address),) if address else ()
        await context.abort(grpc.StatusCode.UNAVAILABLE, message, trailing_metadata=metadata)
