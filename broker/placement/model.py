"""Placement's domain values: what a node offers, what a deployment asks, what was decided.

Plain frozen values, no I/O. GPUs are named by their index on the node (`Gpu.index`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from common.topology import Topology


class PriorityClass(enum.IntEnum):
    """A deployment's priority; only a strictly higher class may preempt a lower one."""

    STANDBY = 0
    """The broker's own pre-warmed standby replicas (`broker.prewarm`): any deployment
    preempts them; clients cannot ask for it."""
    BEST_EFFORT = 1
    STANDARD = 2
    CRITICAL = 3


class Strategy(enum.StrEnum):
    """How a deployment wants to sit among others (the `balance` score term)."""

    PACK = "pack"
    """Fill nodes that are in use, keep whole nodes and whole GPU groups free."""
    SPREAD = "spread"
    """Prefer the emptiest nodes, even if that breaks whole groups."""


def parse_cuda(version: str) -> tuple[int, ...]:
    """ "12.4" -> (12, 4). ValueError when it is not dot-separated numbers."""
    parts = version.strip().split(".")
    if not version.strip() or not all(p.isdigit() for p in parts):
        raise ValueError(f"a CUDA version is numbers separated by dots (12.4), not {version!r}")
    return tuple(int(p) for p in parts)


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one deployment holds on a node."""

    deployment_id: str
    priority: PriorityClass
    gpus: tuple[int, ...]
    """GPU indices; empty for a CPU-only replica."""
    memory_mib: int = 0
    """MiB of each GPU's memory, as a share; 0 when the GPUs are held whole."""


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One node as placement sees it at one moment.

    A GPU is in one of three states: free (in `free`), shared (a key of `shared_mib`: memory
    shares use part of it, and it can take more shares that fit), or held whole (neither).
    `allocations` are the holdings the broker knows; usage it does not know (reported by the
    node) may make more GPUs busy than they explain, never fewer. ValueError when the fields
    contradict each other or the topology.
    """

    node_id: str
    site: str
    """The edge site the node sits at (a site of the broker's `EdgeNetwork`)."""
    topology: Topology
    free: frozenset[int]
    """GPUs nobody holds, whole or shared."""
    shared_mib: Mapping[int, int] = field(default_factory=dict)
    """GPU index -> MiB of its memory held by memory shares (> 0); GPUs not listed have none."""
    allocations: tuple[Allocation, ...] = ()
    ready: bool = True
    """Registered, heartbeating and not draining: placement may use it."""
    runtimes: frozenset[str] = frozenset({"docker"})
    """Replica runtimes the node offers ("docker", "process")."""
    cuda_version: str = ""
    """Highest CUDA version the driver supports, "12.4" style; "" when unknown."""
    load: float = 0.0
    """How busy the node is, 0 (idle) to 1 (saturated), as its heartbeat reports."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shared_mib", MappingProxyType(dict(self.shared_mib)))
        memory = {gpu.index: gpu.memory_total_mib for gpu in self.topology.inventory.gpus}
        where = f"node {self.node_id}"
        if not self.free <= memory.keys():
            raise ValueError(f"{where}: free GPU(s) {sorted(self.free - memory.keys())} unknown")
        for index, mib in self.shared_mib.items():
            if index not in memory or not 0 < mib <= memory[index]:
                raise ValueError(f"{where}: share of {mib} MiB on GPU{index} is impossible")
            if index in self.free:
                raise ValueError(f"{where}: GPU{index} is both free and shared")
        if not 0.0 <= self.load <= 1.0 or math.isnan(self.load):
            raise ValueError(f"{where}: load must be within 0..1, not {self.load}")
        if self.cuda_version:
            parse_cuda(self.cuda_version)
        ids = [a.deployment_id for a in self.allocations]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{where}: a deployment holds two allocations")
        in_shares: dict[int, int] = {}
        for allocation in self.allocations:
            for index in allocation.gpus:
                if index not in memory:
                    raise ValueError(
                        f"{where}: {allocation.deployment_id} holds unknown GPU{index}"
                    )
                if allocation.memory_mib:
                    in_shares[index] = in_shares.get(index, 0) + allocation.memory_mib
                elif index in self.free or index in self.shared_mib:
                    raise ValueError(
                        f"{where}: {allocation.deployment_id} holds GPU{index} whole, "
                        "but it is free or shared"
                    )
        over = [i for i, mib in in_shares.items() if mib > self.shared_mib.get(i, 0)]
        if over:
            raise ValueError(f"{where}: shares on GPU(s) {over} exceed shared_mib")

    @classmethod
    def idle(
        cls,
        node_id: str,
        site: str,
        topology: Topology,
        *,
        ready: bool = True,
        runtimes: Iterable[str] = ("docker",),
        cuda_version: str = "",
        load: float = 0.0,
    ) -> NodeSnapshot:
        """A node with every GPU free and nothing on it."""
        return cls(
            node_id=node_id,
            site=site,
            topology=topology,
            free=frozenset(gpu.index for gpu in topology.inventory.gpus),
            ready=ready,
            runtimes=frozenset(runtimes),
            cuda_version=cuda_version,
            load=load,
        )

    @property
    def gpu_count(self) -> int:
        return len(self.topology.inventory.gpus)

    def with_allocation(self, allocation: Allocation) -> NodeSnapshot:
        """This node holding `allocation` too. ValueError when it does not fit (a whole GPU
        that is not free, a share that exceeds the GPU's memory) or its id is here already."""
        return self.with_allocations((allocation,))

    def with_allocations(self, allocations: Iterable[Allocation]) -> NodeSnapshot:
        """This node holding each of `allocations` too, in order (one new snapshot, however
        many): ValueError as `with_allocation`."""
        free = set(self.free)
        shared = dict(self.shared_mib)
        memory = {gpu.index: gpu.memory_total_mib for gpu in self.topology.inventory.gpus}
        added = tuple(allocations)
        for allocation in added:
            for index in allocation.gpus:
                if allocation.memory_mib == 0:
                    if index not in free:
                        raise ValueError(f"node {self.node_id}: GPU{index} is not free")
                    free.discard(index)
                    continue
                used = shared.get(index, 0)
                if (index not in free and used == 0) or used + allocation.memory_mib > memory.get(
                    index, 0
                ):
                    raise ValueError(
                        f"node {self.node_id}: no room for {allocation.memory_mib} MiB on "
                        f"GPU{index}"
                    )
                free.discard(index)
                shared[index] = used + allocation.memory_mib
        if not added:
            return self
        return replace(
            self,
            free=frozenset(free),
            shared_mib=shared,
            allocations=(*self.allocations, *added),
        )

    def without(self, deployment_ids: Iterable[str]) -> NodeSnapshot:
        """This node with those deployments' allocations released (ids not here are ignored):
        whole GPUs turn free, shares give their memory back, a GPU left with no share is free."""
        gone = set(deployment_ids)
        released = [a for a in self.allocations if a.deployment_id in gone]
        if not released:
            return self
        free = set(self.free)
        shared = dict(self.shared_mib)
        for allocation in released:
            for index in allocation.gpus:
                if allocation.memory_mib == 0:
                    free.add(index)
                    continue
                left = shared.get(index, 0) - allocation.memory_mib
                if left > 0:
                    shared[index] = left
                else:
                    shared.pop(index, None)
                    free.add(index)
        return replace(
            self,
            free=frozenset(free),
            shared_mib=shared,
            allocations=tuple(a for a in self.allocations if a.deployment_id not in gone),
        )


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What a deployment asks of a node. ValueError when a field is out of range."""

    deployment_id: str
    site: str
    """The client's current edge site."""
    gpus: int = 1
    """GPUs wanted; 0 for a CPU-only replica."""
    gpu_memory_mib: int = 0
    """MiB of each GPU as a memory share; 0 for whole GPUs."""
    p2p_required: bool = False
    """Every pair of the GPUs must be linked by NVLink, PIX or PXB (CUDA peer-to-peer)."""
    priority: PriorityClass = PriorityClass.STANDARD
    latency_slo_ms: float | None = None
    """Most network latency from the client's site to the node allowed, in ms; None: any."""
    runtime: str | None = None
    """The replica runtime the node must offer ("docker", "process"); None: any."""
    min_cuda: str | None = None
    """Lowest CUDA version the node's driver must support, "12.4" style; None: any."""
    strategy: Strategy = Strategy.PACK

    def __post_init__(self) -> None:
        if self.gpus < 0 or self.gpu_memory_mib < 0:
            raise ValueError("gpus and gpu_memory_mib must not be negative")
        if self.gpu_memory_mib and not self.gpus:
            raise ValueError("a GPU memory share needs gpus >= 1")
        if self.latency_slo_ms is not None and not (
            math.isfinite(self.latency_slo_ms) and self.latency_slo_ms > 0
        ):
            raise ValueError(f"latency_slo_ms must be > 0 ms, not {self.latency_slo_ms}")
        if self.runtime is not None and not self.runtime.strip():
            raise ValueError("runtime must be a name or None")
        if self.min_cuda is not None:
            parse_cuda(self.min_cuda)


class Term(enum.StrEnum):
    """The score terms; each is a penalty (lower is better), see `broker.placement.scoring`."""

    LATENCY = "latency"
    LOAD = "load"
    TOPOLOGY = "topology"
    FRAGMENTATION = "fragmentation"
    BALANCE = "balance"


@dataclass(frozen=True, slots=True)
class ScoreTerm:
    name: Term
    value: float
    """The term's raw value: ms for latency, 0..1 for load, topology and balance, rank steps
    over NV18 for fragmentation (see `broker.placement.scoring`)."""
    weight: float
    """Penalty points per unit of value (1 point = 1 ms of latency)."""

    @property
    def weighted(self) -> float:
        return self.value * self.weight


@dataclass(frozen=True, slots=True)
class ScoreTerms:
    terms: tuple[ScoreTerm, ...]
    """One per `Term`, in `Term` order."""
    total: float
    """The penalty, in points (1 point = 1 ms of latency); lower is better. The sum of the
    weighted terms (computed in one fixed order, so equal inputs give bit-equal totals)."""

    def __getitem__(self, name: Term) -> ScoreTerm:
        return next(term for term in self.terms if term.name is name)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that can take the request, with the GPUs it would give and its score."""

    node_id: str
    site: str
    gpus: tuple[int, ...]
    latency_ms: float
    """Network latency from the client's site to the node, in ms."""
    score: ScoreTerms
    preempt: tuple[str, ...] = ()
    """Deployments to evict first (preemption); empty when the node fits as it is."""


class RejectReason(enum.StrEnum):
    """Why a node is not the choice; the same text for every node with that reason."""

    NOT_READY = "not ready"
    UNKNOWN_SITE = "at a site the network does not know"
    TOO_FEW_GPUS = "too few free GPUs"
    NO_MEMORY = "too few GPUs with that much memory free"
    NO_P2P_GROUP = "no P2P-capable group (NVLink, PIX or PXB) among its free GPUs"
    RUNTIME = "does not offer the runtime"
    CUDA = "CUDA older than required"
    LATENCY_SLO = "farther than the latency SLO"
    OUTSCORED = "fits, but cannot beat the top candidates"
    NOT_REACHED = "not examined: its latency alone is worse than the top candidates' score"


@dataclass(frozen=True, slots=True)
class Rejection:
    node_id: str
    reason: RejectReason
    detail: str = ""
    """What about this node, e.g. "3 GPU(s) free"."""


@dataclass(frozen=True, slots=True)
class RejectionCount:
    reason: RejectReason
    count: int
    """Nodes with this reason."""


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why a node was chosen (or none): what `offload explain` shows."""

    chosen: Candidate | None
    top: tuple[Candidate, ...]
    """The best candidates, best first, each with every score term (the chosen one first)."""
    deciding: tuple[str, ...]
    """What separated the winner from the runner-up: the names of the terms in which the
    winner scored better, largest margin first; ("node id",) for an exact tie broken by node
    id; ("evictions",) / ("evicted priority",) when preemption options differ there;
    () with no runner-up."""
    rejected: tuple[Rejection, ...]
    """Some rejected nodes one by one (at most `MAX_LISTED_REJECTIONS`, nearest first)."""
    rejected_counts: tuple[RejectionCount, ...]
    """Every node that is not among `top`, counted by reason (largest count first)."""
    nodes: int
    """Nodes in the snapshot."""
    scored: int
    """Nodes whose score was computed in full (the rest were filtered or bounded out)."""
    note: str = ""
    """A sentence on anything else (preemption, why nothing fits)."""

    def render(self) -> str:
        """The explanation as indented text, for `offload explain` and logs."""
        lines = []
        if self.chosen is None:
            lines.append("chosen: none")
        else:
            c = self.chosen
            lines.append(
                f"chosen: {c.node_id} at {c.site}, GPUs {_gpus(c.gpus)}, "
                f"latency {c.latency_ms:.2f} ms, penalty {c.score.total:.3f}"
            )
        if self.deciding:
            lines.append(f"deciding: {', '.join(self.deciding)}")
        if self.note:
            lines.append(f"note: {self.note}")
        if self.top:
            lines.append(f"top candidates ({self.scored:,} of {self.nodes:,} nodes scored):")
            for candidate in self.top:
                terms = "  ".join(
                    f"{t.name}={t.value:.3g}x{t.weight:g}" for t in candidate.score.terms
                )
                evict = f"  evict {', '.join(candidate.preempt)}" if candidate.preempt else ""
                lines.append(
                    f"  {candidate.node_id} ({candidate.site}) GPUs {_gpus(candidate.gpus)}: "
                    f"{candidate.score.total:.3f} = {terms}{evict}"
                )
        if self.rejected_counts:
            lines.append("not chosen:")
            lines.extend(f"  {n.count:,} node(s): {n.reason}" for n in self.rejected_counts)
        if self.rejected:
            lines.append("for example:")
            lines.extend(
                f"  {r.node_id}: {r.reason}{f' ({r.detail})' if r.detail else ''}"
                for r in self.rejected
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The explanation as JSON-ready values (stored with the deployment)."""

        def candidate(c: Candidate) -> dict[str, Any]:
            return {
                "node_id": c.node_id,
                "site": c.site,
                "gpus": list(c.gpus),
                "latency_ms": c.latency_ms,
                "total": c.score.total,
                "terms": {
                    str(t.name): {"value": t.value, "weight": t.weight} for t in c.score.terms
                },
                "preempt": list(c.preempt),
            }

        return {
            "chosen": None if self.chosen is None else candidate(self.chosen),
            "top": [candidate(c) for c in self.top],
            "deciding": list(self.deciding),
            "rejected": [
                {"node_id": r.node_id, "reason": str(r.reason), "detail": r.detail}
                for r in self.rejected
            ],
            "rejected_counts": {str(n.reason): n.count for n in self.rejected_counts},
            "nodes": self.nodes,
            "scored": self.scored,
            "note": self.note,
        }


@dataclass(frozen=True, slots=True)
class Decision:
    node_id: str | None
    """The chosen node; None when nothing fits (see `reason`)."""
    gpus: tuple[int, ...]
    """GPU indices on the node, ascending; empty when none were asked or nothing fits."""
    explanation: Explanation
    preempt: tuple[str, ...] = ()
    """Deployments on the node to evict before this one starts (strictly lower priority)."""
    reason: str = ""
    """Why nothing fits, in one sentence; "" when a node was chosen."""


def _gpus(gpus: tuple[int, ...]) -> str:
    return ",".join(map(str, gpus)) if gpus else "none"
