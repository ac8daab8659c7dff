"""Hollow nodes: many node daemons in one process, with replicas that run nothing, to load one
broker as a large cluster would (kubemark's hollow nodes, for Kubernetes' control plane).

Each hollow node is the real node daemon but for its runtime: its own `NodeAgent` (over a
`NullRuntime`, its own `ModelCache` folder and `GpuAllocator`, the inventory of a real
`nvidia-smi topo -m` capture), its own `offload.v1.NodeAgent` gRPC server on a loopback port
(the servicer, the malformed-request and token interceptors of `offload node`), and its own
`BrokerLink` registering, heartbeating as `offload node` does (to a broker with leases: a
lease renewal as often as it asks, the node's sample and replicas when they change or every
`sample_interval_s`), and fetching models from the broker into the node's cache. The broker
cannot tell a hollow node from a real one but by its runtime name ("null").

One gRPC server per hollow node rather than one shared server: the broker dials each node at
the address it registered and its NodeAgent requests do not name the node (StartReplica
carries the deployment, not the node), so a shared server could not route them. Servers are
cheap here: 2,000 idle grpc.aio servers in one process take under a second to start, about
70 MiB, and no CPU while idle (measured on the 2-core development machine).

Each node's channel to the broker has a local subchannel pool, so each node has its own
connection to the broker as a separate machine would, rather than gRPC's default of one
connection shared by every channel of the process to the same address. The link tells each
heartbeat's round trip to the fleet's `HeartbeatLog`.

What is left out: the replica monitor loop of `offload node` (every heartbeat checks the
replicas anyway, and null replicas never die) and the process-wide parts (signals, CPU
pinning, reading the inventory from a file per node: inventories are read once and shared).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.node_identity import load_or_create_secret
from node_daemon.agent import NodeAgent
from node_daemon.broker_link import SAMPLE_INTERVAL_S, BrokerLink
from node_daemon.inventory import Inventory
from node_daemon.model_cache import ModelCache
from node_daemon.resources import ResourceManager
from node_daemon.rpc.auth import AgentTokenInterceptor
from node_daemon.rpc.servicer import NodeAgentServicer
from node_daemon.runtimes.null_runtime import NullRuntime
from node_daemon.server import MAX_MESSAGE_BYTES
from protos.offload.v1 import node_pb2_grpc as npb_grpc
from runtime.rpc.status import MalformedRequests

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 120.0
"""How long `HollowFleet.grow` waits for its new nodes to have registered."""


@dataclass
class HeartbeatLog:
    """The heartbeat round trips of every node of a fleet since the last `take`."""

    round_trips_ms: list[float] = field(default_factory=list)
    """Of the heartbeats the broker answered OK, from the call to its answer."""
    failed: int = 0
    """Heartbeats that ended with another status (timeouts included)."""

    def record(self, round_trip_ms: float | None) -> None:
        """One heartbeat's round trip (`BrokerLink`'s `on_heartbeat`); None: it failed."""
        if round_trip_ms is None:
            self.failed += 1
        else:
            self.round_trips_ms.append(round_trip_ms)

    def take(self) -> HeartbeatLog:
        """What was logged so far, as a log of its own; this one starts again from none."""
        taken = HeartbeatLog(self.round_trips_ms, self.failed)
        self.round_trips_ms, self.failed = [], 0
        return taken


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """What a fleet reports about its nodes."""

    nodes: int
    registered: int
    """Nodes whose link is registered now (and has not stopped)."""
    replicas: int
    """Null replicas the nodes hold, all together."""
    stopped: tuple[tuple[str, str], ...]
    """(node id, why) of each node whose link ended: a refusal the broker link does not
    retry, which would stop an `offload node` daemon."""


@dataclass(slots=True)
class _HollowNode:
    agent: NodeAgent
    runtime: NullRuntime
    server: grpc.aio.Server
    link: BrokerLink
    task: asyncio.Task[None] | None = None


class HollowFleet:
    """Hollow nodes of one process, joined to one broker (see the module docstring).

    Node `i` is `<prefix>-<i, 5 digits>`, at `sites[i % len(sites)]`, with
    `inventories[i % len(inventories)]`; its model cache is under `root/<node id>`.
    """

    def __init__(
        self,
        broker: str,
        join_token: str,
        root: Path,
        sites: Sequence[str],
        inventories: Sequence[Inventory],
        prefix: str = "hollow",
        host: str = "127.0.0.1",
        sample_interval_s: float = SAMPLE_INTERVAL_S,
    ) -> None:
        """ValueError without a site or an inventory. `sample_interval_s`: each node's
        `offload node --sample-interval`."""
        if not sites or not inventories:
            raise ValueError("a hollow fleet needs at least one site and one inventory")
        self.broker = broker
        self.root = root
        self.sites = tuple(sites)
        self.inventories = tuple(inventories)
        self.prefix = prefix
        self.host = host
        self.sample_interval_s = sample_interval_s
        self.heartbeats = HeartbeatLog()
        self._join_token = join_token
        self._nodes: list[_HollowNode] = []
        self._stopped: dict[str, str] = {}

    def node_id(self, index: int) -> str:
        """The id of the fleet's node `index` (0-based)."""
        return f"{self.prefix}-{index:05d}"

    async def grow(self, count: int, spread_s: float = 1.0) -> FleetStatus:
        """Start nodes until the fleet has `count`, their first registrations spread evenly
        over `spread_s` (nodes of a real cluster do not all join in the same millisecond),
        and return once every node has registered. TimeoutError when some have not within
        `REGISTER_TIMEOUT_S` past the spread; OSError when a node cannot listen or make its
        cache folder; ValueError for a negative count or spread."""
        if count < 0 or spread_s < 0:
            raise ValueError(f"count {count} and spread_s {spread_s:g} must not be negative")
        first = len(self._nodes)
        added = max(0, count - first)
        for offset in range(added):
            node = await self._start_node(first + offset)
            self._nodes.append(node)
            delay = spread_s * offset / added
            node.task = asyncio.create_task(
                self._run(node, delay), name=f"hollow-link-{node.agent.node_id}"
            )
        deadline = time.monotonic() + spread_s + REGISTER_TIMEOUT_S
        while (status := self.status()).registered + len(status.stopped) < status.nodes:
            if time.monotonic() > deadline:
                waiting = status.nodes - status.registered - len(status.stopped)
                raise TimeoutError(
                    f"{waiting} of {status.nodes} hollow node(s) not registered with "
                    f"{self.broker} after {REGISTER_TIMEOUT_S:.0f}s"
                )
            await asyncio.sleep(0.05)
        return status

    async def _start_node(self, index: int) -> _HollowNode:
        node_id = self.node_id(index)
        runtime = NullRuntime()
        cache = await asyncio.to_thread(ModelCache, self.root / node_id / "models")
        agent = NodeAgent(
            node_id,
            self.sites[index % len(self.sites)],
            self.inventories[index % len(self.inventories)],
            runtime,
            cache,
            host=self.host,
        )
        agent.resizer = ResourceManager("static", agent.resize)
        # Its own node secret, as `offload node` keeps one: it binds the id at the broker and
        # is the token the broker calls this node's NodeAgent with.
        secret = await asyncio.to_thread(load_or_create_secret, self.root / node_id)
        server = grpc.aio.server(
            interceptors=[MalformedRequests(), AgentTokenInterceptor(secret)],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        npb_grpc.add_NodeAgentServicer_to_server(NodeAgentServicer(agent), server)
        try:
            port = server.add_insecure_port(f"{self.host}:0")
        except RuntimeError as err:
            raise OSError(f"hollow node {node_id} cannot listen on {self.host}: {err}") from err
        await server.start()
        # A connection of the node's own (not one shared by every node of this process),
        # its heartbeats' round trips logged.
        link = BrokerLink(
            self.broker,
            self._join_token,
            agent,
            f"{self.host}:{port}",
            channel_options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.use_local_subchannel_pool", 1),
            ],
            on_heartbeat=self.heartbeats.record,
            node_secret=secret,
            sample_interval_s=self.sample_interval_s,
        )
        agent.fetch_model = link.fetch_model
        return _HollowNode(agent, runtime, server, link)

    async def _run(self, node: _HollowNode, delay_s: float) -> None:
        """The node's link, as `offload node` runs it; a refusal it does not retry (a wrong
        join token) stops this node alone, and is reported by `status`."""
        await asyncio.sleep(delay_s)
        try:
            await node.link.run()
            self._stopped[node.agent.node_id] = "the broker link ended"
        except grpc.aio.AioRpcError as err:
            phase = "heartbeating" if node.link.registered.is_set() else "registering"
            self._stopped[node.agent.node_id] = f"{err.code().name} {err.details()} while {phase}"
            logger.error(
                "hollow node=%s stopped: %s (%s)",
                node.agent.node_id,
                self._stopped[node.agent.node_id],
                err.debug_error_string(),
            )

    def status(self) -> FleetStatus:
        """The fleet's nodes now: how many, registered, stopped (why), and their replicas."""
        return FleetStatus(
            nodes=len(self._nodes),
            registered=sum(
                n.link.registered.is_set() and n.agent.node_id not in self._stopped
                for n in self._nodes
            ),
            replicas=sum(len(n.runtime.replica_ids) for n in self._nodes),
            stopped=tuple(sorted(self._stopped.items())),
        )

    async def close(self) -> None:
        """Stop every node: its link, then its server, then its replicas."""
        tasks = [n.task for n in self._nodes if n.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for node in self._nodes:
            await node.link.close()
        await asyncio.gather(*(n.server.stop(0) for n in self._nodes))
        for node in self._nodes:
            await node.agent.close(stop_replicas=True)
        self._nodes.clear()
