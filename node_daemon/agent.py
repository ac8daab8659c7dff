"""The node agent's domain: replicas on this node, their GPUs, models and lifecycle.

Plain Python over a `Runtime`, a `ModelCache` and a `GpuAllocator`; the gRPC servicer in
`node_daemon.rpc` is a thin layer over it. Replica ids are `<deployment>-<epoch>`, so
starting the same deployment epoch twice is refused rather than run twice.

A replica is recorded (STARTING, holding its GPUs) before the runtime starts it, so every
process or container the node runs is in `list_replicas`, and so reconciled by the broker.
Its GPUs are released only once the runtime confirms it gone: a start that fails or is
cancelled (the caller's deadline) is stopped at once, and a replica the runtime cannot stop
stays listed (STOPPING, with the reason) holding its GPUs until a later stop succeeds.
Loops over the replicas iterate a snapshot and check, after each await, that the replica
they looked at is still the one recorded.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from common import replica_memory
from common.content import check_sha256
from common.inventory import Gpu, Inventory
from common.replica_memory import ModelMemory
from common.topology import Topology
from node_daemon.errors import (
    AlreadyExists,
    ClientsNotConfirmed,
    GpuShareTooSmall,
    InvalidRequest,
    ModelNotCached,
    NodeError,
    ReplicaNotFound,
    StartFailed,
    StopFailed,
    Unsupported,
)
from node_daemon.gpu_allocator import GpuAllocator
from node_daemon.inventory.errors import InventoryUnavailable
from node_daemon.model_cache import ModelCache
from node_daemon.resources import ResourceManager
from node_daemon.runtimes.base import (
    LimitUnavailable,
    Replica,
    ReplicaFailed,
    ReplicaSpec,
    ReplicaStatus,
    ResourceUpdateUnsupported,
    Runtime,
    uncancellable,
)
from node_daemon.telemetry import NodeSample, ReplicaInfo, Telemetry, clients_generation_of
from runtime.clients import (
    MAX_CLIENTS,
    MAX_GENERATION,
    POLL_INTERVAL_S,
    ClientEntry,
    check_unique,
    client_entry,
    format_clients,
)
from runtime.errors import quote
from runtime.metrics import CLIENTS_GENERATION
from runtime.pem import TlsIdentity

logger = logging.getLogger(__name__)

_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Sent by the replica's clients in an `authorization` header: printable ASCII only.
_TOKEN = re.compile(r"[!-~]{16,512}")

MAX_EPOCH = 2**53
"""Epochs count placements; 2^53 is exact in every JSON reader."""
MAX_GPUS = 1024
"""GPUs one replica may ask for (a count, or UUIDs)."""
MAX_CPUS = 1024.0
"""CPU cores one replica may ask for (the largest hosts have a few hundred)."""
MAX_MEMORY_MIB = 16 * 1024 * 1024
"""Host memory one replica may ask for: 16 TiB, in MiB."""
MAX_GPU_MEMORY_MIB = 1024 * 1024
"""A GPU memory share: 1 TiB, in MiB (today's largest GPUs have under 200 GiB)."""
MAX_PRIORITY = 3
"""Critical, the highest priority class."""
MAX_GRACE_MS = 3_600_000
"""The longest drain a stop may ask for."""
CLIENTS_CONFIRM_S = 5.0
"""How long `NodeAgent.set_replica_clients` waits, in all, for the replica to report the
clients file it wrote in effect (one metrics read may overrun it by `SCRAPE_TIMEOUT_S`)."""
CLIENTS_POLL_S = 0.005
"""How often it reads the replica's clients generation meanwhile (one small HTTP GET)."""


def next_generation(previous: int) -> int:
    """The generation of a replica's next clients file: the Unix time in microseconds, or
    `previous` + 1 when that is not later (two writes within a microsecond, a clock stepped
    back). Time-based so that a daemon restarted (which forgets `previous`) still writes a
    generation above those its predecessor wrote for a replica it adopts, unless the clock
    stepped back past them. Below 2^53 until the year 2255."""
    return min(MAX_GENERATION, max(previous + 1, time.time_ns() // 1000))


def check_number(field: str, value: float, low: float, high: float) -> None:
    """InvalidRequest naming `field` and its range unless `value` is finite and within it."""
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidRequest(f"{field} must be a finite number within {low}..{high}")


ClientFields = tuple[str, str, str, float]
"""One client of a shared replica as the broker sends it, unchecked: (client id, priority
class, token SHA-256, max requests per second)."""


def _client_entries(clients: Sequence[ClientFields]) -> tuple[ClientEntry, ...]:
    """`clients` checked (`runtime.clients.client_entry`, unique ids and token hashes, at
    most `MAX_CLIENTS`); InvalidRequest naming the first that is wrong otherwise."""
    if len(clients) > MAX_CLIENTS:
        raise InvalidRequest(f"clients has {len(clients)} entries; at most {MAX_CLIENTS}")
    entries = []
    for index, fields in enumerate(clients):
        try:
            entries.append(client_entry(*fields))
        except ValueError as err:
            raise InvalidRequest(f"clients[{index}]: {err}") from None
    try:
        check_unique(entries, lambda index: f"clients[{index}]")
    except ValueError as err:
        raise InvalidRequest(str(err)) from None
    return tuple(entries)


class ReplicaState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    EXITED = "exited"


@dataclass(frozen=True, slots=True)
class StartRequest:
    deployment_id: str
    epoch: int
    model_sha256: str
    model_name: str
    token: str
    gpu_uuids: tuple[str, ...] = ()
    gpu_count: int = 0
    gpu_memory_mib: int = 0
    p2p_required: bool = False
    cpus: float = 0.0
    memory_mib: int = 0
    warmup_inputs_sha256: str = ""
    background_start: bool = False
    """At background CPU priority until ready (`ReplicaSpec.background`)."""
    priority: int = 0
    """The deployment's priority class (0 standby .. 3 critical): the resource manager's
    weight."""
    cpus_min: float = 0.0
    cpus_max: float = 0.0
    """The CPU floor and ceiling the resource manager keeps (0: defaults, resolved at start:
    half of `cpus`, and the node's cores)."""

    @property
    def replica_id(self) -> str:
        return f"{self.deployment_id}-{self.epoch}"

    def cpu_bounds(self, node_cores: float) -> tuple[float, float]:
        """The CPU floor and ceiling, defaults resolved: half of `cpus`, and the node's
        cores (at least `cpus`)."""
        return self.cpus_min or self.cpus / 2, self.cpus_max or max(self.cpus, node_cores)

    def validate(self) -> None:
        """InvalidRequest naming the first field that is wrong and what it must be."""
        if not _ID.fullmatch(self.deployment_id):
            raise InvalidRequest(
                f"deployment_id {quote(self.deployment_id)} must be 1-40 characters of a-z, "
                "0-9 and '-', starting with a letter or digit"
            )
        check_number("epoch", self.epoch, 0, MAX_EPOCH)
        check_sha256(self.model_sha256, "model_sha256")
        if self.warmup_inputs_sha256:
            check_sha256(self.warmup_inputs_sha256, "warmup_inputs_sha256")
        if not _MODEL_NAME.fullmatch(self.model_name):
            raise InvalidRequest(
                f"model_name {quote(self.model_name)} must be 1-64 characters of letters, "
                "digits, '_', '.' and '-'"
            )
        if not _TOKEN.fullmatch(self.token):  # never quoted: it is a secret
            raise InvalidRequest("token must be 16-512 printable ASCII characters, no spaces")
        check_number("gpu_count", self.gpu_count, 0, MAX_GPUS)
        if len(self.gpu_uuids) > MAX_GPUS:
            raise InvalidRequest(
                f"gpu_uuids has {len(self.gpu_uuids)} entries; at most {MAX_GPUS} are allowed"
            )
        check_number("gpu_memory_mib", self.gpu_memory_mib, 0, MAX_GPU_MEMORY_MIB)
        check_number("cpus", self.cpus, 0, MAX_CPUS)
        check_number("memory_mib", self.memory_mib, 0, MAX_MEMORY_MIB)
        check_number("priority", self.priority, 0, MAX_PRIORITY)
        check_number("cpus_min", self.cpus_min, 0, MAX_CPUS)
        check_number("cpus_max", self.cpus_max, 0, MAX_CPUS)
        if self.cpus_max and self.cpus_min > self.cpus_max:
            raise InvalidRequest(
                f"cpus_min {self.cpus_min:g} must not exceed cpus_max {self.cpus_max:g}"
            )

    def labels(self, node_id: str, gpus: tuple[Gpu, ...]) -> dict[str, str]:
        """What the runtime keeps with the replica, enough to adopt it (never the token)."""
        return {
            "node": node_id,
            "deployment": self.deployment_id,
            "epoch": str(self.epoch),
            "model": self.model_name,
            "model-sha256": self.model_sha256,
            "gpus": ",".join(str(g.index) for g in gpus),
            "gpu-uuids": ",".join(g.uuid for g in gpus),
            "gpu-memory-mib": str(self.gpu_memory_mib),
            "cpus": str(self.cpus),
            "memory-mib": str(self.memory_mib),
            "priority": str(self.priority),
            "cpus-min": str(self.cpus_min),
            "cpus-max": str(self.cpus_max),
        }


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the node reports about one replica."""

    replica_id: str
    request: StartRequest
    """As started; the token is blanked."""
    gpus: tuple[int, ...]
    state: ReplicaState
    endpoint: str = ""
    runtime: str = ""
    ref: str = ""
    exit_code: int | None = None
    log_tail: str = ""
    metrics_endpoint: str = ""
    """host:port of its runtime's Prometheus metrics; empty when it serves none."""


class NodeAgent:
    def __init__(
        self,
        node_id: str,
        site: str,
        inventory: Inventory,
        runtime: Runtime,
        cache: ModelCache,
        host: str = "127.0.0.1",
        ready_timeout_s: float = 60.0,
        telemetry: Telemetry | None = None,
        read_gpus: Callable[[], tuple[Gpu, ...]] | None = None,
        replica_tls: TlsIdentity | None = None,
    ) -> None:
        """`replica_tls`: the node's certificate, key and CA; replicas serve TLS with the
        certificate (it names the node's address) and are probed with the CA. None:
        replicas serve plaintext (`--insecure`)."""
        self.node_id = node_id
        self.site = site
        self.inventory = inventory
        self.runtime = runtime
        self.cache = cache
        self.host = host
        self.ready_timeout_s = ready_timeout_s
        self.replica_tls = replica_tls
        self.topology = Topology.from_inventory(inventory)
        self.allocator = GpuAllocator(inventory, self.topology)
        self._replicas: dict[str, ReplicaView] = {}
        self._stopping: set[str] = set()
        """Replicas a `stop_replica` call is stopping now."""
        self._starts: dict[str, asyncio.Future[Replica]] = {}
        """The runtime's start of each STARTING replica (`stop_replica` cancels it)."""
        self.fetch_model: Callable[[str, bool], Awaitable[None]] | None = None
        """Set when the node has joined a broker: copies a model into the cache (the flag:
        for a background start, paced)."""
        self.resizer: ResourceManager | None = None
        """Set by the daemon: the node's resource manager (`node_daemon.resources`), which
        the broker link steps at every sample and whose resizes the heartbeat and `Usage`
        report; None: the node never resizes."""
        self.telemetry = telemetry or Telemetry()
        self.read_gpus = read_gpus
        """Reads the GPUs' live utilization and memory (NVML nodes; blocking, run in a
        thread); None: the inventory's, as read at startup (a topology-file node has no live
        GPU figures). Should it raise InventoryUnavailable, the sample carries the startup
        figures and a warning is logged (once, until it reads again)."""
        self._gpus_unreadable = False
        self._writing_clients: dict[str, asyncio.Lock] = {}
        """Per replica, one clients file written and confirmed at a time: a later call's
        set is the one left."""
        self._clients_generations: dict[str, int] = {}
        """Per replica, the generation of the last clients file written."""
        self._sampling = asyncio.Lock()
        """One sample at a time: the heartbeat's sampler and a `Usage` call may both take
        one, and the telemetry's differences need the readings in order."""

    async def adopt(self) -> list[ReplicaView]:
        """Take over the replicas with this node's label that survived a daemon restart."""
        adopted = []
        for replica in await self.runtime.adopt({"node": self.node_id}):
            try:
                view = self._view_from_labels(replica)
                self.allocator.restore(view.replica_id, view.gpus, view.request.gpu_memory_mib)
            except (KeyError, ValueError, NodeError) as err:
                logger.error(
                    "replica=%s cannot be adopted (%s): stopping it", replica.replica_id, err
                )
                await self.runtime.stop(replica.replica_id, grace_s=0)
                continue
            self._replicas[view.replica_id] = view
            adopted.append(view)
        await self.refresh()
        return [self._replicas[v.replica_id] for v in adopted]

    def _view_from_labels(self, replica: Replica) -> ReplicaView:
        labels = replica.labels
        request = StartRequest(
            deployment_id=labels["deployment"],
            epoch=int(labels["epoch"]),
            model_sha256=labels["model-sha256"],
            model_name=labels["model"],
            token="",
            gpu_uuids=tuple(u for u in labels.get("gpu-uuids", "").split(",") if u),
            gpu_memory_mib=int(labels.get("gpu-memory-mib", "0")),
            cpus=float(labels.get("cpus", "0")),
            memory_mib=int(labels.get("memory-mib", "0")),
            priority=int(labels.get("priority", "0")),
            cpus_min=float(labels.get("cpus-min", "0")),
            cpus_max=float(labels.get("cpus-max", "0")),
        )
        gpus = tuple(int(i) for i in labels.get("gpus", "").split(",") if i)
        state = ReplicaState.READY if replica.endpoint else ReplicaState.EXITED
        return ReplicaView(
            replica.replica_id,
            request,
            gpus,
            state,
            replica.endpoint,
            replica.runtime,
            replica.ref,
            metrics_endpoint=replica.metrics_endpoint,
        )

    async def start_replica(self, request: StartRequest) -> ReplicaView:
        """Start a replica and return once it is ready.

        InvalidRequest, ModelNotCached, GpusExhausted, AlreadyExists or StartFailed. Whatever
        ends a start early (an error, the caller's cancellation) stops what was started;
        its GPUs are released once the runtime confirms it gone (see the module docstring).

        GpuShareTooSmall before anything is allocated or started when the GPU memory share
        is below the model's need estimated from its file (`common.replica_memory`), and
        when the replica's ONNX Runtime arena ran out of its share while it loaded (instead
        of StartFailed with the arena's trace, which the node's log keeps). Unsupported,
        before anything starts, for a `memory_mib` the runtime cannot enforce here.
        """
        request.validate()
        replica_id = request.replica_id
        if replica_id in self._replicas:
            raise AlreadyExists(f"replica {replica_id} already exists on node {self.node_id}")
        model = await self._cached(request.model_sha256, request.background_start)
        warmup = None
        if request.warmup_inputs_sha256:
            warmup = await self._cached(request.warmup_inputs_sha256, request.background_start)
        memory = await self._check_share(request, model)
        # Checked again: another start of this replica may have begun while this one waited.
        if replica_id in self._replicas:
            raise AlreadyExists(f"replica {replica_id} already exists on node {self.node_id}")
        allocation = self.allocator.allocate(
            replica_id,
            count=request.gpu_count,
            uuids=request.gpu_uuids,
            memory_mib=request.gpu_memory_mib,
            p2p_required=request.p2p_required,
        )
        gpus = tuple(self.inventory.gpus[i] for i in allocation.gpus)
        floor, ceiling = request.cpu_bounds(self.telemetry.cpu_cores)
        shown = replace(
            request,
            token="",
            gpu_uuids=tuple(g.uuid for g in gpus),
            cpus_min=floor,
            cpus_max=ceiling,
        )
        starting = ReplicaView(replica_id, shown, allocation.gpus, ReplicaState.STARTING)
        self._replicas[replica_id] = starting
        spec = ReplicaSpec(
            replica_id=replica_id,
            model_path=model,
            model_name=request.model_name,
            token=request.token,
            labels=shown.labels(self.node_id, gpus),
            warmup_inputs=warmup,
            host=self.host,
            gpu_uuids=tuple(g.uuid for g in gpus),
            gpu_memory_mib=request.gpu_memory_mib,
            cpus=request.cpus,
            memory_mib=request.memory_mib,
            background=request.background_start,
            tls=self.replica_tls,
            priority=request.priority,
        )
        logger.info(
            "replica=%s starting model=%s gpus=%s%s",
            replica_id,
            request.model_name,
            allocation.gpus,
            " at background priority" if request.background_start else "",
        )
        start = asyncio.ensure_future(self.runtime.start(spec, self.ready_timeout_s))
        self._starts[replica_id] = start
        try:
            replica = await start
        except BaseException as err:
            await uncancellable(self._after_failed_start(starting, err))
            if isinstance(err, ReplicaFailed):
                raise self._start_failed(request, memory, err) from err
            if isinstance(err, LimitUnavailable):
                raise Unsupported(
                    f"{replica_memory.MEMORY_LIMIT_UNAVAILABLE}: memory_mib "
                    f"{request.memory_mib} asked, but {err}; deploy without memory_mib, or "
                    "on a node that can enforce it"
                ) from err
            task = asyncio.current_task()
            if start.cancelled() and task is not None and not task.cancelling():
                raise StartFailed(f"replica {replica_id} was stopped while it started") from err
            raise
        finally:
            del self._starts[replica_id]
        view = replace(
            starting,
            state=ReplicaState.READY,
            endpoint=replica.endpoint,
            runtime=replica.runtime,
            ref=replica.ref,
            metrics_endpoint=replica.metrics_endpoint,
        )
        self._replicas[replica_id] = view
        return view

    async def _check_share(self, request: StartRequest, model: Path) -> ModelMemory | None:
        """The model's estimated GPU memory need when the request asks for GPUs with a
        memory share (None otherwise, and when the file cannot be read as an ONNX model: its
        load says why); GpuShareTooSmall when the share is below it."""
        if not request.gpu_memory_mib or not (request.gpu_count or request.gpu_uuids):
            return None
        try:
            memory = await asyncio.to_thread(replica_memory.estimate, model)
        except (OSError, ValueError) as err:
            logger.warning("model=%s: its GPU memory need is unknown: %s", model.name, err)
            return None
        refusal = replica_memory.share_too_small(
            request.gpu_memory_mib, request.model_name, memory
        )
        if refusal is not None:
            raise GpuShareTooSmall(refusal)
        return memory

    @staticmethod
    def _start_failed(
        request: StartRequest, memory: ModelMemory | None, err: ReplicaFailed
    ) -> NodeError:
        """The error for a replica that failed by itself: GpuShareTooSmall when its arena ran
        out of its GPU memory share (the need measured then in the message, not the arena's
        trace), else StartFailed with its exit code and log tail."""
        ran_out = replica_memory.arena_ran_out(str(err))
        if request.gpu_memory_mib and ran_out is not None:
            return GpuShareTooSmall(
                replica_memory.share_ran_out(
                    request.gpu_memory_mib, request.model_name, ran_out, memory
                )
            )
        return StartFailed(str(err))

    async def _after_failed_start(self, starting: ReplicaView, err: BaseException) -> None:
        """Forget a replica whose start failed and free its GPUs, once the runtime confirms
        that nothing of it runs; otherwise keep it listed as STOPPING, holding its GPUs."""
        replica_id = starting.replica_id
        reason = "cancelled by the caller" if isinstance(err, asyncio.CancelledError) else err
        logger.error("replica=%s start failed: %s", replica_id, reason)
        try:
            status = await self.runtime.status(replica_id)
        except Exception:
            logger.exception("replica=%s: cannot tell whether it still runs", replica_id)
            status = ReplicaStatus(running=True)
        if self._replicas.get(replica_id) is not starting:
            return  # a StopReplica cancelled the start: it finishes the job
        if status is None:
            del self._replicas[replica_id]
            self.allocator.release(replica_id)
            return
        logger.error(
            "replica=%s could not be stopped: it stays listed, holding its GPUs", replica_id
        )
        self._replicas[replica_id] = replace(
            starting,
            state=ReplicaState.STOPPING,
            log_tail=f"its start failed and it could not be stopped: {reason}",
        )

    async def _cached(self, sha256: str, background: bool) -> Path:
        """The cached file; fetched from the broker first when this node has joined one
        (paced for a `background` start)."""
        try:
            return await asyncio.to_thread(self.cache.path, sha256)
        except ModelNotCached:
            if self.fetch_model is None:
                raise
        await self.fetch_model(sha256, background)
        return await asyncio.to_thread(self.cache.path, sha256)

    async def stop_replica(self, replica_id: str, grace_s: float) -> None:
        """Drain and remove the replica, then free its GPUs. ReplicaNotFound if unknown;
        StopFailed when the runtime cannot stop it (it stays listed, holding its GPUs, and a
        later call tries again). A replica still starting has its start cancelled. A stop,
        once begun, finishes even if the caller cancels."""
        view = self._replicas.get(replica_id)
        if view is None:
            raise ReplicaNotFound(f"no replica {quote(replica_id)} on node {self.node_id}")
        if (start := self._starts.get(replica_id)) is not None:
            # Cancelled, the start stops what it started and frees its GPUs once it is gone.
            start.cancel()
            await uncancellable(asyncio.wait([start]))
            view = self._replicas.get(replica_id)
            if view is None:
                return
        if replica_id in self._stopping:
            return  # another call is stopping it already
        self._stopping.add(replica_id)
        self._replicas[replica_id] = replace(view, state=ReplicaState.STOPPING)
        try:
            code = await uncancellable(self.runtime.stop(replica_id, grace_s))
        except ReplicaFailed as err:
            logger.error("replica=%s could not be stopped: %s", replica_id, err)
            self._replicas[replica_id] = replace(
                view, state=ReplicaState.STOPPING, log_tail=f"stopping it failed: {err}"
            )
            raise StopFailed(
                f"replica {replica_id} could not be stopped ({err}); it stays listed, holding "
                "its GPUs: retry"
            ) from err
        finally:
            self._stopping.discard(replica_id)
        self._replicas.pop(replica_id, None)
        self.allocator.release(replica_id)
        self._writing_clients.pop(replica_id, None)
        self._clients_generations.pop(replica_id, None)
        logger.info("replica=%s stopped exit_code=%s", replica_id, code)

    async def set_replica_clients(self, replica_id: str, clients: Sequence[ClientFields]) -> None:
        """Replace the clients replica `replica_id` takes (`runtime.clients`), and return
        once the replica has them in effect: its clients file is written atomically with a
        new generation (`next_generation`), the replica is told to read it
        (`Runtime.reload_clients`: SIGHUP), and its metrics page is polled until it reports
        that generation or a later one, `CLIENTS_CONFIRM_S` in all (a replica still starting
        is waited for within that bound).

        The whole set each call, so a repeated call changes nothing but the generation.
        InvalidRequest naming the first bad client (nothing written); ReplicaNotFound for a
        replica this node does not have or that no longer runs; ClientsNotConfirmed when
        the replica does not confirm in time, and Unsupported when it cannot (its runtime
        reports no generation: older than this node; it serves no metrics): in both the
        file stays written, and the replica takes it when it next reads it (its poll).
        Calls for one replica are applied one at a time, in the order they arrive, each
        confirmed before the next is written; those for different replicas do not wait for
        each other."""
        entries = _client_entries(clients)
        self._running_view(replica_id)
        async with self._writing_clients.setdefault(replica_id, asyncio.Lock()):
            generation = next_generation(self._clients_generations.get(replica_id, 0))
            self._clients_generations[replica_id] = generation
            started = time.monotonic()
            text = format_clients(entries, generation)
            if not await self.runtime.write_clients(replica_id, text):
                raise ReplicaNotFound(
                    f"replica {quote(replica_id)} on node {self.node_id} is not running"
                )
            if self.runtime.reads_clients:
                await self._confirm_clients(replica_id, generation)
        logger.info(
            "replica=%s clients=%d generation=%d in effect after %.1f ms",
            replica_id,
            len(entries),
            generation,
            (time.monotonic() - started) * 1000,
        )

    def _running_view(self, replica_id: str) -> ReplicaView:
        """The replica, READY or STARTING; ReplicaNotFound otherwise."""
        view = self._replicas.get(replica_id)
        if view is None:
            raise ReplicaNotFound(f"no replica {quote(replica_id)} on node {self.node_id}")
        if view.state not in (ReplicaState.READY, ReplicaState.STARTING):
            raise ReplicaNotFound(
                f"replica {quote(replica_id)} on node {self.node_id} is not running"
            )
        return view

    async def _confirm_clients(self, replica_id: str, generation: int) -> None:
        """Return once the replica reports clients `generation` or a later one in effect,
        telling it to read its file as soon as its page shows it handles the signal (see
        `set_replica_clients` for the errors)."""
        signalled = False
        try:
            async with asyncio.timeout(CLIENTS_CONFIRM_S):
                while True:
                    view = self._running_view(replica_id)
                    if view.state is ReplicaState.READY:
                        if not view.metrics_endpoint:
                            raise Unsupported(
                                f"replica {replica_id} serves no metrics, so it cannot confirm "
                                "its clients: its clients file is written, and it reads it "
                                f"within {POLL_INTERVAL_S:g} s"
                            )
                        page = await self.telemetry.read_page(
                            replica_id, view.metrics_endpoint, (CLIENTS_GENERATION,)
                        )
                        if page is not None:
                            reported = clients_generation_of(page)
                            if reported is None:
                                raise Unsupported(
                                    f"replica {replica_id} runs a runtime that reports no "
                                    "clients generation (older than this node), so it cannot "
                                    "confirm its clients: its clients file is written, and it "
                                    f"reads it within {POLL_INTERVAL_S:g} s"
                                )
                            if reported >= generation:
                                return
                            if not signalled:
                                # Only now: the page shows a runtime that handles the signal.
                                signalled = True
                                await self.runtime.reload_clients(replica_id)
                    await asyncio.sleep(CLIENTS_POLL_S)
        except TimeoutError:
            raise ClientsNotConfirmed(
                f"replica {replica_id} on node {self.node_id} did not confirm its clients "
                f"(generation {generation}) within {CLIENTS_CONFIRM_S:g} s; its clients file "
                "is written, and it takes them when it next reads it"
            ) from None

    async def refresh(self) -> list[ReplicaView]:
        """Check every ready replica; one that died becomes EXITED (exit code, log tail)
        and its GPUs are freed. Returns the replicas that died since the last check."""
        died = []
        for replica_id, view in list(self._replicas.items()):
            if view.state is not ReplicaState.READY:
                continue
            status = await self.runtime.status(replica_id)
            if status is None or status.running or self._replicas.get(replica_id) is not view:
                continue
            exited = replace(
                view,
                state=ReplicaState.EXITED,
                exit_code=status.exit_code,
                log_tail=status.log_tail,
            )
            self._replicas[replica_id] = exited
            self.allocator.release(replica_id)
            died.append(exited)
            logger.error(
                "replica=%s died exit_code=%s; log tail:\n%s",
                replica_id,
                status.exit_code,
                status.log_tail,
            )
        return died

    async def list_replicas(self) -> list[ReplicaView]:
        await self.refresh()
        return sorted(self._replicas.values(), key=lambda v: v.replica_id)

    async def resize(self, replica_id: str, cpus: float) -> None:
        """Set a replica's CPU quota (the resource manager's change); Unsupported where the
        runtime cannot."""
        await self.update_resources(replica_id, cpus, 0)

    async def update_resources(self, replica_id: str, cpus: float, memory_mib: int) -> None:
        view = self._replicas.get(replica_id)
        if view is None:
            raise ReplicaNotFound(f"no replica {quote(replica_id)} on node {self.node_id}")
        check_number("cpus", cpus, 0, MAX_CPUS)
        check_number("memory_mib", memory_mib, 0, MAX_MEMORY_MIB)
        if cpus == 0 and memory_mib == 0:
            raise InvalidRequest("give a positive cpus and/or memory_mib")
        try:
            await self.runtime.update(replica_id, cpus, memory_mib)
        except ResourceUpdateUnsupported as err:
            raise Unsupported(str(err)) from err
        except ReplicaFailed as err:
            raise StartFailed(str(err)) from err
        current = self._replicas.get(replica_id)
        if current is None:
            return  # stopped meanwhile
        request = replace(
            current.request,
            cpus=cpus or current.request.cpus,
            memory_mib=memory_mib or current.request.memory_mib,
        )
        self._replicas[replica_id] = replace(current, request=request)

    async def recent_usage(self, max_age_s: float = 5.0) -> NodeSample:
        """The latest sample (the heartbeat's sampler takes one every interval) if it is at
        most `max_age_s` old, else a new one: a reader does not shorten the sampler's
        interval."""
        latest = self.telemetry.latest
        if latest is not None and time.time() - latest.at <= max_age_s:
            return latest
        return await self.usage()

    async def usage(self) -> NodeSample:
        """A sample of the node and its ready replicas (`node_daemon.telemetry`): CPU, its
        quota and throttling, memory, and request figures, over the interval since the last
        call; GPUs as `read_gpus` reads them now (else as at startup)."""
        async with self._sampling:
            return await self._sample()

    async def _sample(self) -> NodeSample:
        ready = [v for v in list(self._replicas.values()) if v.state is ReplicaState.READY]
        stats = await asyncio.gather(*(self.runtime.stats(v.replica_id) for v in ready))
        gpus = await self._read_gpus()
        infos = []
        for v in ready:
            floor, ceiling = v.request.cpu_bounds(self.telemetry.cpu_cores)
            infos.append(
                ReplicaInfo(
                    replica_id=v.replica_id,
                    deployment_id=v.request.deployment_id,
                    priority=v.request.priority,
                    cpus=v.request.cpus,
                    cpus_min=floor,
                    cpus_max=ceiling,
                    metrics_endpoint=v.metrics_endpoint,
                )
            )
        return await self.telemetry.sample(list(zip(infos, stats, strict=True)), gpus)

    async def _read_gpus(self) -> tuple[Gpu, ...]:
        if self.read_gpus is None:
            return self.inventory.gpus
        try:
            gpus = await asyncio.to_thread(self.read_gpus)
        except InventoryUnavailable as err:
            if not self._gpus_unreadable:
                logger.warning(
                    "node=%s: the GPUs' live figures cannot be read (%s); reporting those "
                    "read at startup until they can",
                    self.node_id,
                    err,
                )
            self._gpus_unreadable = True
            return self.inventory.gpus
        if self._gpus_unreadable:
            logger.info("node=%s: the GPUs' live figures are read again", self.node_id)
            self._gpus_unreadable = False
        return gpus

    async def close(self, stop_replicas: bool) -> None:
        """Stop every replica, or leave them serving for the next daemon to adopt."""
        await self.telemetry.close()
        if stop_replicas:
            await self.runtime.close()
        else:
            await self.runtime.detach()
