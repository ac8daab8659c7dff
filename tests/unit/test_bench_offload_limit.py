"""The emulated device's CPU limit in `bench.offload`: a CFS quota over a short period."""

import pytest

from bench.offload import cpu_limit, main


def test_a_quarter_cpu_is_a_quarter_of_each_ten_ms_period() -> None:
    assert cpu_limit(0.25, 10.0) == ["--cpu-period", "10000", "--cpu-quota", "2500"]
    assert cpu_limit(1.0, 100.0) == ["--cpu-period", "100000", "--cpu-quota", "100000"]


def test_a_quota_below_the_kernels_millisecond_is_refused_with_the_figures() -> None:
    with pytest.raises(ValueError, match=r"quota of 500 us; the kernel takes at least 1000 us"):
        cpu_limit(0.25, 2.0)


@pytest.mark.parametrize("period_ms", [0.5, 1001.0, float("inf"), float("nan"), -10.0])
def test_a_period_outside_the_kernels_range_is_refused(period_ms: float) -> None:
    with pytest.raises(ValueError, match=r"outside the kernel's 1\.\.1000 ms"):
        cpu_limit(1.0, period_ms)


def test_the_command_line_refuses_such_a_period_before_building_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--cfs-period-ms", "2"])
    assert exit_info.value.code == 2
    assert "quota of 500 us" in capsys.readouterr().err
