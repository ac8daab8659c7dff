"""The `offload` command line: one entry point; the packages that own them add subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from broker import server as broker_server
from common.cli import new_parser, run
from edge_client import cert_commands, commands, demo, ops_commands
from edge_client.demo.cluster import exit_with_parent
from edge_client.mobility import cli as mobility_cli
from images import build as image_build
from modelzoo import cli as models_cli
from node_daemon import server as node_server


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(
        "offload",
        "edge-offload: run deep-learning inference for edge devices on remote GPUs. "
        "Each subcommand has its own --help.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo.register_cli(sub)
    cert_commands.register_cli(sub)
    commands.register_cli(sub)
    ops_commands.register_cli(sub)
    mobility_cli.register_cli(sub)
    broker_server.register_cli(sub)
    image_build.register_cli(sub)
    models_cli.register_cli(sub)
    node_server.register_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    exit_with_parent()  # a child of `offload demo` (or the tests) dies with its parent
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
