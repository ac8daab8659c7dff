"""The replicas' GPU memory in bench/services.py: NVML's per-process figures summed for the
replicas' pids, and a machine without NVML told plainly."""

from __future__ import annotations

import pynvml
import pytest

from bench.services import gpu_mib, gpu_processes, shown

MIB = 2**20


def test_the_replicas_gpu_memory_is_summed_over_their_processes_on_every_gpu() -> None:
    processes = [
        (100, 300 * MIB),  # a replica, GPU 0
        (200, 500 * MIB),  # another program's process
        (100, 200 * MIB),  # the same replica on GPU 1
        (101, None),  # a replica NVML has no figure for
        (102, 64 * MIB + MIB // 2),
    ]
    assert gpu_mib(processes, {100, 101, 102}) == 564.5
    assert gpu_mib(processes, {300}) == 0.0  # none of them on a GPU


def test_without_nvml_the_gpu_memory_is_none_and_the_table_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    # As on a machine without the NVIDIA driver (this one's, where there is none).
    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    assert gpu_processes() is None
    assert shown(None) == "n/a (no NVML)"
    assert shown(564.5) == "564.5"
