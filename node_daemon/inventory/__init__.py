"""GPU inventory: one model (`model.py`) from NVML, a `nvidia-smi topo -m` capture, or none."""

from node_daemon.inventory.model import Gpu, Inventory, Link, LinkKind, Nic

__all__ = ["Gpu", "Inventory", "Link", "LinkKind", "Nic"]
