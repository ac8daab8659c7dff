"""The `offload` command line: one entry point; the packages that own them add subcommands."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from broker import server as broker_server
from edge_client import commands, demo, ops_commands
from edge_client.demo.cluster import exit_with_parent
from edge_client.mobility import cli as mobility_cli
from images import build as image_build
from modelzoo import cli as models_cli
from node_daemon import server as node_server


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offload",
        description=(
            "edge-offload: run deep-learning inference for edge devices on remote GPUs. "
            "Each subcommand has its own --help."
        ),
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at DEBUG level instead of INFO"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo.register_cli(sub)
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
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
