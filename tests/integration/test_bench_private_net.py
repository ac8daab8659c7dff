"""`bench.private_net`: a bench's own network namespace, its loopback at an Ethernet MTU,
and `bench.migration` running in one unless told otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import migration, private_net

REPORT = (
    "import json; from bench import private_net; "
    "print(json.dumps({**private_net.network_description(), 'inside': private_net.inside()}))"
)


REPO = Path(__file__).resolve().parents[2]
CHILD = (
    "import signal, sys, time; "
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); "
    "signal.signal(signal.SIGINT, lambda *_: sys.exit(8)); "
    "print('ready', flush=True); time.sleep(60)"
)
PARENT = (
    "import sys; from bench import private_net; "
    f"sys.exit(private_net.run_in_private_network([sys.executable, '-c', {CHILD!r}]))"
)
needs_namespace = pytest.mark.skipif(
    private_net.unavailable_reason() is not None,
    reason=f"a private network namespace {private_net.unavailable_reason()}",
)


@needs_namespace
def test_the_wrapped_command_has_a_loopback_with_an_ethernet_mtu_and_the_hosts_is_left() -> None:
    host_before = private_net.network_description()
    wrapped = private_net.private_network_argv([sys.executable, "-c", REPORT])
    done = subprocess.run(wrapped, capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(done.stdout)
    assert seen["loopback_mtu"] == private_net.ETHERNET_MTU == 1500
    assert seen["private_namespace"] is True and seen["inside"] is True
    assert private_net.network_description() == host_before
    assert host_before["private_namespace"] is False


def test_without_root_there_is_no_private_namespace_and_it_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(private_net.os, "geteuid", lambda: 1000)
    assert private_net.unavailable_reason() == "needs root"
    with pytest.raises(RuntimeError, match="no private network namespace: needs root"):
        private_net.private_network_argv(["true"])


def test_the_migration_bench_refuses_a_private_network_it_cannot_have(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(private_net, "unavailable_reason", lambda: "needs root")
    with pytest.raises(SystemExit) as exited:
        migration.main(["--network", "private", "--runtime", "process", "--quick"])
    assert exited.value.code == 2
    assert "--network private: needs root" in capsys.readouterr().err


def test_the_migration_bench_runs_itself_again_in_a_namespace_with_its_runtime_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a namespace can be had, the bench does not run here: the same arguments,
    `--runtime` added, go to `run_in_private_network`, whose exit status it returns."""
    commands: list[list[str]] = []

    def run_in_private_network(command: list[str]) -> int:
        commands.append(command)
        return 3

    monkeypatch.setattr(private_net, "unavailable_reason", lambda: None)
    monkeypatch.setattr(private_net, "inside", lambda: False)
    monkeypatch.setattr(private_net, "run_in_private_network", run_in_private_network)
    assert migration.main(["--quick", "--runtime", "process", "--models", "mlp"]) == 3
    [command] = commands
    assert command[1:] == [
        "-m", "bench.migration", "--quick", "--runtime", "process", "--models", "mlp",
        "--runtime", "process",
    ]  # fmt: skip


def _parent_with_child_ready() -> subprocess.Popen[str]:
    """`run_in_private_network` in a process of its own (and its own process group), once
    the command it runs has set its signal handlers."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert parent.stdout is not None
    assert parent.stdout.readline() == "ready\n"
    return parent


@needs_namespace
def test_a_sigterm_to_the_bench_reaches_the_command_in_the_namespace() -> None:
    with _parent_with_child_ready() as parent:
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 7  # the command's own exit, passed back


@needs_namespace
def test_on_ctrl_c_the_bench_waits_for_the_command_to_stop_itself() -> None:
    with _parent_with_child_ready() as parent:
        os.killpg(parent.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert parent.wait(timeout=30) == 8  # not a KeyboardInterrupt in the parent
