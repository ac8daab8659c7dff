"""The broker's checks of request values (`broker.rpc.validate` and the conversions that use
it) and what its error messages may carry (`broker.errors.quote`, `client_text`)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from broker.errors import (
    BrokerError,
    Impossible,
    InvalidRequest,
    NodeUnavailable,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    client_text,
    quote,
)
from broker.placement import PriorityClass
from broker.rpc import validate
from broker.rpc.convert import inventory_from_proto, offload_from_proto
from broker.rpc.servicers import _replicas, _strategy, deploy_spec
from broker.rpc.status import status_of
from common import offload
from edge_client.adaptive import Policy, Reason, Target
from migration.mechanism import Strategy
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import node_pb2 as npb

SHA = "ab" * 32
DEPLOY = {"model_sha256": SHA, "model_name": "mlp", "site": "site-a", "gpus": 1}


def refused(check: Callable[[], Any], *expected: str) -> str:
    """The message of the InvalidRequest `check()` raises; it names each of `expected`."""
    with pytest.raises(InvalidRequest) as caught:
        check()
    message = str(caught.value)
    for text in expected:
        assert text in message, message
    return message


# --- numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -0.1, 10.5, 1e308])
def test_a_number_must_be_finite_and_within_its_bounds(value: float) -> None:
    refused(lambda: validate.number("cpus", value, 0, 10), "cpus", "0..10")


@pytest.mark.parametrize("value", [0.0, 5e-324, 3.5, 10.0])
def test_a_number_within_its_bounds_is_returned(value: float) -> None:
    assert validate.number("cpus", value, 0, 10) == value


def test_an_integer_must_be_within_its_bounds() -> None:
    assert validate.integer("memory_mib", 7, 0, 7) == 7
    refused(lambda: validate.integer("memory_mib", 8, 0, 7), "memory_mib", "0..7", "not 8")
    refused(lambda: validate.integer("memory_mib", -1, 0, 7), "0..7", "not -1")


@pytest.mark.parametrize(
    ("field", "good", "bad", "bound"),
    [
        ("cpus", validate.MAX_CPUS, validate.MAX_CPUS + 0.5, "0..1024"),
        ("cpus", 0.25, math.nan, "0..1024"),
        ("cpus", 0.25, math.inf, "0..1024"),
        ("cpus", 0.25, -1.0, "0..1024"),
        ("memory_mib", validate.MAX_MEMORY_MIB, validate.MAX_MEMORY_MIB + 1, "0..16777216"),
        ("memory_mib", 512, 2**63 - 1, "0..16777216"),
        ("gpu_memory_mib", validate.MAX_GPU_MEMORY_MIB, 2**40, "0..1048576"),
        ("gpu_memory_mib", 1024, -1, "0..1048576"),
        ("latency_slo_ms", 60_000.0, 60_000.5, "0..60000"),
        ("latency_slo_ms", 5.0, math.nan, "0..60000"),
        ("latency_slo_ms", 5.0, -math.inf, "0..60000"),
        ("cpus_min", 0.25, math.nan, "0..1024"),
        ("cpus_max", 2.0, -0.5, "0..1024"),
    ],
)
def test_deploy_numbers_are_bounded(field: str, good: float, bad: float, bound: str) -> None:
    assert getattr(deploy_spec(pb.DeployRequest(**DEPLOY, **{field: good})), field) == good
    refused(lambda: deploy_spec(pb.DeployRequest(**DEPLOY, **{field: bad})), field, bound)


def test_a_cpu_floor_and_ceiling_bracket_the_cpus_asked() -> None:
    spec = deploy_spec(pb.DeployRequest(**DEPLOY, cpus=1.0, cpus_min=0.5, cpus_max=2.0))
    spec.validate()
    resources = spec.resources(PriorityClass.STANDBY)
    assert (resources.cpus_min, resources.cpus, resources.cpus_max) == (0.5, 1.0, 2.0)
    assert resources.priority == 0
    assert deploy_spec(pb.DeployRequest(**DEPLOY, cpus=1.0)).resources().priority == 2
    for fields, error in [
        ({"cpus": 1.0, "cpus_min": 1.5}, "cpus_min 1.5 must not exceed cpus 1"),
        ({"cpus": 1.0, "cpus_max": 0.5}, "need cpus_min <= cpus <= cpus_max, not 0 <= 1 <= 0.5"),
        ({"cpus_max": 2.0}, "needs cpus > 0"),
    ]:
        bad = deploy_spec(pb.DeployRequest(**DEPLOY, **fields))
        refused(bad.validate, *error.split(", not"))


def test_a_deploy_priority_is_a_known_class() -> None:
    assert deploy_spec(pb.DeployRequest(**DEPLOY)).priority is PriorityClass.STANDARD
    critical = pb.DeployRequest(**DEPLOY, priority=pb.PRIORITY_CLASS_CRITICAL)
    assert deploy_spec(critical).priority is PriorityClass.CRITICAL
    for unknown in (4, -1, 2**31 - 1):
        request = pb.DeployRequest(**DEPLOY, priority=unknown)  # type: ignore[arg-type]
        refused(lambda r=request: deploy_spec(r), f"priority {unknown}", "3 (critical)")


@pytest.mark.parametrize(
    ("field", "value"),
    [("model_sha256", "AB" * 32), ("model_sha256", SHA[:-1]), ("site", ""), ("site", "a\nb")],
)
def test_deploy_ids_are_checked(field: str, value: str) -> None:
    refused(lambda: deploy_spec(pb.DeployRequest(**{**DEPLOY, field: value})), field)


def test_an_epoch_names_a_replica_from_1() -> None:
    assert validate.epoch("epoch", 1) == 1
    assert validate.epoch("epoch", validate.MAX_EPOCH) == validate.MAX_EPOCH
    for bad in (0, -1, validate.MAX_EPOCH + 1):
        refused(lambda b=bad: validate.epoch("epoch", b), "epoch", f"1..{validate.MAX_EPOCH}")


def test_observation_bounds() -> None:
    assert validate.number("longest_gap_ms", validate.MAX_GAP_MS, 0, validate.MAX_GAP_MS)
    refused(
        lambda: validate.number("longest_gap_ms", math.inf, 0, validate.MAX_GAP_MS),
        "longest_gap_ms",
        "0..3.6e+06",
    )
    refused(
        lambda: validate.integer("failed_requests", 2**31 + 1, 0, validate.MAX_REQUESTS),
        "failed_requests",
        f"0..{2**31}",
    )


def test_a_span_gap_is_a_gap_no_shorter_than_the_switch_gap() -> None:
    assert validate.span_gap(140.0, 80.0) == 140.0
    assert validate.span_gap(80.0 - 1e-4, 80.0) == 80.0  # a client's rounding
    refused(lambda: validate.span_gap(math.nan, 80.0), "span_gap_ms", "0..3.6e+06")
    refused(lambda: validate.span_gap(-1.0, 0.0), "span_gap_ms", "0..3.6e+06")
    refused(lambda: validate.span_gap(50.0, 80.0), "span_gap_ms", "at least longest_gap_ms (80)")


# --- strings -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["d-0123456789", "m-ff", "alice", "A.b_c-1", "x" * 64])
def test_an_identifier_is_short_and_plain(value: str) -> None:
    assert validate.identifier("deployment_id", value) == value


@pytest.mark.parametrize("value", ["", "-d", ".d", "x" * 65, "d 1", "d/1", "é", "d\x00"])
def test_other_identifiers_are_refused(value: str) -> None:
    refused(lambda: validate.identifier("deployment_id", value), "deployment_id", "1-64")


def test_node_ids_sha256_sites_and_names() -> None:
    assert validate.node_id("node_id", "node-a.1") == "node-a.1"
    refused(lambda: validate.node_id("to_node", "Node-A"), "to_node", "a-z")
    assert validate.sha256("sha256", SHA) == SHA
    refused(lambda: validate.sha256("sha256", SHA.upper()), "64 lowercase hex digits")
    assert validate.site("site", "site a") == "site a"
    refused(lambda: validate.site("site", "s" * 65), "site", "1-64")
    assert validate.name("name", "resnet50 v1.onnx") == "resnet50 v1.onnx"
    refused(lambda: validate.name("name", "a\x1b[31m"), "name", "control characters")


def test_a_refusal_quotes_only_a_short_prefix() -> None:
    message = refused(lambda: validate.identifier("deployment_id", "d" * 7_000_000))
    assert len(message) < 200
    assert "(7000000 characters)" in message


def test_strategy_names() -> None:
    assert _strategy("") is Strategy.MAKE_BEFORE_BREAK
    assert _strategy("stop_start") is Strategy.STOP_START
    message = refused(lambda: _strategy("z" * 10_000), "make_before_break or stop_start")
    assert len(message) < 200


def test_reported_replicas_are_bounded() -> None:
    replica = npb.Replica(replica_id="d-1-2", state=npb.REPLICA_STATE_READY)
    assert _replicas([replica]) == [("d-1-2", "ready")]
    refused(lambda: _replicas([npb.Replica(replica_id="")]), "replicas[0].replica_id")
    refused(lambda: _replicas([replica] * 1025), "replicas", "at most 1024")


# --- inventories ----------------------------------------------------------------------------


def _gpu(index: int, **fields: Any) -> npb.Gpu:
    return npb.Gpu(
        **{"index": index, "uuid": f"GPU-{index}", "name": "A100", "memory_total_mib": 40960}
        | fields
    )


def test_an_inventory_within_bounds_converts() -> None:
    inventory = inventory_from_proto(
        npb.Inventory(
            gpus=[_gpu(0, numa_node=-1), _gpu(1, numa_node=1, utilization_pct=100)],
            links=[npb.GpuLink(gpu_a="GPU-0", gpu_b="GPU-1", kind="NV12")],
            nics=["eth0"],
            cuda_version="12.4",
        )
    )
    assert [g.numa_node for g in inventory.gpus] == [None, 1]
    assert str(inventory.links[(0, 1)]) == "NV12"


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        (_gpu(0, memory_total_mib=0), "memory_total_mib must be within 1..1048576"),
        (_gpu(0, memory_total_mib=2**62), "memory_total_mib must be within 1..1048576"),
        (_gpu(0, memory_used_mib=50000), "memory_used_mib must be within 0..40960"),
        (_gpu(0, utilization_pct=101), "utilization_pct must be within 0..100"),
        (_gpu(0, numa_node=5000), "numa_node must be within 0..1023"),
        (_gpu(64), "index must be within 0..63"),
        (_gpu(0, uuid=""), "uuid"),
        (_gpu(0, name="x" * 500), "name"),
    ],
)
def test_inventory_values_out_of_bounds_are_refused(gpu: npb.Gpu, expected: str) -> None:
    refused(
        lambda: inventory_from_proto(npb.Inventory(gpus=[gpu])), "inventory.gpus[0].", expected
    )


def test_inventory_lists_are_bounded() -> None:
    refused(
        lambda: inventory_from_proto(npb.Inventory(gpus=[_gpu(0)] * 65)),
        "inventory.gpus has 65 entries",
    )
    refused(lambda: inventory_from_proto(npb.Inventory(nics=["eth0"] * 65)), "inventory.nics")
    link = npb.GpuLink(gpu_a="GPU-0", gpu_b="GPU-1", kind="NV" + "9" * 100)
    message = refused(
        lambda: inventory_from_proto(npb.Inventory(gpus=[_gpu(0), _gpu(1)], links=[link])),
        "unknown GPU link kind",
    )
    assert len(message) < 200


# --- messages ------------------------------------------------------------------------------


def test_quote_keeps_short_values_and_cuts_long_ones() -> None:
    assert quote("node-a") == "'node-a'"
    assert quote("a\x1b[31m\n") == repr("a\x1b[31m\n")
    assert quote("x" * 40) == repr("x" * 40)
    long = quote("x" * 41)
    assert long == f"{'x' * 40!r}… (41 characters)"


def test_client_text_removes_what_a_client_must_not_see() -> None:
    node_said = (
        "\x1b[31mERROR\x1b[0m replica failed: Traceback:\n"
        '  File "/opt/offload/runtime/server.py", line 12\n'
        "ValueError: cannot load /var/lib/offload/models/abc.onnx\x07"
    )
    text = client_text(node_said)
    assert "\x1b" not in text and "\x07" not in text
    assert "/opt/" not in text and "/var/lib" not in text and "<path>" in text
    assert "ValueError" not in text
    assert "ERROR replica failed" in text and "cannot load <path>" in text
    assert client_text("fine: site-a, 3 GPUs") == "fine: site-a, 3 GPUs"


def test_client_text_is_bounded() -> None:
    text = client_text("y" * 10_000)
    assert text.startswith("y" * 2000)
    assert text.endswith("… (8000 more characters)")
    assert re.fullmatch(r"y{10}… \(5 more characters\)", client_text("y" * 15, limit=10))


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
        (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
        (NotFound, grpc.StatusCode.NOT_FOUND),
        (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Impossible, grpc.StatusCode.FAILED_PRECONDITION),
        (NodeUnavailable, grpc.StatusCode.UNAVAILABLE),
        (BrokerError, grpc.StatusCode.INTERNAL),
    ],
)
def test_every_error_has_its_status(error: type[BrokerError], code: grpc.StatusCode) -> None:
    assert status_of(error("x")) == code


# --- adaptive offload summaries -----------------------------------------------------------


def offload_message(**changes: Any) -> pb.OffloadSummary:
    """A summary as `edge_client.client` sends it, with `changes`."""
    fields: dict[str, Any] = {
        "session": "0123456789abcdef",
        "policy": "fastest",
        "local_model": "mlp.onnx",
        "decisions": [
            pb.OffloadDecisionCount(target="remote", reason="measuring", requests=2),
            pb.OffloadDecisionCount(target="local", reason="faster", requests=50),
            pb.OffloadDecisionCount(target="local", reason="fallback", requests=1),
        ],
        "remote_requests": 2,
        "local_requests": 51,
        "fallbacks": 1,
        "remote_estimate_ms": 12.5,
        "local_estimate_ms": 0.0,
        "remote_reachable": True,
    }
    return pb.OffloadSummary(**{**fields, **changes})


def test_an_offload_summary_converts_with_zero_estimates_as_none() -> None:
    summary = offload_from_proto(offload_message())
    assert (summary.session, summary.policy, summary.local_model) == (
        "0123456789abcdef",
        "fastest",
        "mlp.onnx",
    )
    assert [(c.target, c.reason, c.requests) for c in summary.decisions] == [
        ("local", "fallback", 1),
        ("local", "faster", 50),
        ("remote", "measuring", 2),
    ]
    assert (summary.remote_requests, summary.local_requests, summary.fallbacks) == (2, 51, 1)
    assert (summary.remote_estimate_ms, summary.local_estimate_ms) == (12.5, None)
    assert summary.remote_reachable
    empty = offload_from_proto(
        pb.OffloadSummary(session="s1", policy="remote-then-local", remote_reachable=False)
    )
    assert (empty.decisions, empty.local_model, empty.remote_estimate_ms) == ((), "", None)


def _decision(target: str = "remote", reason: str = "policy", requests: int = 1) -> Any:
    return pb.OffloadDecisionCount(target=target, reason=reason, requests=requests)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"session": ""}, "offload.session '' must be 1-64"),
        ({"session": "s" * 65}, "offload.session"),
        ({"session": "s\x00"}, "offload.session"),
        ({"policy": "nearest"}, "offload.policy 'nearest' is not one of: fastest, local"),
        ({"policy": ""}, "offload.policy '' is not one of"),
        ({"local_model": "models/mlp.onnx"}, "offload.local_model"),
        ({"local_model": "m" * 256}, "offload.local_model"),
        ({"local_model": "mlp\x1b[31m.onnx"}, "offload.local_model"),
        ({"remote_estimate_ms": math.nan}, "offload.remote_estimate_ms must be a finite number"),
        ({"remote_estimate_ms": math.inf}, "offload.remote_estimate_ms must be a finite number"),
        ({"local_estimate_ms": -1.0}, "offload.local_estimate_ms must be a finite number"),
        ({"local_estimate_ms": 1e308}, "within 0..3.6e+06"),
        ({"remote_requests": 2**40}, "offload.remote_requests must be within 0..2147483648"),
        ({"local_requests": -1}, "offload.local_requests must be within"),
        ({"fallbacks": 2**63 - 1}, "offload.fallbacks must be within"),
        ({"remote_requests": 3}, "offload.remote_requests 3 is not the sum of its decisions"),
        ({"local_requests": 50}, "offload.local_requests 50 is not the sum of its decisions"),
        ({"fallbacks": 0}, "offload.fallbacks 0 is not the local requests of reason fallback"),
        (
            {"decisions": [_decision(target="cloud")], "remote_requests": 0},
            "offload.decisions[0].target 'cloud' is not one of: local, remote",
        ),
        (
            {"decisions": [_decision(reason="cheaper")], "remote_requests": 1},
            "offload.decisions[0].reason 'cheaper' is not one of",
        ),
        (
            {"decisions": [_decision(requests=2**31 + 1)], "remote_requests": 0},
            "offload.decisions[0].requests must be within 0..2147483648",
        ),
        (
            {"decisions": [_decision(requests=-5)], "remote_requests": 0},
            "offload.decisions[0].requests must be within",
        ),
        (
            {"decisions": [_decision(), _decision()], "remote_requests": 2},
            "offload.decisions[1] repeats target remote with reason policy",
        ),
        (
            {"decisions": [_decision()] * 13, "remote_requests": 13},
            "offload.decisions has 13 entries; at most 12",
        ),
    ],
)
def test_hostile_offload_summaries_are_refused_naming_the_field(
    changes: dict[str, Any], expected: str
) -> None:
    message = refused(
        lambda: offload_from_proto(
            offload_message(**{"local_requests": 0, "fallbacks": 0, **changes})
            if "decisions" in changes
            else offload_message(**changes)
        ),
        expected,
    )
    assert len(message) < 200, message


def test_the_broker_accepts_exactly_the_words_the_client_uses() -> None:
    assert {p.value for p in Policy} == offload.POLICIES
    assert {t.value for t in Target} == offload.TARGETS
    assert {r.value for r in Reason} == offload.REASONS
