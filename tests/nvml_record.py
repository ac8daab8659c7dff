"""Record what NVML and `nvidia-smi topo -m` say on a machine with NVIDIA GPUs, so that a test
on a machine without them can check `inventory_from_nvml` against the real answers.

    python -m tests.nvml_record OUT_DIR

writes `OUT_DIR/nvml.json` (one `NvmlReader` read, as `dump` writes it, and one
`NvmlUsageReader` read) and `OUT_DIR/topo.txt` (`nvidia-smi topo -m`), and prints the
inventory each gives. `load` reads the JSON back into a `RawSystem`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from node_daemon.inventory.nvml import (
    NvmlReader,
    NvmlUsageReader,
    RawDevice,
    RawNvLink,
    RawSystem,
    inventory_from_nvml,
)
from node_daemon.inventory.topo_file import GpuSpec, inventory_from_capture


def dump(raw: RawSystem) -> dict[str, Any]:
    """`raw` as JSON data (pairs as [i, j, value] rows)."""
    return {
        "devices": [asdict(d) for d in raw.devices],
        "common_ancestors": [[i, j, v] for (i, j), v in sorted(raw.common_ancestors.items())],
        "p2p_read": [[i, j, v] for (i, j), v in sorted(raw.p2p_read.items())],
        "driver_version": raw.driver_version,
        "cuda_driver_version": raw.cuda_driver_version,
    }


def load(path: Path) -> RawSystem:
    """The `RawSystem` a recorded `nvml.json` holds."""
    data = json.loads(path.read_text())
    devices = []
    for d in data["devices"]:
        capability = d["compute_capability"]
        devices.append(
            RawDevice(
                **{
                    **d,
                    "compute_capability": None if capability is None else tuple(capability),
                    "cpu_mask": tuple(d["cpu_mask"]),
                    "numa_mask": tuple(d["numa_mask"]),
                    "nvlinks": tuple(RawNvLink(**link) for link in d["nvlinks"]),
                }
            )
        )
    return RawSystem(
        devices=tuple(devices),
        common_ancestors={(i, j): v for i, j, v in data["common_ancestors"]},
        p2p_read={(i, j): v for i, j, v in data["p2p_read"]},
        driver_version=data["driver_version"],
        cuda_driver_version=data["cuda_driver_version"],
    )


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    raw = NvmlReader().read()
    usage = NvmlUsageReader().read_usage()
    (out / "nvml.json").write_text(
        json.dumps({**dump(raw), "usage": [asdict(u) for u in usage]}, indent=1) + "\n"
    )
    topo = subprocess.run(
        ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    (out / "topo.txt").write_text(topo)
    assert load(out / "nvml.json") == raw, "the JSON does not read back as what NVML gave"
    from_nvml = inventory_from_nvml(raw)
    first = raw.devices[0]
    spec = GpuSpec(first.name, first.memory_total_bytes // (1024 * 1024))
    from_capture = inventory_from_capture(out / "topo.txt", spec)
    print(topo)
    print("from NVML:   ", from_nvml)
    print("from capture:", from_capture)
    print("usage:", usage)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
