"""`offload` on an install without an extra: the commands that need it say which, in one line;
the others run. The absent package is made absent in a child interpreter (`sys.modules[name] =
None` makes its import fail as a missing one would); tests/integration/test_packaging_roles.py
does the same on a real device-only install."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from edge_client.cli import COMMAND_GROUPS


@pytest.mark.parametrize("group", COMMAND_GROUPS, ids=lambda g: g.module)
def test_each_group_lists_the_commands_its_module_registers(group: object) -> None:
    from edge_client.cli import CommandGroup

    assert isinstance(group, CommandGroup)
    sub = argparse.ArgumentParser().add_subparsers()
    importlib.import_module(group.module).register_cli(sub)
    # A command missing from COMMAND_GROUPS would not say which extra it needs.
    assert set(sub.choices) == set(group.commands), (
        f"edge_client/cli.py's COMMAND_GROUPS lists {group.commands} for {group.module}, "
        f"which registers {tuple(sub.choices)}: make them agree"
    )


def offload_without(missing: str, *argv: str) -> subprocess.CompletedProcess[str]:
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "from edge_client.cli import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_command_whose_extra_is_missing_says_which_in_one_line() -> None:
    done = offload_without("docker", "node", "--listen", "127.0.0.1:0", "--site", "a")
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        "offload node needs the 'server' extra (no module 'docker' here): "
        "pip install 'edge-offload[server]'\n"
    )
    assert done.stdout == ""


def test_the_other_commands_still_run_and_help_lists_every_command() -> None:
    keygen = offload_without("docker", "keygen", "robot-1")
    assert keygen.returncode == 0, keygen.stderr
    assert keygen.stdout.startswith("robot-1.")
    listing = offload_without("docker", "--help")
    assert listing.returncode == 0, listing.stderr
    for group in COMMAND_GROUPS:
        for command in group.commands:
            assert command in listing.stdout
    assert "(needs pip install 'edge-offload[server]')" in listing.stdout


def test_a_module_of_ours_missing_is_an_error_not_an_extra() -> None:
    done = offload_without("broker.placement", "keygen", "robot-1")
    assert done.returncode == 1
    assert "ModuleNotFoundError" in done.stderr
    assert "pip install" not in done.stderr
