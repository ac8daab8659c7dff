"""Regenerate the committed Python code from the .proto files (`make protos`).

Run from anywhere: `python -m protos.generate [--out DIR]`. With `--out`, the code is written
under DIR instead of in place (the freshness test compares such a generation with the tree).
"""

from __future__ import annotations

import argparse
import sys
from importlib.resources import files
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_FILES = (
    "protos/inference/grpc_service.proto",
    "protos/offload/v1/node.proto",
    "protos/offload/v1/broker.proto",
)


def generate(out: Path = ROOT) -> None:
    """Write `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` for every proto file under `out`."""
    include = str(files("grpc_tools") / "_proto")
    for proto in PROTO_FILES:
        (out / proto).parent.mkdir(parents=True, exist_ok=True)
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{ROOT}",
                f"-I{include}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(ROOT / proto),
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {code})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: in place)")
    args = parser.parse_args()
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
