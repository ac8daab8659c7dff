"""offload.v1 messages <-> the broker's domain values."""

from __future__ import annotations

import re

from broker.errors import InvalidRequest
from node_daemon.inventory import Gpu, Inventory, Link, LinkKind, Nic
from protos.offload.v1 import node_pb2 as npb

_NV = re.compile(r"NV(\d+)")


def link_from_text(kind: str) -> Link:
    if match := _NV.fullmatch(kind):
        return Link(LinkKind.NV, int(match.group(1)))
    try:
        return Link(LinkKind(kind))
    except ValueError:
        raise InvalidRequest(f"unknown GPU link kind {kind!r}") from None


def inventory_from_proto(message: npb.Inventory) -> Inventory:
    """The node's inventory as the broker's domain sees it; InvalidRequest when the node sent
    something inconsistent (duplicate GPUs, links to unknown GPUs, missing pairs)."""
    gpus = tuple(
        Gpu(
            index=g.index,
            uuid=g.uuid,
            name=g.name,
            memory_total_mib=g.memory_total_mib,
            memory_used_mib=g.memory_used_mib,
            utilization_pct=g.utilization_pct,
            pci_bus_id=g.pci_bus_id,
            numa_node=None if g.numa_node < 0 else g.numa_node,
            compute_capability=g.compute_capability,
        )
        for g in message.gpus
    )
    if len({g.index for g in gpus}) != len(gpus) or len({g.uuid for g in gpus}) != len(gpus):
        raise InvalidRequest("the inventory lists a GPU index or UUID twice")
    if sorted(g.index for g in gpus) != list(range(len(gpus))):
        raise InvalidRequest("GPU indices must be 0..N-1")
    if any(g.memory_total_mib <= 0 for g in gpus):
        raise InvalidRequest("every GPU needs a positive memory_total_mib")
    index = {g.uuid: g.index for g in gpus}
    links = {}
    for link in message.links:
        if link.gpu_a not in index or link.gpu_b not in index or link.gpu_a == link.gpu_b:
            raise InvalidRequest(f"link {link.gpu_a} - {link.gpu_b} names an unknown GPU")
        a, b = sorted((index[link.gpu_a], index[link.gpu_b]))
        links[(a, b)] = link_from_text(link.kind)
    expected = len(gpus) * (len(gpus) - 1) // 2
    if len(links) != expected:
        raise InvalidRequest(f"the inventory has {len(links)} GPU links; {expected} expected")
    return Inventory(
        gpus=gpus,
        links=links,
        nics=tuple(Nic(name) for name in message.nics),
        driver_version=message.driver_version,
        cuda_version=message.cuda_version,
    )
