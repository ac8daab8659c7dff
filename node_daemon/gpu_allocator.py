"""GPU bookkeeping on one node: which replica holds which GPU, whole or as a memory share.

A GPU given whole to one replica is given to no other; memory shares of one GPU go to
several replicas as long as their sum fits the GPU's memory. GPU groups are chosen by the
topology's `best_group` among the GPUs that can take the request. Plain Python, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from common.inventory import P2P_KINDS, Inventory
from common.topology import Topology
from node_daemon.errors import GpusExhausted, InvalidRequest
from runtime.errors import quote


@dataclass(slots=True)
class _Holding:
    whole: str | None = None
    shares: dict[str, int] = field(default_factory=dict)
    """replica id -> MiB of this GPU's memory."""


@dataclass(frozen=True, slots=True)
class Allocation:
    gpus: tuple[int, ...]
    """GPU indices, in the order given to the replica."""
    memory_mib: int
    """Per GPU; 0 means the GPUs are whole."""


class GpuAllocator:
    def __init__(self, inventory: Inventory, topology: Topology | None = None) -> None:
        self._inventory = inventory
        self._topology = topology or Topology.from_inventory(inventory)
        self._by_uuid = {g.uuid: g.index for g in inventory.gpus}
        self._held = {g.index: _Holding() for g in inventory.gpus}
        self._owners: dict[str, Allocation] = {}

    def _fits(self, index: int, memory_mib: int) -> bool:
        held = self._held[index]
        if held.whole is not None:
            return False
        if memory_mib == 0:
            return not held.shares
        total = self._inventory.gpus[index].memory_total_mib
        return sum(held.shares.values()) + memory_mib <= total

    def free(self, memory_mib: int = 0) -> list[int]:
        """The GPUs that could take a request for `memory_mib` (0: a whole GPU)."""
        return [i for i in self._held if self._fits(i, memory_mib)]

    def allocate(
        self,
        replica_id: str,
        *,
        count: int = 0,
        uuids: Sequence[str] = (),
        memory_mib: int = 0,
        p2p_required: bool = False,
    ) -> Allocation:
        """Give GPUs to `replica_id`: exactly `uuids`, or the best group of `count`.

        GpusExhausted (saying what is free) when the request cannot be met; InvalidRequest
        for unknown UUIDs or inconsistent fields. Nothing changes on failure.
        """
        if replica_id in self._owners:
            raise InvalidRequest(f"replica {replica_id} already holds GPUs")
        if memory_mib < 0 or count < 0:
            raise InvalidRequest("gpu_count and gpu_memory_mib must not be negative")
        if uuids and count and count != len(uuids):
            raise InvalidRequest(f"gpu_count {count} but {len(uuids)} GPU UUIDs given")
        if memory_mib and (uuids or count):
            too_big = [g for g in self._inventory.gpus if g.memory_total_mib < memory_mib]
            if too_big and len(too_big) == len(self._inventory.gpus):
                raise GpusExhausted(
                    f"a share of {memory_mib} MiB exceeds every GPU's memory "
                    f"({max(g.memory_total_mib for g in self._inventory.gpus)} MiB at most)"
                )
        candidates = self.free(memory_mib)
        if uuids:
            unknown = [u for u in uuids if u not in self._by_uuid]
            if unknown:
                raise InvalidRequest(
                    f"unknown GPU UUID(s) on this node: {', '.join(map(quote, unknown[:3]))}"
                    + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
                )
            group = tuple(self._by_uuid[u] for u in uuids)
            if len(set(group)) != len(group):
                raise InvalidRequest("a GPU UUID is given more than once")
            busy = [i for i in group if i not in candidates]
            if busy:
                raise GpusExhausted(
                    f"GPU(s) {_names(busy)} cannot take this request; "
                    f"{self._describe_free(memory_mib)}"
                )
        elif count == 0:
            group = ()
        else:
            if count > len(candidates):
                raise GpusExhausted(
                    f"asked for {count} GPU(s){_share(memory_mib)}; "
                    f"{self._describe_free(memory_mib)}"
                )
            group = self._topology.best_group(count, candidates)
        if p2p_required and len(group) > 1:
            slow = [
                (a, b)
                for a, b in itertools.combinations(group, 2)
                if self._inventory.link(a, b).kind not in P2P_KINDS
            ]
            if slow:
                a, b = slow[0]
                raise GpusExhausted(
                    f"no P2P-capable group of {len(group)} among the free GPUs: the best one "
                    f"({_names(group)}) links GPU{a} and GPU{b} by "
                    f"{self._inventory.link(a, b)}; P2P needs NVLink, PIX or PXB"
                )
        for index in group:
            held = self._held[index]
            if memory_mib:
                held.shares[replica_id] = memory_mib
            else:
                held.whole = replica_id
        allocation = Allocation(tuple(group), memory_mib)
        self._owners[replica_id] = allocation
        return allocation

    def restore(self, replica_id: str, gpus: Collection[int], memory_mib: int) -> None:
        """Record what an adopted replica holds (after a daemon restart), as it was given.
        InvalidRequest when that clashes with what is recorded already."""
        clash = [i for i in gpus if i not in self._held or not self._fits(i, memory_mib)]
        if clash:
            raise InvalidRequest(
                f"replica {replica_id} claims GPU(s) {_names(clash)} that are taken or unknown"
            )
        for index in gpus:
            if memory_mib:
                self._held[index].shares[replica_id] = memory_mib
            else:
                self._held[index].whole = replica_id
        self._owners[replica_id] = Allocation(tuple(gpus), memory_mib)

    def release(self, replica_id: str) -> None:
        """Give back what `replica_id` holds. Idempotent."""
        allocation = self._owners.pop(replica_id, None)
        if allocation is None:
            return
        for index in allocation.gpus:
            held = self._held[index]
            if held.whole == replica_id:
                held.whole = None
            held.shares.pop(replica_id, None)

    def holder_of(self, index: int) -> list[str]:
        held = self._held[index]
        return [held.whole] if held.whole else sorted(held.shares)

    def _describe_free(self, memory_mib: int) -> str:
        free = self.free(memory_mib)
        kind = f"with {memory_mib} MiB free" if memory_mib else "free"
        listed = _names(free) if free else "none"
        return f"GPUs {kind}: {listed} ({len(free)} of {len(self._held)})"


def _names(indices: Collection[int]) -> str:
    return ", ".join(f"GPU{i}" for i in indices)


def _share(memory_mib: int) -> str:
    return f" with {memory_mib} MiB each" if memory_mib else ""
