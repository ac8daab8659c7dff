"""`python -m bench.loopback_stall`: the same calls over the host's loopback and over a
private namespace's at an Ethernet MTU, in blocks that take turns, side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import loopback_stall, private_net

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    private_net.unavailable_reason() is not None,
    reason=f"a private network namespace {private_net.unavailable_reason()}",
)
def test_quick_mode_measures_both_networks_in_turns_and_names_each_ones_loopback(
    tmp_path: Path,
) -> None:
    out = tmp_path / "stall.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.loopback_stall", "--quick", "--block-seconds", "1.5",
         "--request-kb", "64", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    host, private = result["networks"]["host"], result["networks"]["private"]
    assert host["network"] == private_net.network_description()
    assert private["network"]["private_namespace"] is True
    assert private["network"]["loopback_mtu"] == private_net.ETHERNET_MTU
    for figures in (host, private):
        assert len(figures["blocks"]) == 2
        assert figures["calls"] == sum(block["calls"] for block in figures["blocks"]) > 0
        assert figures["stalls"] == sum(block["stalls"] for block in figures["blocks"])
        assert figures["p50"] <= figures["p99"] <= figures["max"]
        # every call waited for the server's 40 ms
        assert figures["p50"] >= result["settings"]["delay_ms"]
    assert result["settings"]["stall_threshold_ms"] == 70.0
    lines = done.stdout.splitlines()
    # the blocks take turns: the second block starts with the network the first ended on
    order = [line.split()[2] for line in lines if line.startswith("  block ")]
    assert order == ["host", "private", "private", "host"]
    assert lines[-1].startswith("stalls: ")
    assert f"MTU {private_net.ETHERNET_MTU}" in done.stdout


def test_without_a_private_namespace_it_refuses_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(private_net, "unavailable_reason", lambda: "needs root")
    with pytest.raises(SystemExit) as exited:
        loopback_stall.main(["--quick"])
    assert exited.value.code == 2
    assert "the private network to compare against: needs root" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--blocks", "0"], "--blocks and --loops must be at least 1"),
        (["--block-seconds", "-1"], "--block-seconds over 0"),
        (["--request-kb", "0"], "--request-kb must be at least 1, got 0"),
    ],
)
def test_bad_settings_are_refused_before_anything_runs(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        loopback_stall.main(flags)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_a_stall_is_a_call_over_the_wait_and_the_margin() -> None:
    threshold = loopback_stall.stall_threshold_ms(40)
    figures = loopback_stall.summarize([41.0, 69.9, 70.0, 70.1, 208.4], threshold)
    assert (figures["calls"], figures["stalls"], figures["max"]) == (5, 2, 208.4)
    assert figures["stalls_per_10k"] == 4000.0
    with pytest.raises(ValueError, match="no call finished"):
        loopback_stall.summarize([], threshold)


def test_the_verdict_gives_both_networks_counts() -> None:
    host = {"stalls": 10, "calls": 11316}
    private = {"stalls": 0, "calls": 11324}
    assert loopback_stall.verdict(host, private) == (
        "stalls: 10 of 11,316 calls on the host's loopback, 0 of 11,324 at MTU 1500"
    )
    quiet = loopback_stall.verdict({**host, "stalls": 0}, private)
    assert quiet.startswith("stalls: none in either network (0 of 11,316")


@pytest.mark.parametrize(
    ("completed", "says"),
    [
        (subprocess.CompletedProcess([], 0, "", ""), "the host block printed no figures: ''"),
        (subprocess.CompletedProcess([], 3, "", "boom"), "exited with status 3: boom"),
    ],
)
def test_a_block_that_fails_ends_the_run_with_what_it_said(
    completed: subprocess.CompletedProcess[str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(private_net, "unavailable_reason", lambda: None)
    monkeypatch.setattr(loopback_stall.subprocess, "run", lambda *a, **k: completed)
    assert loopback_stall.main(["--quick"]) == 1
    assert says in capsys.readouterr().err
