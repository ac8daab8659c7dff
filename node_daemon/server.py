"""The node daemon: `offload node --listen ADDR --site SITE ...` serving `offload.v1.NodeAgent`.

Start-up: read the inventory, connect the runtime, adopt the replicas an earlier daemon of
this node left running, then listen. A background loop notices replicas that die. SIGTERM or
SIGINT stops listening and, by default, leaves the replicas serving for the next daemon
(`--stop-replicas-on-exit` stops them instead).

With `--tls-cert/--tls-key/--tls-ca` (a certificate for this node: its common name is the
node id, its names the addresses the broker dials) NodeAgent serves mutual TLS (callers
present a certificate signed by the CA: the broker does), and the node joins the broker's
`--node-listen` port with the same certificate. A plaintext listener that other hosts can
reach needs `--insecure`.

NodeAgent takes calls from the broker only. With `--broker`, the node keeps a node secret in
its state dir (`<state-dir>/node-secret`, 0600; `common.node_identity`) that binds its node
id at the broker; without TLS the broker shows the same secret as NodeAgent's bearer token,
and with TLS NodeAgent takes only a certificate with the broker role (`offload certs issue
--role broker`). A node without `--broker` takes `--agent-token-file`'s token.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.brokers import parse_broker_addresses
from common.certs import TlsIdentity, add_tls_arguments, identity_from_args
from common.node_identity import load_or_create_secret
from common.private_files import private_dir, read_secret
from images.build import runtime_image_tag
from node_daemon.agent import NodeAgent
from node_daemon.broker_link import SAMPLE_INTERVAL_S, BrokerLink
from node_daemon.inventory import (
    GpuSpec,
    Inventory,
    InventoryError,
    NvmlInventory,
    NvmlLiveGpus,
    TopologyFileInventory,
    cpu_only_inventory,
)
from node_daemon.model_cache import DEFAULT_MAX_BYTES, ModelCache
from node_daemon.resources import POLICIES, ResourceManager
from node_daemon.rpc.auth import AgentTokenInterceptor, BrokerCertificateInterceptor
from node_daemon.rpc.servicer import NodeAgentServicer
from node_daemon.runtimes import DockerRuntime, ProcessRuntime, Runtime, RuntimeUnavailable
from node_daemon.runtimes.cgroup_limits import MAX_SHARES, REPLICAS_PARENT
from protos.offload.v1 import node_pb2_grpc as pb_grpc
from runtime.rpc.status import MalformedRequests
from runtime.tls import check_listener, is_loopback, listen, server_credentials

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class NodeSettings:
    listen: str
    """host:port for the NodeAgent service; port 0 picks a free one (logged)."""
    site: str
    node_id: str
    state_dir: Path
    """models/ (the cache) and replicas/ (process replicas' folders) live here."""
    topology_file: Path | None = None
    gpu_spec: GpuSpec | None = None
    nvml: bool = False
    runtime: str = "auto"
    """"docker", "process", or "auto" (Docker when an engine is reachable)."""
    network: str = "bridge"
    advertise_host: str = ""
    """The address replicas are published on; default: the --listen host (127.0.0.1 for
    a wildcard)."""
    agent_token: str = ""
    """When set, every NodeAgent call needs `authorization: Bearer <token>` (a node without
    `broker`; one with a broker takes its node secret instead)."""
    broker: str = ""
    """host:port of the broker's NodeRegistry to join, or several, comma-separated (brokers
    sharing one state: the node follows the leader); empty: a standalone node."""
    join_token: str = ""
    image: str = ""
    max_model_bytes: int = DEFAULT_MAX_BYTES
    stop_replicas_on_exit: bool = False
    monitor_interval_s: float = 2.0
    ready_timeout_s: float = 60.0
    resize_policy: str = "static"
    """How the node re-divides its CPU among its replicas (`node_daemon.resources`)."""
    cpuset: frozenset[int] = frozenset()
    """The CPUs replicas (and the daemon) run on; empty: all this process may use. The node
    offers as many cores as it has CPUs here."""
    tls: TlsIdentity | None = None
    """This node's certificate, key and CA: NodeAgent serves mutual TLS, the link to the
    broker presents the certificate. None: plaintext."""
    insecure: bool = False
    """Plaintext allowed on an address other hosts can reach (`--insecure`)."""
    background_fetch_mb_s: float = 0.0
    """The average rate, in MB/s, a background start's model is fetched from the broker at;
    0: as fast as it comes."""
    sample_interval_s: float = SAMPLE_INTERVAL_S
    """How often the usage sample goes to the broker when it has not changed (a broker with
    leases; `BrokerLink`); a changed one goes at once."""
    replica_shares: int = 0
    """Docker: the CPU weight of the cgroup all replicas' containers are created in (v1
    `cpu.shares` units); 0: the engine's default group."""

    @property
    def replica_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        host = self.listen.rpartition(":")[0].strip("[]")
        return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def read_inventory(settings: NodeSettings) -> Inventory:
    """Blocking. InventoryError or OSError when the chosen source cannot be read."""
    if settings.topology_file is not None:
        assert settings.gpu_spec is not None
        return TopologyFileInventory(settings.topology_file, settings.gpu_spec).read()
    if settings.nvml:
        return NvmlInventory().read()
    return cpu_only_inventory()


def connect_runtime(settings: NodeSettings, inventory: Inventory) -> Runtime:
    """Blocking. RuntimeUnavailable when `--runtime docker` cannot be had."""
    cpuset = format_cpuset(settings.cpuset)
    if settings.runtime in ("docker", "auto"):
        image = settings.image or runtime_image_tag("cpu")
        gpu_image = None
        if inventory.gpus and not settings.image:
            gpu_image = runtime_image_tag("cuda")
        try:
            try:
                return DockerRuntime.connect(
                    image, settings.network, gpu_image, cpuset, settings.replica_shares
                )
            except RuntimeUnavailable:
                if gpu_image is None:
                    raise
                logger.warning("no %s image here: GPU replicas will run %s", gpu_image, image)
                return DockerRuntime.connect(
                    image, settings.network, cpuset=cpuset, replica_shares=settings.replica_shares
                )
        except RuntimeUnavailable as err:
            if settings.runtime == "docker":
                raise
            logger.warning(
                "Docker is not usable (%s). Running replicas as local processes instead: "
                "no isolation, no resource limits.",
                err,
            )
    return ProcessRuntime(workdir=settings.state_dir / "replicas", cpuset=settings.cpuset)


async def start_node(
    settings: NodeSettings, node_secret: str | None = None
) -> tuple[grpc.aio.Server, int, NodeAgent]:
    """Read the inventory, connect the runtime, adopt surviving replicas, and listen.
    NodeAgent takes calls from the broker only: with TLS, a broker certificate; without,
    `node_secret` (a node joined to a broker) or else `settings.agent_token` as the bearer
    token; neither: no check (a loopback listener, `settings_from_args` sees to it)."""
    if settings.cpuset:
        # The daemon's own work (sampling, probes) stays on the node's CPUs too; replicas
        # are pinned by their runtime (a process's threads, a container's cpuset).
        os.sched_setaffinity(0, settings.cpuset)
    inventory = await asyncio.to_thread(read_inventory, settings)
    # Clients' models, replicas' tokens and logs: this user's only, whatever the umask.
    await asyncio.to_thread(private_dir, settings.state_dir)
    runtime = await asyncio.to_thread(connect_runtime, settings, inventory)
    cache = await asyncio.to_thread(
        ModelCache,
        settings.state_dir / "models",
        settings.max_model_bytes,
        runtime.model_file_mode,
    )
    agent = NodeAgent(
        settings.node_id,
        settings.site,
        inventory,
        runtime,
        cache,
        host=settings.replica_host,
        ready_timeout_s=settings.ready_timeout_s,
        read_gpus=NvmlLiveGpus(inventory.gpus).read if settings.nvml else None,
        replica_tls=settings.tls,
    )
    agent.resizer = ResourceManager(settings.resize_policy, agent.resize)
    adopted = await agent.adopt()
    logger.info(
        "node=%s site=%s runtime=%s gpus=%d adopted=%d replica(s): %s",
        settings.node_id,
        settings.site,
        runtime.name,
        len(inventory.gpus),
        len(adopted),
        ", ".join(f"{v.replica_id} ({v.state})" for v in adopted) or "-",
    )
    interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequests()]
    if settings.tls is not None:
        interceptors.append(BrokerCertificateInterceptor())
    # With TLS and a broker the certificate is the proof: a broker that restarted knows the
    # node secret only from the node's next heartbeat, and may call before it.
    token = settings.agent_token or (node_secret if settings.tls is None else None)
    if token:
        interceptors.append(AgentTokenInterceptor(token))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    pb_grpc.add_NodeAgentServicer_to_server(NodeAgentServicer(agent), server)
    tls = settings.tls
    try:
        port = listen(
            server,
            settings.listen,
            server_credentials(tls, require_client_cert=True) if tls else None,
        )
    except OSError:
        await agent.close(stop_replicas=False)
        raise
    await server.start()
    logger.info(
        "node agent listening on %s:%d%s",
        settings.listen.rpartition(":")[0],
        port,
        " (mutual TLS)" if tls else "",
    )
    return server, port, agent


async def _monitor(agent: NodeAgent, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await agent.refresh()


async def _guard(name: str, coro: Awaitable[None], stop: asyncio.Event) -> None:
    """Run a loop that should never end; if it does (or fails), say so loudly and stop."""
    try:
        await coro
        logger.error("%s ended unexpectedly: stopping the daemon", name)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.ALREADY_EXISTS:
            logger.error(
                "this node cannot join the broker: %s. Stopping the daemon", err.details()
            )
        else:
            logger.error(
                "%s failed: %s %s; stopping the daemon", name, err.code().name, err.details()
            )
    stop.set()


async def serve(settings: NodeSettings) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node_secret = None
    if settings.broker:
        await asyncio.to_thread(private_dir, settings.state_dir)
        try:
            node_secret = await asyncio.to_thread(load_or_create_secret, settings.state_dir)
        except ValueError as err:
            logger.error("%s", err)
            return 1
    server, port, agent = await start_node(settings, node_secret)
    link = None
    if settings.broker:
        link = BrokerLink(
            settings.broker,
            settings.join_token,
            agent,
            f"{settings.replica_host}:{port}",
            settings.tls,
            background_fetch_bytes_per_s=settings.background_fetch_mb_s * 1e6,
            node_secret=node_secret or "",
            sample_interval_s=settings.sample_interval_s,
        )
        agent.fetch_model = link.fetch_model
    failed = False
    try:
        async with asyncio.TaskGroup() as tasks:
            loops = [
                tasks.create_task(
                    _guard("replica monitor", _monitor(agent, settings.monitor_interval_s), stop),
                    name="replica-monitor",
                )
            ]
            if link is not None:
                loops.append(
                    tasks.create_task(_guard("broker link", link.run(), stop), name="broker-link")
                )
            await stop.wait()
            failed = any(task.done() for task in loops)
            for task in loops:
                task.cancel()
    finally:
        if link is not None:
            await link.close()
        logger.info(
            "stopping: %s replicas", "stopping" if settings.stop_replicas_on_exit else "keeping"
        )
        await server.stop(5.0)
        await agent.close(stop_replicas=settings.stop_replicas_on_exit)
    return 1 if failed else 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "node",
        help="run a node daemon: GPU inventory, replicas, the NodeAgent service",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--listen", required=True, help="host:port for NodeAgent (port 0: any)")
    p.add_argument("--site", required=True, help="the edge site this node is at")
    p.add_argument("--node-id", default=socket.gethostname().lower(), help="default: hostname")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--topology-file", type=Path, help="a `nvidia-smi topo -m` capture (needs --gpu-spec)"
    )
    source.add_argument("--nvml", action="store_true", help="read the GPUs through NVML")
    source.add_argument("--no-gpu", action="store_true", help="a CPU-only node (the default)")
    p.add_argument(
        "--gpu-spec",
        metavar="NAME:MIB",
        help="with --topology-file: every GPU's model and memory, e.g. A100:81920",
    )
    p.add_argument(
        "--runtime",
        choices=["auto", "docker", "process"],
        default="auto",
        help="auto: Docker when an engine is reachable, else local processes",
    )
    p.add_argument(
        "--network",
        choices=["bridge", "host"],
        default="bridge",
        help="Docker replicas: published port (bridge) or host networking",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        help="model cache and replica folders (default ~/.local/state/edge-offload/<node-id>)",
    )
    p.add_argument(
        "--advertise-host",
        default="",
        help="address replicas are published on (default: the --listen host)",
    )
    p.add_argument(
        "--agent-token-file",
        type=Path,
        help="a node without --broker: require this bearer token on every NodeAgent call "
        "(needed unless --listen is a loopback address); a node with --broker takes the "
        "node secret the broker shows instead",
    )
    p.add_argument(
        "--broker",
        default="",
        help="host:port of the broker to join (its --node-listen port when it serves TLS); "
        "several, comma-separated, for brokers sharing one PostgreSQL state: the node "
        "follows whichever leads",
    )
    add_tls_arguments(
        p,
        "the broker's certificate must chain to, and NodeAgent's callers' (the broker's) "
        "certificates too",
    )
    p.add_argument(
        "--join-token-file",
        type=Path,
        help="the cluster's join token (with --broker)",
    )
    p.add_argument("--image", default="", help="runtime image (default: the cpu/cuda builds)")
    p.add_argument("--max-model-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument(
        "--resize-policy",
        choices=POLICIES,
        default="static",
        help="how the node re-divides its CPU among its replicas while they run, every "
        "heartbeat interval, each within its floor and ceiling (cpus_min, cpus_max): static "
        "never changes a replica's CPU; usage gives each its measured demand (more when its "
        "quota throttles it), by priority when the cores run short (DeepRes); gain hands "
        "cores to the replica that gains most per core (FlowCon). Needs a broker (the "
        "sampling runs with the heartbeat) and replicas started with cpus > 0 (default static)",
    )
    p.add_argument(
        "--cpuset",
        default="",
        metavar="CPUS",
        help="run replicas (and this daemon) on these CPUs only, e.g. 0-3,8 (Docker's "
        "--cpuset-cpus syntax); the node offers as many cores as it has CPUs here, which is "
        "what its load is measured against (default: every CPU this process may use)",
    )
    p.add_argument(
        "--background-fetch-rate",
        type=float,
        default=0.0,
        metavar="MB/S",
        help="fetch the model of a replica started at background priority (the target of a "
        "make-before-break migration) at this average rate, so that its copy from the broker "
        "does not take a core from the replicas serving beside it; 0: as fast as it comes "
        "(default 0)",
    )
    p.add_argument(
        "--sample-interval",
        type=float,
        default=SAMPLE_INTERVAL_S,
        metavar="SECONDS",
        help="send the broker this node's usage sample this often when it has not changed; a "
        "changed one (a replica's CPU, memory or request rate, a GPU's use, the replicas "
        "themselves) goes at once, and between samples a small lease renewal keeps the node "
        "live. Shorter: the broker's load figures and charts are fresher, at a heartbeat's "
        f"cost each (default {SAMPLE_INTERVAL_S:g}; a broker from before leases gets a full "
        "heartbeat every interval it asks for regardless)",
    )
    p.add_argument(
        "--replica-cpu-shares",
        type=int,
        default=0,
        metavar="N",
        help="Docker runtime: create the replicas' containers in a cgroup of their own, "
        f"/{REPLICAS_PARENT}, that weighs N (cgroup v1 cpu.shares; a thread of the root "
        "cgroup weighs 1024) against the host's daemons, so that the engine's and this "
        "daemon's work on a replica's start does not take the CPU from the replicas serving; "
        "needs root and the engine's cgroupfs driver on this host; 0: the engine's default "
        "group (default 0)",
    )
    p.add_argument(
        "--stop-replicas-on-exit",
        action="store_true",
        help="stop replicas when the daemon exits (default: they keep serving)",
    )
    p.set_defaults(func=_main)


def _replica_shares(shares: int, runtime: str) -> int:
    if shares and not 2 <= shares <= MAX_SHARES:
        raise ValueError(f"--replica-cpu-shares {shares}: give 2 to {MAX_SHARES}, or 0")
    if shares and runtime == "process":
        raise ValueError("--replica-cpu-shares weighs Docker containers, not --runtime process")
    return shares


def _sample_interval(seconds: float) -> float:
    if not math.isfinite(seconds) or not 0.05 <= seconds <= 3600:
        raise ValueError(f"--sample-interval {seconds!r}: give seconds, 0.05 to 3600")
    return seconds


def _fetch_rate(mb_s: float) -> float:
    if not math.isfinite(mb_s) or mb_s < 0:
        raise ValueError(f"--background-fetch-rate {mb_s!r}: give MB/s, 0 or more")
    return mb_s


def settings_from_args(args: argparse.Namespace) -> NodeSettings:
    """Validated settings; ValueError saying which flag is wrong."""
    if args.topology_file is not None and not args.gpu_spec:
        raise ValueError("--topology-file needs --gpu-spec NAME:MIB (what the capture omits)")
    if args.gpu_spec and args.topology_file is None:
        raise ValueError("--gpu-spec only goes with --topology-file")
    _host, colon, port = args.listen.rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"--listen {args.listen!r} is not host:port")
    join_token = ""
    if bool(args.broker) != (args.join_token_file is not None):
        raise ValueError("--broker and --join-token-file go together")
    if args.broker:
        parse_broker_addresses(args.broker)
    if args.join_token_file is not None:
        join_token = read_secret(args.join_token_file, "--join-token-file")
    token = ""
    if args.agent_token_file is not None:
        if args.broker:
            raise ValueError(
                "--agent-token-file is for a node without --broker: a node that joins a "
                "broker takes the node secret the broker shows (its state dir's node-secret)"
            )
        token = read_secret(args.agent_token_file, "--agent-token-file")
    elif not args.broker and not is_loopback(args.listen):
        raise ValueError(
            f"--listen {args.listen} is reachable from other hosts: give --agent-token-file "
            "so that only the broker can start containers here"
        )
    if args.max_model_bytes <= 0:
        raise ValueError("--max-model-bytes must be positive")
    tls = identity_from_args(args)
    check_listener("--listen", args.listen, tls is not None, args.insecure)
    if args.resize_policy != "static" and not args.broker:
        # The node samples its replicas at the broker's heartbeat interval; a standalone
        # node takes no samples to resize from.
        raise ValueError(f"--resize-policy {args.resize_policy} needs --broker")
    state_dir = args.state_dir or (
        Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
        / "edge-offload"
        / args.node_id
    )
    return NodeSettings(
        listen=args.listen,
        site=args.site,
        node_id=args.node_id,
        state_dir=state_dir,
        topology_file=args.topology_file,
        gpu_spec=GpuSpec.parse(args.gpu_spec) if args.gpu_spec else None,
        nvml=args.nvml,
        runtime=args.runtime,
        network=args.network,
        advertise_host=args.advertise_host,
        agent_token=token,
        broker=args.broker,
        join_token=join_token,
        image=args.image,
        max_model_bytes=args.max_model_bytes,
        stop_replicas_on_exit=args.stop_replicas_on_exit,
        cpuset=parse_cpuset(args.cpuset),
        resize_policy=args.resize_policy,
        tls=tls,
        insecure=args.insecure,
        background_fetch_mb_s=_fetch_rate(args.background_fetch_rate),
        sample_interval_s=_sample_interval(args.sample_interval),
        replica_shares=_replica_shares(args.replica_cpu_shares, args.runtime),
    )


def split_cpus(cpus: Iterable[int], parts: int) -> list[frozenset[int]]:
    """`cpus` in `parts` runs of consecutive CPUs, lowest first, as even as possible (the
    first runs one larger): the CPUs of nodes that must not share cores, as separate
    machines do not, on one host. ValueError when there are fewer CPUs than parts."""
    ordered = sorted(set(cpus))
    if parts < 1 or len(ordered) < parts:
        raise ValueError(f"{len(ordered)} CPU(s) cannot be split in {parts}")
    size, larger = divmod(len(ordered), parts)
    runs, start = [], 0
    for index in range(parts):
        end = start + size + (index < larger)
        runs.append(frozenset(ordered[start:end]))
        start = end
    return runs


def format_cpuset(cpus: Iterable[int]) -> str:
    """CPUs as `parse_cpuset` reads them and Docker's --cpuset-cpus takes them ("0,1,2")."""
    return ",".join(map(str, sorted(cpus)))


def parse_cpuset(text: str) -> frozenset[int]:
    """CPUs as Docker's --cpuset-cpus writes them ("0-3,8"); ValueError naming the flag for
    bad text or a CPU this process may not use."""
    if not text:
        return frozenset()
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, dash, high = part.partition("-")
            first, last = int(low), int(high) if dash else int(low)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"--cpuset {text!r} is not a CPU list like 0-3,8") from None
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(
            f"--cpuset {text!r} names CPUs this process may not use: "
            f"{sorted(cpus - allowed)} (it may use {sorted(allowed)})"
        )
    return frozenset(cpus)


def _main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except (ValueError, OSError) as err:
        print(f"offload node: {err}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(settings))
    except (InventoryError, RuntimeUnavailable, OSError) as err:
        print(f"offload node: {err}", file=sys.stderr)
        return 1
