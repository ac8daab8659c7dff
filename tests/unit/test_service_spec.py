"""A service's spec and the broker's service flags, refused with the field or flag named
(`broker.values.ServiceSpec.validate`, `broker.server.config_from_args`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from broker.errors import InvalidRequest
from broker.server import config_from_args
from broker.values import MAX_SERVICE_CLIENTS, ServiceSpec
from edge_client.cli import build_parser

SHA = "ab" * 32
SITES = ("site-a", "site-b", "site-c")


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"min_replicas_per_site": -1}, "min_replicas_per_site must be within"),
        ({"max_replicas": 0}, "max_replicas must be within 1..1024, not 0"),
        ({"min_replicas_per_site": 2, "max_replicas": 5}, "max_replicas of at least 6, not 5"),
        ({"latency_slo_ms": float("nan")}, "latency_slo_ms must be within 0..1e6, not nan"),
        ({"max_rps_per_client": -1.0}, "max_rps_per_client must be within"),
        ({"clients": ("bob",), "any_client": True}, "clients or any_client, not both"),
        ({"clients": ("c",) * (MAX_SERVICE_CLIENTS + 1)}, "at most 10000"),
        ({"gpus": 99}, "gpus must be within"),
        ({"model_name": "bad name"}, "model_name 'bad name'"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(changes: dict[str, object], named: str) -> None:
    fields: dict[str, object] = {"model_sha256": SHA, "model_name": "mlp", **changes}
    spec = ServiceSpec(**fields)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=named):
        spec.validate(SITES)


def test_a_spec_round_trips_through_its_stored_json() -> None:
    spec = ServiceSpec(
        model_sha256=SHA,
        model_name="mlp",
        gpus=1,
        clients=("bob", "carol"),
        min_replicas_per_site=1,
        max_replicas=3,
        latency_slo_ms=5,
        max_rps_per_client=50,
    )
    spec.validate(SITES)
    assert ServiceSpec.from_json(spec.to_json()) == spec
    assert spec.allows("bob") and not spec.allows("dave")
    replica = spec.deploy_spec("site-b", "detector")
    assert (replica.site, replica.service, replica.gpus) == ("site-b", "detector", 1)


def _broker_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    (tmp_path / "join-token").write_text("join-token-for-tests-0123456789")
    return build_parser().parse_args(
        [
            "broker", "--listen", "127.0.0.1:0", "--ops-listen", "127.0.0.1:0",
            "--state-dir", str(tmp_path), "--cluster", str(tmp_path / "cluster.yaml"),
            "--join-token-file", str(tmp_path / "join-token"), *extra,
        ]
    )  # fmt: skip


@pytest.mark.parametrize("value", ["0", "nan", "-5", "1e9"])
def test_a_nonsense_service_idle_grace_is_refused(tmp_path: Path, value: str) -> None:
    with pytest.raises(ValueError, match="--service-idle-grace"):
        config_from_args(_broker_args(tmp_path, "--service-idle-grace", value))
    grace = config_from_args(_broker_args(tmp_path, "--service-idle-grace", "30"))
    assert grace.settings.service_idle_s == 30
