"""GPU inventory readers: the one model (`common.inventory`) from NVML, a `nvidia-smi topo -m`
capture, or none (re-exported here for the readers' callers).

Sources: `NvmlInventory` (nvml.py), `TopologyFileInventory` / `inventory_from_capture`
(topo_file.py), `cpu_only_inventory` (cpu_only.py). NVML and captures both end in
`build_inventory` (assembly.py); errors are in errors.py.
"""

from common.inventory import Gpu, Inventory, Link, LinkKind, Nic
from node_daemon.inventory.assembly import (
    GpuAffinity,
    GpuDetails,
    InventorySource,
    ParsedTopology,
    build_inventory,
)
from node_daemon.inventory.cpu_only import cpu_only_inventory
from node_daemon.inventory.errors import InventoryError, InventoryUnavailable, TopologyParseError
from node_daemon.inventory.nvml import (
    GpuUsageReader,
    NvmlInventory,
    NvmlLiveGpus,
    NvmlReader,
    NvmlUsageReader,
    RawDevice,
    RawGpuUsage,
    RawNvLink,
    RawSystem,
    RawSystemReader,
    inventory_from_nvml,
)
from node_daemon.inventory.topo_file import (
    GpuSpec,
    TopologyFileInventory,
    inventory_from_capture,
    parse_topology,
)

__all__ = [
    "Gpu",
    "GpuAffinity",
    "GpuDetails",
    "GpuSpec",
    "GpuUsageReader",
    "Inventory",
    "InventoryError",
    "InventorySource",
    "InventoryUnavailable",
    "Link",
    "LinkKind",
    "Nic",
    "NvmlInventory",
    "NvmlLiveGpus",
    "NvmlReader",
    "NvmlUsageReader",
    "ParsedTopology",
    "RawDevice",
    "RawGpuUsage",
    "RawNvLink",
    "RawSystem",
    "RawSystemReader",
    "TopologyFileInventory",
    "TopologyParseError",
    "build_inventory",
    "cpu_only_inventory",
    "inventory_from_capture",
    "inventory_from_nvml",
    "parse_topology",
]
