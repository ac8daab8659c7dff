"""What every `offload` entry point does around its parser: parse, set up logging, run the
chosen subcommand and turn Ctrl-C into exit status 130; and die with the process that
spawned it (`exit_with_parent`)."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1
PARENT_ENV = "OFFLOAD_PARENT_PID"
"""Set by `edge_client.demo.cluster.spawn` to its own pid for the `offload` it starts."""


def new_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A top-level parser with the common `-v/--verbose` flag."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at DEBUG level instead of INFO"
    )
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse `argv` with `parser` (made by `new_parser`, subcommands setting `func`) and run the
    subcommand; its return value is the exit status."""
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


def exit_with_parent() -> None:
    """In a child `spawn` started: ask the kernel for SIGTERM when the parent dies, and exit
    at once if it already has. Called first thing by `offload` (edge_client.cli) when
    $OFFLOAD_PARENT_PID is set. (Done here, after exec, rather than in a preexec_fn: running
    Python between fork and exec deadlocks a parent with threads, gRPC's for one.)"""
    expected = os.environ.pop(PARENT_ENV, "")
    if not expected or sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if str(os.getppid()) != expected:
        sys.exit(f"the process that started this one ({expected}) has exited")
