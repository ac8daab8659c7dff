"""What every `offload` entry point does around its parser: parse, set up logging, run the
chosen subcommand and turn Ctrl-C into exit status 130."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


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
