"""Committed generated code is fresh; our Open Inference Protocol is Triton's on the wire."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from protos.generate import PROTO_FILES, ROOT, generate
from protos.inference import grpc_service_pb2
from protos.roundtrip import roundtrip_all
from tests.proto_shape import describe

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_committed_code_equals_a_fresh_generation(tmp_path: Path) -> None:
    generate(tmp_path)
    stale = []
    for proto in PROTO_FILES:
        for suffix in GENERATED_SUFFIXES:
            name = proto.removesuffix(".proto") + suffix
            if (tmp_path / name).read_bytes() != (ROOT / name).read_bytes():
                stale.append(name)
    assert not stale, f"generated code is stale, run `make protos`: {stale}"


# tritonclient's generated module defines the same `inference.*` symbols as ours, and
# protobuf's default pool refuses duplicates: describe Triton's in a process of its own.
_TRITON = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from tests.proto_shape import describe
from tritonclient.grpc import service_pb2
print(json.dumps(describe(service_pb2.DESCRIPTOR)))
"""


def test_open_inference_protocol_matches_tritonclient_on_the_wire() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _TRITON], capture_output=True, text=True, check=True
    )
    triton = json.loads(done.stdout)
    ours = json.loads(json.dumps(describe(grpc_service_pb2.DESCRIPTOR)))
    assert ours["package"] == triton["package"] == "inference"
    assert ours["service"] == triton["service"] == "inference.GRPCInferenceService"
    for method, types in ours["methods"].items():
        assert triton["methods"][method] == types, method
    assert set(ours["methods"]) == {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
    }
    for message, fields in ours["messages"].items():
        assert fields == triton["messages"][message], message


def test_generated_code_round_trips_with_this_environments_protobuf() -> None:
    # CI runs the same check at both ends of the declared range (.ci/run).
    assert roundtrip_all() >= 60


def test_declared_protobuf_range_starts_at_the_gencode_version() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    protobuf = next(d for d in declared if d.startswith("protobuf"))
    gencode = re.search(
        r"^# Protobuf Python Version: (\S+)$",
        (ROOT / "protos/offload/v1/node_pb2.py").read_text(),
        re.MULTILINE,
    )
    assert gencode is not None
    # The runtime refuses gencode newer than itself: the floor must be the gencode's version.
    assert protobuf.startswith(f"protobuf>={gencode.group(1)},")
