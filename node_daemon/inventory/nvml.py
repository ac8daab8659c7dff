"""Inventory from NVML, through pynvml (the only module here that imports it).

Two halves, split at the hardware seam:

- `NvmlReader` calls NVML and returns plain data (`RawSystem`), nothing more. Blocking:
  call it through `asyncio.to_thread`. A test fake replaces it, and only it.
- `inventory_from_nvml` turns a `RawSystem` into a `ParsedTopology` plus one `GpuDetails`
  per GPU and hands them to `build_inventory`, the same code a capture goes through.

The inventory is read once, at startup. The figures that change (each GPU's utilization and
memory in use) are read again every sampling interval by `NvmlLiveGpus`, through its own
seam (`NvmlUsageReader`: NVML kept initialized, two calls a GPU), never by re-reading the
topology.

How NVML's answers become `nvidia-smi topo -m` codes:

- NVLink first: a pair with NVLinks between them is NV<n> whatever the PCIe path (the DGX-1
  capture shows cross-socket pairs as NV2, not SYS). n counts the active links of one GPU
  whose remote PCI bus id is the other GPU, the smaller count of the two ends; plus, when
  both GPUs have links to NVSwitches, the smaller of their switch link counts (every GPU on
  the switches reaches every other with all of its links: NV12 on a DGX A100, NV18 on an
  HGX H100, NV8 on an A800), which a count of GPU-to-GPU links alone would miss.
- Otherwise `nvmlDeviceGetTopologyCommonAncestor`: INTERNAL (two GPUs on one board, K80
  style, joined by the board's own switch) and SINGLE are PIX, MULTIPLE is PXB, HOSTBRIDGE
  is PHB, NODE (the old CPU level, same value) is NODE, SYSTEM is SYS. Drivers before the
  NODE code printed PHB for that level; we follow current ones. A level NVML cannot give,
  or one unknown to this table, is taken as SYS (never overrate a path) with a warning.
- CPU and NUMA affinity: the node-scope CPU set and memory (NUMA) affinity, printed as
  nvidia-smi does ("0-31,64-95", "0,5-11").
- Peer-to-peer reads the driver refuses (`nvmlDeviceGetP2PStatus`, e.g. consumer GPUs on
  PHB) become warnings: the model has no field for them.
- NICs: NVML does not see them (nvidia-smi asks the OS), so this source reports none.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import pynvml

from common.inventory import Gpu, Inventory, Link, LinkKind
from node_daemon.inventory.assembly import (
    GpuAffinity,
    GpuDetails,
    ParsedTopology,
    build_inventory,
)
from node_daemon.inventory.errors import InventoryUnavailable

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024
_MASK_WORDS = 64
"""64-bit words per CPU or NUMA mask asked of NVML: room for 4096 CPUs or nodes."""
_P2P_CAPS_INDEX_READ = 0
"""NVML_P2P_CAPS_INDEX_READ; pynvml defines that constant as the tuple (0,) by mistake."""
_ABSENT = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
"""Errors meaning "this GPU or driver does not have that", not "NVML is broken"."""

_PATH_KINDS = {
    pynvml.NVML_TOPOLOGY_INTERNAL: LinkKind.PIX,
    pynvml.NVML_TOPOLOGY_SINGLE: LinkKind.PIX,
    pynvml.NVML_TOPOLOGY_MULTIPLE: LinkKind.PXB,
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: LinkKind.PHB,
    pynvml.NVML_TOPOLOGY_NODE: LinkKind.NODE,
    pynvml.NVML_TOPOLOGY_SYSTEM: LinkKind.SYS,
}
_P2P_REFUSALS = {
    pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED: "chipset not supported",
    pynvml.NVML_P2P_STATUS_GPU_NOT_SUPPORTED: "GPU not supported",
    pynvml.NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED: "IOH topology not supported",
    pynvml.NVML_P2P_STATUS_DISABLED_BY_REGKEY: "disabled by regkey",
    pynvml.NVML_P2P_STATUS_NOT_SUPPORTED: "not supported",
    pynvml.NVML_P2P_STATUS_UNKNOWN: "unknown",
}


@dataclass(frozen=True, slots=True)
class RawNvLink:
    """One active NVLink of a GPU."""

    remote_pci_bus_id: str
    remote_type: int | None = None
    """NVML_NVLINK_DEVICE_TYPE_* (GPU, IBMNPU, SWITCH); None when the driver cannot say."""


@dataclass(frozen=True, slots=True)
class RawDevice:
    """One GPU as NVML reports it; its index is its position in `RawSystem.devices`."""

    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    pci_bus_id: str
    """As NVML prints it, e.g. "00000000:07:00.0"."""
    utilization_pct: int | None = None
    compute_capability: tuple[int, int] | None = None
    cpu_mask: tuple[int, ...] = ()
    """CPUs of the GPU's NUMA node, 64-bit words: bit b of word w is CPU 64*w + b."""
    numa_mask: tuple[int, ...] = ()
    """NUMA nodes of the GPU's memory affinity, laid out as `cpu_mask`."""
    nvlinks: tuple[RawNvLink, ...] = ()
    """Active links only."""


@dataclass(frozen=True, slots=True)
class RawSystem:
    """Everything one NVML read returns, as plain data."""

    devices: tuple[RawDevice, ...]
    common_ancestors: Mapping[tuple[int, int], int]
    """NVML_TOPOLOGY_* per GPU pair (i, j), i < j; a pair NVML could not place is absent."""
    p2p_read: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """NVML_P2P_STATUS_* of peer-to-peer reads per pair (i, j), i < j; absent: not reported."""
    driver_version: str = ""
    cuda_driver_version: int = 0
    """As NVML gives it: 12040 for CUDA 12.4; 0 when unknown."""


class RawSystemReader(Protocol):
    """The NVML seam: `NvmlReader`, or a fake of it in tests."""

    def read(self) -> RawSystem:
        """One snapshot; raises InventoryUnavailable when there is no NVML."""
        ...


class NvmlReader:
    """Every NVML call of the inventory; returns plain data.

    Blocking (NVML can take seconds on a large node): call `read` through
    `asyncio.to_thread`. Each read initializes NVML and shuts it down again.
    """

    def read(self) -> RawSystem:
        """Raises InventoryUnavailable when NVML cannot be loaded or fails mid-read."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise InventoryUnavailable(
                f"NVML is not available ({err}): is the NVIDIA driver installed? On a host "
                "without GPUs use --topology-file FILE --gpu-spec NAME:MIB, or --no-gpu"
            ) from err
        try:
            try:
                raw = self._read()
            finally:
                pynvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            raise InventoryUnavailable(
                f"NVML failed while reading the GPUs ({err}); check `nvidia-smi`, or use "
                "--topology-file FILE --gpu-spec NAME:MIB, or --no-gpu"
            ) from err
        logger.debug("nvml gpus=%d driver=%s", len(raw.devices), raw.driver_version)
        return raw

    def _read(self) -> RawSystem:
        handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        ]
        pairs = [(i, j) for i in range(len(handles)) for j in range(i + 1, len(handles))]
        ancestors = {
            (i, j): _optional(pynvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
            for i, j in pairs
        }
        p2p = {
            (i, j): _optional(
                pynvml.nvmlDeviceGetP2PStatus, handles[i], handles[j], _P2P_CAPS_INDEX_READ
            )
            for i, j in pairs
        }
        return RawSystem(
            devices=tuple(self._device(handle) for handle in handles),
            common_ancestors={pair: v for pair, v in ancestors.items() if v is not None},
            p2p_read={pair: v for pair, v in p2p.items() if v is not None},
            driver_version=pynvml.nvmlSystemGetDriverVersion(),
            cuda_driver_version=_optional(pynvml.nvmlSystemGetCudaDriverVersion) or 0,
        )

    def _device(self, handle: Any) -> RawDevice:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
        scope = pynvml.NVML_AFFINITY_SCOPE_NODE
        cpus = _optional(pynvml.nvmlDeviceGetCpuAffinityWithinScope, handle, _MASK_WORDS, scope)
        nodes = _optional(pynvml.nvmlDeviceGetMemoryAffinity, handle, _MASK_WORDS, scope)
        return RawDevice(
            uuid=pynvml.nvmlDeviceGetUUID(handle),
            name=pynvml.nvmlDeviceGetName(handle),
            memory_total_bytes=memory.total,
            memory_used_bytes=memory.used,
            pci_bus_id=pynvml.nvmlDeviceGetPciInfo(handle).busId,
            utilization_pct=None if utilization is None else utilization.gpu,
            compute_capability=_optional(pynvml.nvmlDeviceGetCudaComputeCapability, handle),
            cpu_mask=() if cpus is None else tuple(cpus),
            numa_mask=() if nodes is None else tuple(nodes),
            nvlinks=self._nvlinks(handle),
        )

    def _nvlinks(self, handle: Any) -> tuple[RawNvLink, ...]:
        links = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId
            except (*_ABSENT, pynvml.NVMLError_InvalidArgument):
                continue  # no NVLink on this GPU, or no link with this number
            remote_type = _optional(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
            links.append(RawNvLink(remote_pci_bus_id=remote, remote_type=remote_type))
        return tuple(links)


def _optional(call: Any, *args: Any) -> Any:
    """`call(*args)`, or None when the GPU or driver does not support it."""
    try:
        return call(*args)
    except _ABSENT:
        return None


class NvmlInventory:
    """An `InventorySource` reading NVML (or, in tests, a fake `RawSystemReader`)."""

    def __init__(self, reader: RawSystemReader | None = None) -> None:
        self._reader = reader if reader is not None else NvmlReader()

    def read(self) -> Inventory:
        """Blocking; raises InventoryUnavailable when there is no NVML."""
        return inventory_from_nvml(self._reader.read())


@dataclass(frozen=True, slots=True)
class RawGpuUsage:
    """One GPU's changing figures, as NVML reports them now."""

    uuid: str
    memory_used_bytes: int
    utilization_pct: int | None = None
    """Percent of NVML's last sample period (1/6 s to 1 s by product) the GPU was busy;
    None when the GPU does not report it."""


class GpuUsageReader(Protocol):
    """The seam of the live figures: `NvmlUsageReader`, or a fake of it in tests."""

    def read_usage(self) -> tuple[RawGpuUsage, ...]:
        """Every GPU's figures now; raises InventoryUnavailable when NVML fails."""
        ...


class NvmlUsageReader:
    """Reads every GPU's utilization and memory in use, every sampling interval.

    NVML is initialized on the first read and kept (an init costs tens of milliseconds and
    more on a large node); after a failure it is shut down and the next read initializes it
    again. Blocking: call `read_usage` through `asyncio.to_thread`, one call at a time.
    """

    def __init__(self) -> None:
        self._handles: list[Any] | None = None

    def read_usage(self) -> tuple[RawGpuUsage, ...]:
        """Raises InventoryUnavailable when NVML cannot be loaded or fails mid-read."""
        try:
            if self._handles is None:
                pynvml.nvmlInit()
                self._handles = [
                    pynvml.nvmlDeviceGetHandleByIndex(i)
                    for i in range(pynvml.nvmlDeviceGetCount())
                ]
            return tuple(self._usage(handle) for handle in self._handles)
        except pynvml.NVMLError as err:
            self._shutdown()
            raise InventoryUnavailable(f"NVML failed reading the GPUs' usage ({err})") from err

    @staticmethod
    def _usage(handle: Any) -> RawGpuUsage:
        utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
        return RawGpuUsage(
            uuid=pynvml.nvmlDeviceGetUUID(handle),
            memory_used_bytes=pynvml.nvmlDeviceGetMemoryInfo(handle).used,
            utilization_pct=None if utilization is None else utilization.gpu,
        )

    def _shutdown(self) -> None:
        if self._handles is None:
            return
        self._handles = None
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


class NvmlLiveGpus:
    """The inventory's GPUs with the utilization and memory NVML reports now (an NVML
    node's `NodeAgent.read_gpus`)."""

    def __init__(self, gpus: Sequence[Gpu], reader: GpuUsageReader | None = None) -> None:
        self._gpus = tuple(gpus)
        self._reader = reader if reader is not None else NvmlUsageReader()

    def read(self) -> tuple[Gpu, ...]:
        """Blocking; InventoryUnavailable when NVML fails."""
        return gpus_with_usage(self._gpus, self._reader.read_usage())


def gpus_with_usage(gpus: Sequence[Gpu], usage: Sequence[RawGpuUsage]) -> tuple[Gpu, ...]:
    """`gpus` with each one's utilization and memory in use from `usage` (matched by UUID);
    a figure NVML did not give now stays as it is in `gpus` (as read at startup)."""
    now = {u.uuid: u for u in usage}
    live = []
    for gpu in gpus:
        if (figures := now.get(gpu.uuid)) is None:
            live.append(gpu)
            continue
        utilization = figures.utilization_pct
        live.append(
            replace(
                gpu,
                memory_used_mib=figures.memory_used_bytes // _MIB,
                utilization_pct=gpu.utilization_pct if utilization is None else utilization,
            )
        )
    return tuple(live)


def inventory_from_nvml(raw: RawSystem) -> Inventory:
    """The inventory of one NVML snapshot; pure."""
    details = [
        GpuDetails(
            uuid=device.uuid,
            name=device.name,
            memory_total_mib=device.memory_total_bytes // _MIB,
            memory_used_mib=device.memory_used_bytes // _MIB,
            utilization_pct=device.utilization_pct or 0,
            pci_bus_id=device.pci_bus_id,
            compute_capability=(
                ""
                if device.compute_capability is None
                else "{}.{}".format(*device.compute_capability)
            ),
        )
        for device in raw.devices
    ]
    cuda = raw.cuda_driver_version
    return build_inventory(
        topology_from_nvml(raw),
        details,
        driver_version=raw.driver_version,
        cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "",
    )


def topology_from_nvml(raw: RawSystem) -> ParsedTopology:
    """What `nvidia-smi topo -m` would print for this snapshot (without NICs); pure."""
    devices = raw.devices
    warnings: list[str] = []
    links: dict[tuple[int, int], Link] = {}
    for i in range(len(devices)):
        for j in range(i + 1, len(devices)):
            nvlinks = _nvlink_count(devices[i], devices[j])
            level = raw.common_ancestors.get((i, j))
            kind = _PATH_KINDS.get(level) if level is not None else None
            if nvlinks:
                links[(i, j)] = Link(LinkKind.NV, nvlinks)
            elif kind is not None:
                links[(i, j)] = Link(kind)
            else:
                said = "no PCIe path" if level is None else f"unknown topology level {level}"
                warnings.append(f"GPU{i}-GPU{j}: NVML gave {said}; taken as SYS")
                links[(i, j)] = Link(LinkKind.SYS)
    refused: dict[str, list[str]] = {}
    for (i, j), status in sorted(raw.p2p_read.items()):
        if status != pynvml.NVML_P2P_STATUS_OK:
            reason = _P2P_REFUSALS.get(status, f"status {status}")
            refused.setdefault(reason, []).append(f"GPU{i}-GPU{j}")
    warnings += [
        f"peer-to-peer reads refused by the driver ({reason}): {', '.join(pairs)}"
        for reason, pairs in refused.items()
    ]
    gpus = tuple(
        GpuAffinity(
            cpu_affinity=format_id_list(_mask_ids(device.cpu_mask)),
            numa_affinity=format_id_list(_mask_ids(device.numa_mask)),
        )
        for device in devices
    )
    return ParsedTopology(gpus=gpus, links=links, warnings=tuple(warnings))


def format_id_list(ids: Iterable[int]) -> str:
    """CPU or node ids as nvidia-smi prints them: [0, 1, 2, 5] -> "0-2,5"; none -> ""."""
    runs: list[list[int]] = []
    for id_ in sorted(set(ids)):
        if runs and id_ == runs[-1][1] + 1:
            runs[-1][1] = id_
        else:
            runs.append([id_, id_])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def _mask_ids(words: Sequence[int]) -> list[int]:
    return [64 * w + bit for w, word in enumerate(words) for bit in range(64) if word >> bit & 1]


def _nvlink_count(a: RawDevice, b: RawDevice) -> int:
    def direct(source: RawDevice, target: RawDevice) -> int:
        bus = _bus_key(target.pci_bus_id)
        return sum(_bus_key(link.remote_pci_bus_id) == bus for link in source.nvlinks)

    def switched(device: RawDevice) -> int:
        switch = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        return sum(link.remote_type == switch for link in device.nvlinks)

    return min(direct(a, b), direct(b, a)) + min(switched(a), switched(b))


def _bus_key(bus_id: str) -> str:
    """A PCI bus id without the domain's leading zeros (NVML prints 4 or 8 digits)."""
    domain, colon, rest = bus_id.strip().upper().partition(":")
    return f"{domain.lstrip('0')}:{rest}" if colon else domain
