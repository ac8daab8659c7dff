"""What reading an inventory can raise.

InventoryError
 +-- TopologyParseError (also a ValueError): a `nvidia-smi topo -m` capture is not one
 +-- InventoryUnavailable: no source of GPU facts here (no NVIDIA driver for NVML)
"""

from __future__ import annotations


class InventoryError(Exception):
    """Base of every inventory error."""


class TopologyParseError(InventoryError, ValueError):
    """A capture could not be read as a topology matrix.

    The message names the source, the 1-based line of the original text (when one line is
    to blame) and what was expected there.
    """

    def __init__(self, source: str, line: int | None, reason: str) -> None:
        where = f"{source}, line {line}" if line is not None else source
        super().__init__(f"{where}: {reason}")
        self.source = source
        self.line = line
        self.reason = reason


class InventoryUnavailable(InventoryError):
    """NVML cannot be used on this host; the message says which flags to use instead."""
