"""The broker: `offload broker --listen ADDR --ops-listen ADDR --state-dir DIR --cluster FILE`.

Serves `offload.v1.NodeRegistry` (nodes join with the cluster's join token) and
`offload.v1.EdgeBroker` (clients with API keys) on one gRPC port, and the ops HTTP server
(`/healthz`, `/metrics`, `/api/...`, the dashboard) on another. State lives in SQLite under
the state dir, or in PostgreSQL with `--state postgresql://...`; a restarted broker reloads
it, and nodes re-register and are reconciled.

With `--tls-cert/--tls-key/--tls-ca` every port serves TLS (the ops server HTTPS) and
NodeRegistry moves to a port of its own, `--node-listen`, where a node must present a
certificate for its node id, signed by the CA, as well as the join token (mutual TLS: gRPC
Python cannot make a client certificate optional, and clients have none). The broker presents
its own certificate to the nodes it calls. A plaintext port that other hosts can reach needs
`--insecure`.

Several brokers may share one PostgreSQL state: each takes the lease "broker" before it serves
(`broker.leadership`); the others stand by on their ports, refusing every call with the
leader's address, and take over within about `--lease-ttl` when the leader stops renewing.
They need fixed ports, and `--advertise HOST` when they listen on a wildcard address.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import math
import re
import secrets
import signal
import ssl
import sys
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from broker.beacons import BeaconReceiver
from broker.leadership import (
    DEFAULT_LEASE_TTL_S,
    LEASE_NAME,
    Holder,
    Leadership,
    Standby,
    acquire,
)
from broker.migrations import Migrations
from broker.model_store import ModelStore
from broker.network import ClusterConfigError, EdgeNetwork
from broker.node_client import NodeClient
from broker.ops import (
    BrokerMetrics,
    OpsAuth,
    create_ops_app,
    create_standby_app,
    start_ops_server,
)
from broker.ops_view import BrokerOpsView
from broker.quotas import DEFAULT_MAX_STAGED_BYTES, Quotas
from broker.rebalance import REBALANCE_SWEEP_S, Rebalancer
from broker.rpc.servicers import EdgeBrokerServicer, NodeRegistryServicer, OperatorServicer
from broker.rpc.status import MalformedRequests
from broker.service import Broker
from broker.state import KeyChanges, StateError, StateStore, new_api_key, parse_api_keys_file
from broker.state.opener import open_store
from broker.state.permissions import create_private_file
from broker.state.postgres_backend import SCHEMES
from broker.values import BrokerSettings
from common import collector, heap
from common.certs import TlsIdentity, add_tls_arguments, identity_from_args
from common.private_files import read_secret, warn_if_readable
from migration.policy import Hysteresis, PrewarmSettings
from migration.rebalance import RebalanceSettings
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from runtime.errors import quote
from runtime.tls import check_listener, listen, server_credentials

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
OPS_TOKEN_FILENAME = "ops-token"
DEFAULT_MAX_MODEL_BYTES = 2 * 1024**3
STREAM_WINDOW_BYTES = 1 << 20
"""HTTP/2 flow-control window of each call the broker serves: about one upload chunk."""
MAX_PENDING_CALLS = 50_000
"""Calls gRPC core holds for the event loop to pick up before it refuses more (its default
is 1,000, which a cluster of more nodes than that reaches whenever the loop stalls)."""
MIN_LEASE_TTL_S = 0.5
MAX_LIVENESS_S = 3600.0
DEFAULT_NODE_LEASE_S = 60.0


def keepalive(interval_ms: int, timeout_ms: int) -> tuple[tuple[str, int], ...]:
    """Server options for HTTP/2 keepalive, in gRPC's core (no Python runs for it): a ping on
    a connection after `interval_ms` without a frame from its peer, and the connection closed
    when one goes unanswered for `timeout_ms`; the calls on it end with it.
    `grpc.http2.ping_timeout_ms` is the timer grpcio 1.85 applies (`grpc.keepalive_timeout_ms`
    alone left a paused peer's stream open); pings go on however long the peer sends no
    data."""
    return (
        ("grpc.keepalive_time_ms", interval_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.max_pings_without_data", 0),
    )


NODE_KEEPALIVE = keepalive(20_000, 5_000)
"""Server options of the broker's node port (`--node-listen`). A node's liveness there is its
beacons (`broker.beacons`), or its frequent renewals: these pings only close, within 25 s,
the connection of a node that went without a word (a host gone, a link cut) and back the
lease of one whose beacons never arrive (`NodeRegistry.lease_s`). Every 20 s, not 2: each
ping costs gRPC's core about 130 µs of CPU here (2,000 nodes pinged every 2 s: 0.13 cores,
`bench.ping_cost`). Not on the clients' port: a client uploading over a slow link could not
answer a ping behind its own data."""
STANDBY_GRACE_S = 0.5
"""How long refusals in flight may take to finish when a standby stops to lead."""
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
_ADVERTISED_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")
PREWARM_SWEEP_S = 5.0
"""How often deployments without a standby are planned again (new ones, and those the
budget turned away)."""


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    listen: str
    ops_listen: str
    state_dir: Path
    cluster: Path
    join_token: str
    state: str = ""
    """Where the state is (`--state`): "" for `<state_dir>/broker.sqlite3`, or a PostgreSQL
    URL without a password (`broker.state.open_store`)."""
    api_keys: tuple[str, ...] = ()
    """Exactly the `<client id>.<secret>` keys to accept (stored hashed in the state); any
    other key the state has is revoked at start."""
    api_keys_file: Path | None = None
    """Where `api_keys` came from: read again on SIGHUP."""
    ops_token: str | None = None
    """What `/api/*` and the dashboard need; None: the one in `<state_dir>/ops-token` (made
    there, 0600, when absent)."""
    metrics_auth: bool = False
    """Whether `/metrics` needs the ops token too."""
    max_model_bytes: int = DEFAULT_MAX_MODEL_BYTES
    settings: BrokerSettings = field(default_factory=BrokerSettings)
    hysteresis: Hysteresis = field(default_factory=Hysteresis)
    drain_timeout_s: float = 5.0
    prewarm: PrewarmSettings = field(default_factory=PrewarmSettings)
    rebalance: RebalanceSettings = field(
        default_factory=lambda: RebalanceSettings(max_concurrent=0)
    )
    """Speculative rebalancing: off unless `max_concurrent` > 0 (`--rebalance N`)."""
    node_listen: str = ""
    """host:port for NodeRegistry on a port of its own; empty: on `listen`. Needed with
    `tls`: nodes connect there with mutual TLS."""
    tls: TlsIdentity | None = None
    """The broker's certificate, key and CA (which nodes' certificates must chain to); None:
    plaintext everywhere."""
    tls_files: tuple[Path, Path] | None = None
    """The files of `tls.cert` and `tls.key`, for the ops server's HTTPS (Python's ssl module
    reads a certificate chain from files only)."""
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    """With a PostgreSQL state: how long the leader's lease lasts unrenewed (`--lease-ttl`)."""
    advertise: str = ""
    """The host other brokers' standbys name to clients and nodes (`--advertise`); "": the
    host of `listen`."""

    @property
    def shared_state(self) -> bool:
        """Whether the state is PostgreSQL, which several brokers share: one leads."""
        return self.state.startswith(SCHEMES)

    def holder(self) -> Holder:
        """This process as the lease's holder: its id and advertised addresses."""
        host = self.advertise or self.listen.rpartition(":")[0]
        node_port = (self.node_listen or self.listen).rpartition(":")[2]
        return Holder.new(f"{host}:{self.listen.rpartition(':')[2]}", f"{host}:{node_port}")


@dataclass(slots=True)
class RunningBroker:
    broker: Broker
    migrations: Migrations
    rebalancer: Rebalancer
    server: grpc.aio.Server
    port: int
    ops_runner: object
    ops_port: int
    store: StateStore
    node_server: grpc.aio.Server | None = None
    """NodeRegistry's own server (`--node-listen`); None when it is on `server`."""
    node_port: int = 0
    """The port nodes register on: `port` when NodeRegistry is on `server`."""
    beacons: BeaconReceiver | None = None
    """The nodes' beacons, on the node port's number (UDP); None without a node port."""

    async def stop(self) -> None:
        if self.node_server is not None:
            await self.node_server.stop(2.0)
        if self.beacons is not None:
            await self.beacons.close()
        await self.server.stop(2.0)
        await self.ops_runner.cleanup()  # type: ignore[attr-defined]
        await self.broker.close()
        self.store.close()


async def start_broker(
    config: BrokerConfig, leadership: Leadership | None = None
) -> RunningBroker:
    """Open the state, load the cluster file, listen on both ports. With `leadership`, every
    write of the state is fenced by its lease (`StateStore.fence`)."""
    network = EdgeNetwork.from_yaml(config.cluster.read_text(), str(config.cluster))
    store = await asyncio.to_thread(open_store, config.state, config.state_dir)
    beacons = None
    try:
        if leadership is not None:
            store.fence(LEASE_NAME, leadership.lease.term, leadership.on_fence_lost)
        changes = await asyncio.to_thread(store.replace_client_keys, config.api_keys)
        _log_key_changes(changes, "at start")
        models = ModelStore(config.state_dir / "models", config.max_model_bytes)
        metrics = BrokerMetrics()
        broker = Broker(
            store,
            models,
            network,
            config.join_token,
            config.settings,
            metrics,
            functools.partial(NodeClient, tls=config.tls),
        )
        broker.use_keys(config.api_keys)
        await broker.load()
        server = _grpc_server()
        node_server = _grpc_server(NODE_KEEPALIVE) if config.node_listen else None
        migrations = Migrations(
            broker, config.hysteresis, config.drain_timeout_s, prewarm=config.prewarm
        )
        await migrations.resume_after_restart()
        pb_grpc.add_NodeRegistryServicer_to_server(
            NodeRegistryServicer(broker, node_certificates=config.tls is not None),
            node_server or server,
        )
        endpoint_ca = config.tls.ca.decode() if config.tls is not None else ""
        pb_grpc.add_EdgeBrokerServicer_to_server(
            EdgeBrokerServicer(broker, migrations, endpoint_ca), server
        )
        pb_grpc.add_OperatorServicer_to_server(OperatorServicer(migrations), server)
        tls = config.tls
        port = listen(server, config.listen, server_credentials(tls) if tls else None)
        node_port = port
        if node_server is not None:
            node_port = listen(
                node_server,
                config.node_listen,
                server_credentials(tls, require_client_cert=True) if tls else None,
            )
            beacons = _beacons(broker, config.node_listen.rpartition(":")[0], node_port)
            await node_server.start()
        await server.start()
        ops_token = config.ops_token
        if ops_token is None:
            ops_token = await asyncio.to_thread(state_ops_token, config.state_dir)
        auth = OpsAuth(ops_token, metrics_open=not config.metrics_auth)
        host, _, ops_port_text = config.ops_listen.rpartition(":")
        ssl_context = _ops_ssl_context(config.tls_files) if config.tls_files else None
        runner, ops_port = await start_ops_server(
            create_ops_app(BrokerOpsView(broker, config.prewarm.budget), metrics, auth),
            host,
            int(ops_port_text),
            ssl_context,
        )
    except BaseException:
        if beacons is not None:
            await beacons.close()
        store.close()
        raise
    logger.info(
        "broker listening on %s:%d%s, nodes on %s:%d%s, ops on %s://%s:%d/",
        config.listen.rpartition(":")[0],
        port,
        " (TLS)" if tls else "",
        (config.node_listen or config.listen).rpartition(":")[0],
        node_port,
        " (mutual TLS)" if tls else "",
        "https" if ssl_context else "http",
        host,
        ops_port,
    )
    rebalancer = Rebalancer(migrations, config.rebalance)
    return RunningBroker(
        broker,
        migrations,
        rebalancer,
        server,
        port,
        runner,
        ops_port,
        store,
        node_server,
        node_port,
        beacons,
    )


def _beacons(broker: Broker, host: str, port: int) -> BeaconReceiver | None:
    """The nodes' beacons on UDP `host`:`port`, the node port's number, reading; None (nodes
    renew their leases on their streams, often) when that port is taken."""
    registry = broker.registry
    try:
        receiver = BeaconReceiver.bind(host, port, registry.beaconed, broker.metrics)
    except OSError as err:
        logger.warning(
            "no node beacons: UDP %s:%d cannot be bound (%s); nodes renew their leases every "
            "%gs on their streams instead",
            host,
            port,
            err,
            registry.renew_s(beacons=False),
        )
        return None
    registry.use_beacons(receiver, broker.settings.heartbeat_interval_s)
    receiver.start()
    return receiver


def _grpc_server(keepalive: tuple[tuple[str, int], ...] = ()) -> grpc.aio.Server:
    return grpc.aio.server(
        interceptors=[MalformedRequests()],
        options=[
            *keepalive,
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # gRPC core cancels calls at random once more than 1,000 wait for the event loop
            # to pick them up (all of them past 3,000): with thousands of nodes, a stall of
            # the loop would cancel heartbeats, and nodes would be lost.
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
            # A fixed flow-control window per stream, not one grown by bandwidth probing:
            # a client's upload the broker has not written to disk yet holds at most about
            # this much of its memory (with probing, 40 uploads on loopback held 1 GB).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ],
    )


def _ops_ssl_context(files: tuple[Path, Path]) -> ssl.SSLContext:
    """HTTPS for the ops server with the broker's certificate (checked already)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*files)
    return context


def _log_key_changes(changes: KeyChanges, when: str) -> None:
    logger.info(
        "API keys %s: %s",
        when,
        "; ".join(
            f"{what} {', '.join(clients)}"
            for what, clients in (
                ("added", changes.added),
                ("replaced", changes.replaced),
                ("revoked", changes.revoked),
            )
            if clients
        )
        or "unchanged",
    )


async def reload_api_keys(running: RunningBroker, path: Path | None) -> None:
    """Make the keys of `path` exactly the accepted ones (SIGHUP). Removed and replaced keys
    stop working first, at once and without hashing anything (`Broker.use_keys`: the next
    call with one is refused, and its WatchDeployment streams end); only then is the state
    brought in line, hashing the keys that are new or changed since the last reload
    (`StateStore.replace_client_keys`). A file that cannot be read or has a bad line changes
    nothing (logged with the line number). Returns once both are done."""
    if path is None:
        logger.warning("SIGHUP: the broker runs without --api-keys-file; nothing to reload")
        return
    try:
        keys = parse_api_keys_file(await asyncio.to_thread(path.read_text), str(path))
    except (OSError, ValueError) as err:
        logger.error("API keys not reloaded, the current ones stay: %s", err)
        return
    stopped = running.broker.use_keys(keys)
    logger.info(
        "API keys from %s in effect: %d key(s); stopped working: %s",
        path,
        len(keys),
        ", ".join(stopped) or "none",
    )
    try:
        changes = await asyncio.to_thread(running.store.replace_client_keys, keys)
    except StateError as err:
        # The file's keys are in effect already; the state catches up at the next reload
        # or start.
        logger.error("API keys from %s in effect, but the state was not updated: %s", path, err)
        return
    _log_key_changes(changes, f"reloaded from {path}")


async def _every(interval_s: float, action: Callable[[], Awaitable[object]]) -> None:
    """Run `action` every `interval_s`; a failure is logged and the loop goes on."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await action()
        except Exception:
            logger.exception("%s failed", getattr(action, "__name__", action))


async def _stand_by(
    config: BrokerConfig, store: StateStore, stop: asyncio.Event
) -> Leadership | None:
    """Serve as a standby (refusals naming the leader) until this broker takes the lease;
    its leadership, or None when `stop` came first."""
    holder = config.holder()
    standby = Standby()
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGHUP,
        lambda: logger.info("SIGHUP: standing by; the API keys are read on taking over"),
    )
    tls = config.tls
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (standby.handler(node_port=False, also_nodes=not config.node_listen),)
    )
    listen(server, config.listen, server_credentials(tls) if tls else None)
    node_server = None
    if config.node_listen:
        node_server = grpc.aio.server()
        node_server.add_generic_rpc_handlers((standby.handler(node_port=True),))
        listen(
            node_server,
            config.node_listen,
            server_credentials(tls, require_client_cert=True) if tls else None,
        )
    host, _, ops_port = config.ops_listen.rpartition(":")
    runner, _ = await start_ops_server(
        create_standby_app(lambda: standby.leader.broker if standby.leader else ""),
        host,
        int(ops_port),
        _ops_ssl_context(config.tls_files) if config.tls_files else None,
    )
    try:
        for started in (server, node_server):
            if started is not None:
                await started.start()
        logger.info(
            "broker standing by on %s%s as %s (clients %s, nodes %s); lease ttl %g s",
            config.listen,
            f" and {config.node_listen}" if config.node_listen else "",
            holder.id,
            holder.broker,
            holder.nodes,
            config.lease_ttl_s,
        )
        taking = asyncio.create_task(
            acquire(store, holder, config.lease_ttl_s, standby), name="broker-lease-acquire"
        )
        stopping = asyncio.create_task(stop.wait(), name="broker-stop")
        done, _ = await asyncio.wait((taking, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if taking not in done:
            taking.cancel()
            await asyncio.gather(taking, stopping, return_exceptions=True)
            return None
        await asyncio.gather(stopping, return_exceptions=True)
        lease, sent = taking.result()
    finally:
        for started in (node_server, server):
            if started is not None:
                await started.stop(STANDBY_GRACE_S)
        await runner.cleanup()
    return Leadership(store, lease, sent, config.lease_ttl_s)


async def serve(config: BrokerConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if not config.shared_state:
        return await _serve_leading(config, stop, None)
    lease_store = await asyncio.to_thread(open_store, config.state, config.state_dir)
    try:
        leadership = await _stand_by(config, lease_store, stop)
        if leadership is None:
            return 0
        # Renewing starts now: resuming migrations may take longer than the lease lasts.
        keeper = asyncio.create_task(leadership.keep(), name="broker-lease")
        try:
            return await _serve_leading(config, stop, leadership)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            await leadership.release()
    finally:
        await asyncio.to_thread(lease_store.close)


async def _serve_leading(
    config: BrokerConfig, stop: asyncio.Event, leadership: Leadership | None
) -> int:
    if leadership is not None and config.api_keys_file is not None:
        # A standby may have waited long: the keys are those of the file now, as on SIGHUP.
        text = await asyncio.to_thread(config.api_keys_file.read_text)
        keys = parse_api_keys_file(text, str(config.api_keys_file))
        config = dataclasses.replace(config, api_keys=keys)
    running = await start_broker(config, leadership)
    # This process is the broker's alone (`serve` is its entry point): what startup loaded
    # lives as long as it does; the collector's settings for its large heap, and upload
    # chunks' memory handed back when they are freed.
    collector.settle()
    heap.map_large_blocks()
    broker = running.broker
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGHUP,
        lambda: broker.background(
            reload_api_keys(running, config.api_keys_file), "reload-api-keys"
        ),
    )

    async def fail_over() -> None:
        # Failing over waits for placement; the next lost-node check must not.
        for node_id in await broker.mark_lost_nodes():
            broker.background(running.migrations.on_node_lost(node_id), f"failover-{node_id}")

    try:
        async with asyncio.TaskGroup() as tasks:
            loops = [
                tasks.create_task(_every(1.0, fail_over), name="lost-node-check"),
                tasks.create_task(broker.loop_lag.run(), name="loop-lag"),
                tasks.create_task(
                    _every(config.settings.pending_retry_s, broker.deployments.retry_pending),
                    name="pending-retry",
                ),
                tasks.create_task(
                    _every(PREWARM_SWEEP_S, running.migrations.prewarm.sweep),
                    name="prewarm-sweep",
                ),
                tasks.create_task(
                    _every(REBALANCE_SWEEP_S, running.rebalancer.sweep), name="rebalance-sweep"
                ),
            ]
            await stop.wait()
            for task in loops:
                task.cancel()
    finally:
        await running.stop()
    return 0


def state_ops_token(state_dir: Path) -> str:
    """The ops token of a broker started without `--ops-token-file`: `<state_dir>/ops-token`,
    made (random, mode 0600) when absent or empty, kept across restarts. Logs where it is,
    never the token. Blocking."""
    path = state_dir / OPS_TOKEN_FILENAME
    create_private_file(path)
    token = path.read_text().strip()
    if not token:
        token = secrets.token_urlsafe(32)
        path.write_text(token + "\n")
    logger.info("ops token: in %s (no --ops-token-file given)", path)
    return token


def _check_state_location(location: str) -> None:
    """A password in `--state` would be on the command line, which every local user can read
    (ps, /proc): refused, pointing at where libpq reads one from instead."""
    parts = urllib.parse.urlsplit(location)
    query = urllib.parse.parse_qs(parts.query)
    if "://" in location and (parts.password is not None or "password" in query):
        raise ValueError(
            "--state: the URL holds a password, which would be readable by every local user "
            "on the command line; leave it out and give it in a password file (PGPASSFILE, "
            "mode 0600, or ~/.pgpass) or in PGPASSWORD in the service's environment"
        )


def _check_shared_state(args: argparse.Namespace, listeners: list[tuple[str, str]]) -> None:
    """With a PostgreSQL state (several brokers may share it, one leads): fixed ports, a host
    to advertise, a lease ttl within bounds."""
    if not math.isfinite(args.lease_ttl) or not MIN_LEASE_TTL_S <= args.lease_ttl <= 60:
        raise ValueError(f"--lease-ttl {args.lease_ttl!r} must be {MIN_LEASE_TTL_S:g} to 60 s")
    if args.advertise and (
        not _ADVERTISED_HOST.fullmatch(args.advertise) or args.advertise in _WILDCARD_HOSTS
    ):
        raise ValueError(
            f"--advertise {quote(args.advertise)} must be a host name or address without a "
            "port (an IPv6 address in brackets), not a wildcard"
        )
    if not args.state.startswith(SCHEMES):
        return
    for flag, value in listeners:
        if flag != "--ops-listen" and value.rpartition(":")[2] == "0":
            raise ValueError(
                f"{flag} {value!r}: a broker sharing a PostgreSQL state needs a fixed port "
                "(a standby names the leader's address to clients and nodes)"
            )
    if not args.advertise and args.listen.rpartition(":")[0] in _WILDCARD_HOSTS:
        raise ValueError(
            "--advertise HOST is needed with a PostgreSQL state and --listen on a wildcard "
            "address: the address clients and nodes are sent to while this broker leads"
        )


def _check_upload_caps(args: argparse.Namespace) -> None:
    """The model size limit and the staging caps: positive, and a model of the largest size
    the broker takes can be staged."""
    for flag, value in (
        ("--max-model-bytes", args.max_model_bytes),
        ("--max-staged-upload-bytes", args.max_staged_upload_bytes),
        ("--max-staged-upload-bytes-per-client", args.max_staged_upload_bytes_per_client),
    ):
        if value < 1:
            raise ValueError(f"{flag} {value} must be a positive number of bytes")
    for flag, value in (
        ("--max-staged-upload-bytes", args.max_staged_upload_bytes),
        ("--max-staged-upload-bytes-per-client", args.max_staged_upload_bytes_per_client),
    ):
        if value < args.max_model_bytes:
            raise ValueError(
                f"{flag} {value} is below --max-model-bytes {args.max_model_bytes}: a model "
                "that large could never be staged; raise it or lower --max-model-bytes"
            )


def _check_liveness(args: argparse.Namespace) -> None:
    """The heartbeat interval, the lease and the node port's lease: finite, in bounds, each
    longer than the one before; `--node-lease` only on a node port (where nodes beacon)."""
    bounds = [
        ("--heartbeat-interval", args.heartbeat_interval, 0.05),
        ("--lost-after", args.lost_after, args.heartbeat_interval),
    ]
    if args.node_lease is not None:  # the default follows --lost-after (`config_from_args`)
        bounds.append(("--node-lease", args.node_lease, args.lost_after))
    for flag, value, above in bounds:
        if not (math.isfinite(value) and above <= value <= MAX_LIVENESS_S):
            raise ValueError(
                f"--heartbeat-interval, --lost-after and --node-lease must be finite numbers "
                f"of seconds, each at least the one before, at most {MAX_LIVENESS_S:g}: "
                f"{flag} {value!r}"
            )
    if not (math.isfinite(args.service_idle_grace) and 1 <= args.service_idle_grace <= 86400):
        raise ValueError(
            f"--service-idle-grace {args.service_idle_grace!r} must be 1 to 86400 seconds"
        )
    target = args.service_queue_target_ms
    if not (math.isfinite(target) and 0 <= target <= 60_000):
        raise ValueError(
            f"--service-queue-target-ms {target!r} must be 0 (never scale on load) to 60000 ms"
        )
    if args.node_lease is not None and not args.node_listen:
        raise ValueError(
            "--node-lease needs --node-listen HOST:PORT: only on the nodes' own port do they "
            "beacon, so that a rare lease renewal is enough; on --listen, --lost-after is the "
            "lease"
        )


def config_from_args(args: argparse.Namespace) -> BrokerConfig:
    """Validated configuration; ValueError or OSError saying which flag is wrong (CertError,
    a ValueError, for a certificate or key that cannot be used)."""
    listeners = [("--listen", args.listen), ("--ops-listen", args.ops_listen)]
    if args.node_listen:
        listeners.append(("--node-listen", args.node_listen))
    for flag, value in listeners:
        host, colon, port = value.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"{flag} {value!r} is not host:port")
    tls = identity_from_args(args)
    if tls is not None and not args.node_listen:
        raise ValueError(
            "--tls-cert needs --node-listen HOST:PORT: nodes register there with mutual TLS "
            "(their own certificates), clients keep --listen"
        )
    for flag, value in listeners:
        check_listener(flag, value, tls is not None, args.insecure)
    _check_state_location(args.state)
    _check_shared_state(args, listeners)
    _check_upload_caps(args)
    _check_liveness(args)
    keys: tuple[str, ...] = ()
    if args.api_keys_file is not None:
        keys = parse_api_keys_file(args.api_keys_file.read_text(), str(args.api_keys_file))
        # The systemd recipe has the service's group read it (root:edge-offload 0640).
        warn_if_readable(args.api_keys_file, "--api-keys-file", group_may_read=True)
    return BrokerConfig(
        listen=args.listen,
        ops_listen=args.ops_listen,
        state_dir=args.state_dir,
        state=args.state,
        cluster=args.cluster,
        join_token=read_secret(args.join_token_file, "--join-token-file"),
        api_keys=keys,
        api_keys_file=args.api_keys_file,
        ops_token=(
            read_secret(args.ops_token_file, "--ops-token-file")
            if args.ops_token_file is not None
            else None
        ),
        metrics_auth=args.metrics_auth,
        max_model_bytes=args.max_model_bytes,
        settings=BrokerSettings(
            heartbeat_interval_s=args.heartbeat_interval,
            lost_after_s=args.lost_after,
            node_lease_s=(
                (args.node_lease or max(DEFAULT_NODE_LEASE_S, args.lost_after))
                if args.node_listen
                else None
            ),
            orphan_grace_s=args.orphan_grace,
            service_idle_s=args.service_idle_grace,
            service_queue_target_ms=args.service_queue_target_ms,
            quotas=Quotas(
                deployments=args.max_deployments_per_client,
                model_bytes=args.max_model_bytes_per_client,
                uploads=args.max_uploads_per_client,
                watch_streams=args.max_watch_streams_per_client,
                upload_idle_timeout_s=args.upload_idle_timeout,
                staged_bytes=args.max_staged_upload_bytes_per_client,
            ),
            max_staged_upload_bytes=args.max_staged_upload_bytes,
        ),
        hysteresis=Hysteresis(args.min_gain_ms, args.min_gain_ratio, args.cooldown),
        drain_timeout_s=args.drain_timeout,
        prewarm=PrewarmSettings(
            budget=args.prewarm_budget,
            min_probability=args.prewarm_min_probability,
            ttl_s=args.prewarm_ttl,
        ),
        rebalance=_rebalance_settings(args),
        node_listen=args.node_listen,
        tls=tls,
        tls_files=(args.tls_cert, args.tls_key) if tls is not None else None,
        lease_ttl_s=args.lease_ttl,
        advertise=args.advertise,
    )


def _rebalance_settings(args: argparse.Namespace) -> RebalanceSettings:
    try:
        return RebalanceSettings(
            max_concurrent=args.rebalance,
            hot_load=args.rebalance_hot_load,
            sustain_s=args.rebalance_sustain,
            target_max_load=args.rebalance_target_max_load,
            cooldown_s=args.rebalance_cooldown,
        )
    except ValueError as err:
        raise ValueError(f"--rebalance flags: {err}") from None


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "broker",
        help="run the broker: node registry, placement, deployments, ops page",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--listen", required=True, help="host:port for gRPC (port 0: any, logged)")
    p.add_argument("--ops-listen", required=True, help="host:port for the ops HTTP server")
    p.add_argument(
        "--node-listen",
        default="",
        help="host:port for NodeRegistry on a port of its own, where nodes register (needed "
        "with --tls-cert: mutual TLS; default: on --listen); the same port number on UDP "
        "takes the nodes' liveness beacons (open it in firewalls too)",
    )
    add_tls_arguments(
        p, "that nodes' certificates must chain to (and the one nodes verify the broker by)"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        required=True,
        help="the models, the ops token, and the state's SQLite file unless --state says "
        "otherwise",
    )
    p.add_argument(
        "--state",
        default="",
        metavar="URL",
        help="keep the state in PostgreSQL (12 or newer): postgresql://USER@HOST:PORT/DB "
        "(libpq parameters allowed, e.g. ?sslmode=verify-full); never a password here: libpq "
        "reads it from PGPASSFILE/~/.pgpass or PGPASSWORD (default: <state-dir>/broker.sqlite3)",
    )
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=DEFAULT_LEASE_TTL_S,
        metavar="SECONDS",
        help="with a PostgreSQL --state, several brokers may share it: one leads, holding a "
        "lease it renews every third of this; the others stand by and take over this long "
        "after it stops renewing; a leader that cannot renew for this long exits "
        f"(default {DEFAULT_LEASE_TTL_S:g})",
    )
    p.add_argument(
        "--advertise",
        default="",
        metavar="HOST",
        help="the host clients and nodes reach this broker at, which standbys send them to "
        "while it leads (default: the host of --listen; needed when that is a wildcard)",
    )
    p.add_argument(
        "--cluster",
        type=Path,
        required=True,
        help="the cluster file (YAML): sites, links with latencies, nodes",
    )
    p.add_argument(
        "--join-token-file",
        type=Path,
        required=True,
        help="the token nodes join with (offload node --join-token-file)",
    )
    p.add_argument(
        "--api-keys-file",
        type=Path,
        help="client API keys, one per line (make them with `offload keygen`): exactly these "
        "work; SIGHUP reads the file again",
    )
    p.add_argument(
        "--ops-token-file",
        type=Path,
        help="the token /api/* and the dashboard need (default: <state-dir>/ops-token, "
        "made when absent)",
    )
    p.add_argument(
        "--metrics-auth",
        action="store_true",
        help="/metrics needs the ops token too (default: open, like /healthz)",
    )
    p.add_argument("--max-model-bytes", type=int, default=DEFAULT_MAX_MODEL_BYTES)
    defaults = Quotas()
    p.add_argument(
        "--max-deployments-per-client",
        type=int,
        default=defaults.deployments,
        metavar="N",
        help=f"deployments (not deleted) one client may have (default {defaults.deployments})",
    )
    p.add_argument(
        "--max-model-bytes-per-client",
        type=int,
        default=defaults.model_bytes,
        metavar="BYTES",
        help=f"total size of the models one client uploaded (default {defaults.model_bytes})",
    )
    p.add_argument(
        "--max-uploads-per-client",
        type=int,
        default=defaults.uploads,
        metavar="N",
        help=f"uploads one client may run at once (default {defaults.uploads})",
    )
    p.add_argument(
        "--max-watch-streams-per-client",
        type=int,
        default=defaults.watch_streams,
        metavar="N",
        help=f"WatchDeployment streams one client may hold (default {defaults.watch_streams})",
    )
    p.add_argument(
        "--upload-idle-timeout",
        type=float,
        default=defaults.upload_idle_timeout_s,
        metavar="SECONDS",
        help="cut off an upload that sends nothing for this long "
        f"(default {defaults.upload_idle_timeout_s:g})",
    )
    p.add_argument(
        "--max-staged-upload-bytes",
        type=int,
        default=DEFAULT_MAX_STAGED_BYTES,
        metavar="BYTES",
        help="bytes of uploads under way the broker stages at once (on disk, in the state "
        "dir's models folder), all clients together; a chunk past it ends its upload with "
        f"RESOURCE_EXHAUSTED (default {DEFAULT_MAX_STAGED_BYTES}; at least --max-model-bytes)",
    )
    p.add_argument(
        "--max-staged-upload-bytes-per-client",
        type=int,
        default=defaults.staged_bytes,
        metavar="BYTES",
        help="the same for one client's uploads under way "
        f"(default {defaults.staged_bytes}; at least --max-model-bytes)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often a node samples its usage and checks for changes to report (default 1)",
    )
    p.add_argument(
        "--lost-after",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="mark a node lost after this long without a heartbeat or lease renewal (it "
        "renews every 0.4 of this) or, on --node-listen, without a beacon (a UDP datagram "
        "each --heartbeat-interval), or min(2 s, this) after its heartbeat stream broke "
        "(default 5)",
    )
    p.add_argument(
        "--node-lease",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --node-listen, where nodes send beacons (UDP, to the node port's number) "
        "that are their liveness: how often a beaconing node renews its lease on its stream "
        "(every 0.4 of this), and the lease of one whose beacons never arrive (UDP "
        "filtered; the node port's HTTP/2 pings, every 20 s, back it) "
        f"(default {DEFAULT_NODE_LEASE_S:g}, or --lost-after when that is longer)",
    )
    p.add_argument(
        "--service-idle-grace",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="stop a service's replica that has had no client on it this long, beyond the "
        "service's replicas kept per site (default 60; 1 to 86400)",
    )
    p.add_argument(
        "--service-queue-target-ms",
        type=float,
        default=50.0,
        metavar="MS",
        help="start another replica of a service beside one whose requests wait longer than "
        "this for their batch (queue delay p99, every sample for 5 s), and switch half its "
        "clients to it (default 50; 0: never on load)",
    )
    p.add_argument(
        "--orphan-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="stop a replica no deployment claims after this long",
    )
    p.add_argument(
        "--min-gain-ms",
        type=float,
        default=2.0,
        help="mobility hysteresis: migrate only to gain at least this many ms...",
    )
    p.add_argument(
        "--min-gain-ratio",
        type=float,
        default=0.2,
        help="...and at least this fraction of the current latency (default 0.2)",
    )
    p.add_argument(
        "--cooldown",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="no mobility migration sooner than this after the last one",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long the old replica waits for the client's switch ack",
    )
    prewarm = PrewarmSettings()
    p.add_argument(
        "--prewarm-budget",
        type=int,
        default=prewarm.budget,
        metavar="N",
        help="predictive pre-warm: start up to N standby replicas (cluster-wide, at once) at "
        "the sites clients are predicted to reach next, so the move there is a switch, not a "
        "start; standbys are preempted by any deployment (default 0: off)",
    )
    p.add_argument(
        "--prewarm-min-probability",
        type=float,
        default=prewarm.min_probability,
        metavar="P",
        help="warm a standby only for a next site at least this likely, and when probability "
        f"x latency gain reaches --min-gain-ms (default {prewarm.min_probability:g})",
    )
    p.add_argument(
        "--prewarm-ttl",
        type=float,
        default=prewarm.ttl_s,
        metavar="SECONDS",
        help=f"retire a standby the client has not reached after this long "
        f"(default {prewarm.ttl_s:g})",
    )
    rebalance = RebalanceSettings()
    p.add_argument(
        "--rebalance",
        type=int,
        default=0,
        metavar="N",
        help="speculative rebalancing: when a node's load stays at or above "
        "--rebalance-hot-load for --rebalance-sustain seconds while another has headroom, "
        "move the deployment whose move relieves it most at the least cost (lower priority, "
        "slow-growing request rate, little added latency, its SLO kept) make-before-break; "
        "at most N such moves at once (default 0: off)",
    )
    p.add_argument(
        "--rebalance-hot-load",
        type=float,
        default=rebalance.hot_load,
        metavar="LOAD",
        help=f"a node is hot at this load, 0..1 (default {rebalance.hot_load:g})",
    )
    p.add_argument(
        "--rebalance-sustain",
        type=float,
        default=rebalance.sustain_s,
        metavar="SECONDS",
        help=f"for this long (default {rebalance.sustain_s:g})",
    )
    p.add_argument(
        "--rebalance-target-max-load",
        type=float,
        default=rebalance.target_max_load,
        metavar="LOAD",
        help="a target's load must have stayed at or under this "
        f"(default {rebalance.target_max_load:g})",
    )
    p.add_argument(
        "--rebalance-cooldown",
        type=float,
        default=rebalance.cooldown_s,
        metavar="SECONDS",
        help="a deployment that moved (for any reason) is not rebalanced, nor moved back, "
        f"sooner than this (default {rebalance.cooldown_s:g})",
    )
    p.set_defaults(func=_main)
    k = subparsers.add_parser("keygen", help="print a new API key for a client")
    k.add_argument("client_id")
    k.set_defaults(func=_keygen)


def _keygen(args: argparse.Namespace) -> int:
    try:
        print(new_api_key(args.client_id))
    except ValueError as err:
        print(f"offload keygen: {err}", file=sys.stderr)
        return 2
    return 0


def _main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as err:
        print(f"offload broker: {err}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(config))
    except (ClusterConfigError, StateError, OSError) as err:
        print(f"offload broker: {err}", file=sys.stderr)
        return 1
