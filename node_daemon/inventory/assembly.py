"""The one path from any GPU source to an `Inventory`.

Each source produces two things: a `ParsedTopology` (what `nvidia-smi topo -m` shows: links,
affinities, NICs) and one `GpuDetails` per GPU (identity and usage). `build_inventory` turns
them into the model. The capture parser and NVML both go through it, so a fake at the NVML
seam exercises the same code as the real thing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from common.inventory import Gpu, Inventory, Link, Nic

_SINGLE_NODE = re.compile(r"[0-9]+")


class InventorySource(Protocol):
    """Anything that can say what GPUs this host has (NVML, a capture file)."""

    def read(self) -> Inventory:
        """The inventory now. Blocking: call it through `asyncio.to_thread`."""
        ...


@dataclass(frozen=True, slots=True)
class GpuAffinity:
    """Where one GPU sits relative to the CPUs, as `nvidia-smi topo -m` prints it."""

    cpu_affinity: str = ""
    """The "CPU Affinity" value, e.g. "0-23,48-71"; "" when unknown, N/A or not trusted."""
    numa_affinity: str = ""
    """The "NUMA Affinity" value, e.g. "1" or "0,5-11"; "" when unknown or N/A."""


@dataclass(frozen=True, slots=True)
class ParsedTopology:
    """The topology of one host: GPU `i` is `gpus[i]`."""

    gpus: tuple[GpuAffinity, ...]
    links: Mapping[tuple[int, int], Link]
    """GPU-GPU links keyed by (i, j), i < j; every pair present."""
    nics: tuple[Nic, ...] = ()
    warnings: tuple[str, ...] = ()
    """What the source could not read."""


@dataclass(frozen=True, slots=True)
class GpuDetails:
    """Identity and usage of one GPU, which `topo -m` does not show."""

    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int = 0
    utilization_pct: int = 0
    pci_bus_id: str = ""
    compute_capability: str = ""


def build_inventory(
    topology: ParsedTopology,
    details: Sequence[GpuDetails],
    *,
    driver_version: str = "",
    cuda_version: str = "",
) -> Inventory:
    """The inventory of `topology` with `details[i]` for GPU `i`.

    A GPU's `numa_node` is its NUMA Affinity when that is one node ("3"), else None (a
    list such as "0,5-11", or unknown). Raises ValueError when `details` does not have one
    entry per GPU or the link table is not exactly every pair i < j.
    """
    count = len(topology.gpus)
    if len(details) != count:
        raise ValueError(f"{len(details)} GPU details for a topology of {count} GPUs")
    pairs = {(i, j) for i in range(count) for j in range(i + 1, count)}
    if set(topology.links) != pairs:
        raise ValueError(
            f"link table has pairs {sorted(topology.links)}; expected every pair i < j of "
            f"{count} GPUs"
        )
    gpus = tuple(
        Gpu(
            index=index,
            uuid=detail.uuid,
            name=detail.name,
            memory_total_mib=detail.memory_total_mib,
            memory_used_mib=detail.memory_used_mib,
            utilization_pct=detail.utilization_pct,
            pci_bus_id=detail.pci_bus_id,
            numa_node=(
                int(affinity.numa_affinity)
                if _SINGLE_NODE.fullmatch(affinity.numa_affinity)
                else None
            ),
            cpu_affinity=affinity.cpu_affinity,
            compute_capability=detail.compute_capability,
        )
        for index, (affinity, detail) in enumerate(zip(topology.gpus, details, strict=True))
    )
    return Inventory(
        gpus=gpus,
        links=dict(sorted(topology.links.items())),
        nics=topology.nics,
        driver_version=driver_version,
        cuda_version=cuda_version,
        warnings=topology.warnings,
    )
