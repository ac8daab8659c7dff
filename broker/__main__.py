"""`python -m broker`: the broker's own subcommands of `offload` (`broker`, `keygen`) without
the rest of the client, as the broker image runs them (`docker run edge-offload/broker broker
--listen ...` is `offload broker --listen ...`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from broker import server
from common.cli import new_parser, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = new_parser(
        "offload",
        "edge-offload's broker: `broker` runs it, `keygen` prints a client's API key. "
        "Each subcommand has its own --help.",
    )
    server.register_cli(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
