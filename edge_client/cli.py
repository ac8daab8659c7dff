"""The `offload` command line: one entry point; the packages that own them add subcommands.

Each group of subcommands is imported by name, so that an install without a group's extra
still runs the rest: its commands stay listed, and running one says which extra to install
(`pip install 'edge-offload[server]'`) in one line instead of an ImportError's traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from common.cli import exit_with_parent, new_parser, run

OUR_PACKAGES = frozenset(
    {
        "protos", "runtime", "common", "node_daemon", "broker", "migration", "edge_client",
        "images", "modelzoo",
    }
)  # fmt: skip
"""Top-level packages of this distribution: a module of theirs missing is a bug, not an
extra left out."""


@dataclass(frozen=True, slots=True)
class CommandGroup:
    """A module whose `register_cli(subparsers)` adds `commands`, and the extra it needs."""

    module: str
    commands: tuple[str, ...]
    extra: str


COMMAND_GROUPS = (
    CommandGroup("edge_client.demo", ("demo",), "server"),
    CommandGroup("edge_client.cert_commands", ("certs",), "server"),
    CommandGroup(
        "edge_client.commands", ("nodes", "login-link", "deployments", "explain"), "server"
    ),
    CommandGroup(
        "edge_client.ops_commands",
        (
            "deploy",
            "delete",
            "infer",
            "move",
            "migrate",
            "drain",
            "retire",
            "migrations",
            "status",
        ),
        "server",
    ),
    CommandGroup("edge_client.service_commands", ("service",), "server"),
    CommandGroup("edge_client.mobility.cli", ("trace", "simulate"), "sim"),
    CommandGroup("broker.server", ("broker", "keygen"), "server"),
    CommandGroup("images.build", ("image",), "server"),
    CommandGroup("modelzoo.cli", ("models",), "server"),
    CommandGroup("node_daemon.server", ("node",), "server"),
)
"""In the order `offload --help` lists them."""


@dataclass(frozen=True, slots=True)
class MissingExtra:
    """A command group that cannot be imported here: a dependency of its extra is missing."""

    group: CommandGroup
    module: str
    """The missing module, as Python names it."""

    def message(self, command: str) -> str:
        return (
            f"offload {command} needs the {self.group.extra!r} extra (no module "
            f"{self.module!r} here): pip install 'edge-offload[{self.group.extra}]'"
        )


def _register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], group: CommandGroup
) -> MissingExtra | None:
    """Add `group`'s commands to `sub`; when a dependency is missing, placeholders that name
    the extra in `--help`, and the missing module. Our own modules missing: the error."""
    try:
        module = importlib.import_module(group.module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.partition(".")[0] in OUR_PACKAGES:
            raise
        missing = MissingExtra(group, err.name)
        for command in group.commands:
            sub.add_parser(
                command,
                help=f"(needs pip install 'edge-offload[{group.extra}]')",
                add_help=False,
            )
        return missing
    module.register_cli(sub)
    return None


def _build() -> tuple[argparse.ArgumentParser, dict[str, MissingExtra]]:
    parser = new_parser(
        "offload",
        "edge-offload: run deep-learning inference for edge devices on remote GPUs. "
        "Each subcommand has its own --help.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    missing: dict[str, MissingExtra] = {}
    for group in COMMAND_GROUPS:
        absent = _register(sub, group)
        if absent is not None:
            missing.update(dict.fromkeys(group.commands, absent))
    return parser, missing


def build_parser() -> argparse.ArgumentParser:
    """Every command whose extra is installed; the others as placeholders."""
    return _build()[0]


def main(argv: Sequence[str] | None = None) -> int:
    exit_with_parent()  # a child of `offload demo` (or the tests) dies with its parent
    args = sys.argv[1:] if argv is None else list(argv)
    parser, missing = _build()
    # The top-level flags take no value: the first word that is not a flag is the command.
    command = next((a for a in args if not a.startswith("-")), None)
    if command in missing:
        print(missing[command].message(command), file=sys.stderr)
        return 1
    return run(parser, args)


if __name__ == "__main__":
    sys.exit(main())
