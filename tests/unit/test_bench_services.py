"""The replicas' GPU memory in bench/services.py: NVML's per-process figures summed for the
replicas' pids, and a machine without NVML told plainly; its arms chosen by name."""

from __future__ import annotations

import argparse

import pynvml
import pytest

from bench.services import _arms, gpu_mib, gpu_processes, report, shown

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


def test_arms_are_chosen_by_name_and_a_report_of_some_prints_only_those(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _arms("priority, flood") == ["priority", "flood"]
    for bad in ("", "priority,nonsense", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="give a comma list"):
            _arms(bad)
    flood = {
        "arm": "flood", "flood_loops": 16, "max_rps_per_client": 200.0,
        "quiet_p99_ms_alone": 2.0, "quiet_p99_ms_beside_flood": 3.0, "quiet_p99_ratio": 1.5,
        "flood_calls_per_s": 190.0, "flood_refused": 4, "failed": 0,
    }  # fmt: skip
    report([flood])
    printed = capsys.readouterr().out
    assert "beside the flood 3.0 ms (1.5x" in printed
    assert "moves between sites" not in printed and "critical p99" not in printed
