"""The one GPU inventory model every source produces (NVML, a topology capture, or no GPU).

Plain frozen values, shared by the node daemon (which reads them) and the broker (which
places on them); the readers live in `node_daemon.inventory`. Whatever the source,
everything after it (topology, placement, registration) reads only these types.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class LinkKind(enum.StrEnum):
    """How two devices are connected, in `nvidia-smi topo -m` terms (old SOC is SYS)."""

    NV = "NV"
    """A bonded set of NVLinks; `Link.nvlinks` says how many."""
    PIX = "PIX"
    """At most a single PCIe bridge."""
    PXB = "PXB"
    """Multiple PCIe bridges, without the host bridge."""
    PHB = "PHB"
    """Through a PCIe host bridge (typically the CPU)."""
    NODE = "NODE"
    """Between PCIe host bridges within one NUMA node."""
    SYS = "SYS"
    """Across the SMP interconnect between NUMA nodes (QPI/UPI/xGMI)."""


P2P_KINDS = frozenset({LinkKind.NV, LinkKind.PIX, LinkKind.PXB})
"""Link kinds over which CUDA peer-to-peer works on every platform: NVLink, and PCIe below
the host bridge. PHB often does not (consumer cards, several root complexes), NODE and SYS
never do."""


@dataclass(frozen=True, slots=True)
class Link:
    kind: LinkKind
    nvlinks: int = 0
    """Number of bonded NVLinks when kind is NV (NV12 -> 12); 0 otherwise."""

    def __str__(self) -> str:
        return f"NV{self.nvlinks}" if self.kind is LinkKind.NV else self.kind.value


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int = 0
    utilization_pct: int = 0
    pci_bus_id: str = ""
    numa_node: int | None = None
    """NUMA node of the GPU's CPU affinity (None when unknown or N/A)."""
    cpu_affinity: str = ""
    """As nvidia-smi prints it, e.g. "0-23,48-71"; "" when unknown."""
    compute_capability: str = ""
    """"8.0" style; "" when unknown."""


@dataclass(frozen=True, slots=True)
class Nic:
    name: str
    """The device name (mlx5_0), or the NIC<n> alias when no legend maps it."""
    links: Mapping[int, Link] = field(default_factory=dict)
    """GPU index -> how this NIC reaches that GPU."""


@dataclass(frozen=True, slots=True)
class Inventory:
    gpus: tuple[Gpu, ...]
    links: Mapping[tuple[int, int], Link]
    """GPU-GPU links keyed by (i, j) with i < j, GPU indices; every pair present."""
    nics: tuple[Nic, ...] = ()
    driver_version: str = ""
    cuda_version: str = ""
    warnings: tuple[str, ...] = ()
    """What the source could not read (e.g. a cropped capture's lost NIC columns)."""

    def link(self, a: int, b: int) -> Link:
        """The link between GPUs `a` and `b` (in either order); KeyError for a == b."""
        return self.links[(a, b) if a < b else (b, a)]
