"""The inventory of a node that offers no GPU (`--no-gpu`)."""

from __future__ import annotations

from common.inventory import Inventory


def cpu_only_inventory() -> Inventory:
    """No GPUs, no links, no NICs: replicas on this node run on the CPU."""
    return Inventory(gpus=(), links={})
