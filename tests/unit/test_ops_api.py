"""The ops HTTP server over real HTTP on loopback: routes, content types, JSON shapes, errors.

`StaticOpsView` is an in-memory `OpsView` (the data-source seam the broker implements), with a
DGX-like node (8 GPUs, NV12 between every pair), a 4-GPU PCIe workstation, one deployment on
four NVLink GPUs, two finished migrations (one pre-warmed) and two standby replicas.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from broker.ops import (
    BrokerMetrics,
    OpsAuth,
    create_ops_app,
    start_ops_server,
)
from broker.ops.auth import LOGIN_CODE_TTL_S, MAX_LOGIN_CODES, SESSION_COOKIE
from broker.ops.metrics import (
    CLIENT_SERIES_PER_SERVICE,
    MIGRATION_OUTCOMES,
    MIGRATION_TRIGGERS,
    STANDBY_EVENTS,
    MetricFigures,
    ServiceClientFigures,
    ServiceFigures,
)
from broker.state import MigrationTrigger
from common.certs import issue, make_ca
from edge_client.ops_commands import _status
from migration.mechanism import Outcome
from tests.ops_support import (
    DEPLOYMENT_ID,
    OPS_TOKEN,
    SERVICE,
    StaticOpsView,
    figures_from_views,
    sample_deployments,
    sample_load,
    sample_nodes,
    sample_prewarm,
    sample_services,
)


@dataclass
class OpsServer:
    base_url: str
    view: StaticOpsView
    metrics: BrokerMetrics
    http: aiohttp.ClientSession


@pytest.fixture
async def ops() -> AsyncIterator[OpsServer]:
    view = StaticOpsView()
    metrics = BrokerMetrics()
    app = create_ops_app(view, metrics, OpsAuth(OPS_TOKEN))
    runner, port = await start_ops_server(app, "127.0.0.1", 0)
    try:
        headers = {"Authorization": f"Bearer {OPS_TOKEN}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            yield OpsServer(f"http://127.0.0.1:{port}", view, metrics, http)
    finally:
        await runner.cleanup()


@pytest.fixture
async def locked_metrics() -> AsyncIterator[str]:
    """An ops server whose /metrics needs the token too; its base URL."""
    app = create_ops_app(StaticOpsView(), BrokerMetrics(), OpsAuth(OPS_TOKEN, metrics_open=False))
    runner, port = await start_ops_server(app, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_healthz_is_plain_ok(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/healthz") as response:
        assert response.status == 200
        assert response.content_type == "text/plain"
        assert await response.text() == "ok"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/api/nodes", sample_nodes()),
        ("/api/deployments", sample_deployments()),
        ("/api/prewarm", sample_prewarm()),
    ],
)
async def test_api_returns_the_view_as_json(
    ops: OpsServer, path: str, expected: list | dict
) -> None:
    async with ops.http.get(ops.base_url + path) as response:
        assert response.status == 200
        assert response.content_type == "application/json"
        assert response.headers["Cache-Control"] == "no-store"
        assert await response.json() == expected


async def test_api_nodes_shape(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/api/nodes") as response:
        nodes = await response.json()
    assert [n["node_id"] for n in nodes] == ["node-dgx-a", "node-ws-b"]
    dgx, workstation = nodes
    assert len(dgx["gpus"]) == 8
    assert len(dgx["links"]) == 28
    assert {link["kind"] for link in dgx["links"]} == {"NV12"}
    assert {link["kind"] for link in workstation["links"]} == {"PIX", "SYS"}
    assert [g["holders"] for g in dgx["gpus"][:4]] == [[DEPLOYMENT_ID]] * 4
    assert all(g["free"] for g in workstation["gpus"])
    assert set(dgx["gpus"][0]) == {"index", "uuid", "name", "memory_total_mib", "free", "holders"}
    assert workstation["last_heartbeat_age_s"] is None


async def test_api_migrations_keeps_the_timeline(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/api/migrations") as response:
        assert response.status == 200
        assert response.headers["Cache-Control"] == "no-store"
        newer, migration = await response.json()
    assert (newer["migration_id"], newer["prewarmed"]) == ("mig-0002", True)
    assert (migration["migration_id"], migration["prewarmed"]) == ("mig-0001", False)
    assert (migration["downtime_ms"], migration["span_gap_ms"]) == (42.5, 97.5)
    assert [e["event"] for e in migration["timeline"]] == [
        "triggered",
        "target_ready",
        "switched",
        "drained",
    ]
    assert migration["timeline"] == ops.view.migration_list[1]["timeline"]


async def test_api_prewarm_lists_the_budget_and_standbys(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/api/prewarm") as response:
        assert response.status == 200
        assert response.headers["Cache-Control"] == "no-store"
        prewarm = await response.json()
    assert prewarm["budget"] == 4
    left, ready = prewarm["standbys"]
    assert set(ready) == {
        "deployment_id", "replica_id", "node_id", "site", "gpus", "probability", "state",
        "age_s",
    }  # fmt: skip
    assert (ready["site"], ready["probability"], ready["state"]) == ("campus-west", 0.62, "ready")
    assert (left["probability"], left["state"]) == (None, "retiring")
    ops.view.prewarm_info = {"budget": 0, "standbys": []}
    async with ops.http.get(f"{ops.base_url}/api/prewarm") as response:
        assert await response.json() == {"budget": 0, "standbys": []}


async def test_metrics_exposes_state_and_observations(ops: OpsServer) -> None:
    ops.metrics.observe_placement(0.0012)
    ops.metrics.observe_decision(0.0031)
    ops.metrics.observe_placement_lock("decide", 0.25, 0.0031)
    ops.metrics.observe_placement_lock("delete", 0.0, 0.5)
    ops.metrics.record_migration("succeeded", "mobility", 0.0425)
    ops.metrics.record_migration("rolled_back", "rebalance", None)
    ops.metrics.count_resize("usage", up=True)
    ops.metrics.observe_span_gap(0.0975)
    ops.metrics.observe_state_commit(1)
    ops.metrics.observe_state_commit(5)
    with pytest.raises(ValueError, match="at least one call"):
        ops.metrics.observe_state_commit(0)
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        assert response.status == 200
        assert response.content_type == "text/plain"
        assert "version=" in response.headers["Content-Type"]
        text = await response.text()
    assert 'offload_nodes{state="ready"} 2.0' in text
    assert 'offload_gpus{state="free"} 8.0' in text
    assert 'offload_gpus{state="used"} 4.0' in text
    assert 'offload_deployments{state="running"} 1.0' in text
    assert "offload_placement_seconds_count 1.0" in text
    assert 'offload_placement_seconds_bucket{le="0.002"} 1.0' in text
    assert 'offload_placement_seconds_bucket{le="0.001"} 0.0' in text
    assert "offload_deploy_decision_seconds_count 1.0" in text
    assert "offload_deploy_decision_seconds_sum 0.0031" in text
    assert 'offload_placement_lock_acquisitions_total{use="decide"} 1.0' in text
    assert 'offload_placement_lock_acquisitions_total{use="delete"} 1.0' in text
    assert 'offload_placement_lock_wait_seconds_total{use="decide"} 0.25' in text
    assert 'offload_placement_lock_held_seconds_total{use="decide"} 0.0031' in text
    assert 'offload_placement_lock_held_seconds_total{use="delete"} 0.5' in text
    assert "offload_migration_downtime_seconds_count 1.0" in text
    assert 'offload_migration_downtime_seconds_bucket{le="0.05"} 1.0' in text
    assert "offload_migration_span_gap_seconds_count 1.0" in text
    assert 'offload_migration_span_gap_seconds_bucket{le="0.05"} 0.0' in text
    assert 'offload_migration_span_gap_seconds_bucket{le="0.1"} 1.0' in text
    assert 'offload_migrations_total{outcome="succeeded",trigger="mobility"} 1.0' in text
    assert 'offload_migrations_total{outcome="rolled_back",trigger="rebalance"} 1.0' in text
    assert 'offload_resizes_total{direction="up",policy="usage"} 1.0' in text
    assert "offload_state_commits_total 2.0" in text
    assert "offload_state_calls_total 6.0" in text


async def test_metrics_show_each_nodes_and_deployments_latest_load(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        families = {f.name: f for f in text_string_to_metric_families(await response.text())}

    def values(name: str) -> dict[tuple[str, ...], float]:
        return {tuple(s.labels.values()): s.value for s in families[name].samples}

    assert values("offload_node_load") == {
        ("node-dgx-a", "metro-east"): 0.95,
        ("node-ws-b", "campus-west"): 0.0,
    }
    assert values("offload_node_cpu_used_cores")[("node-dgx-a",)] == 15.2
    assert values("offload_node_cpu_cores")[("node-ws-b",)] == 4.0
    assert values("offload_node_memory_used_bytes")[("node-dgx-a",)] == 2050 * 1024 * 1024
    dep = (DEPLOYMENT_ID,)
    assert values("offload_deployment_request_rate") == {dep: 42.5}
    assert values("offload_deployment_failure_rate") == {dep: 0.5}
    assert values("offload_deployment_latency_p99_seconds") == {dep: 0.03}
    assert values("offload_deployment_latency_p50_seconds") == {dep: 0.011}
    assert values("offload_deployment_latency_slo_seconds") == {dep: 0.05}
    assert values("offload_deployment_cpu_limit_cores") == {dep: 1.25}
    assert values("offload_deployment_cpu_used_cores") == {dep: 0.9}
    # A deployment that is gone, or a figure its node could not read, has no series.
    ops.view.load_info["deployments"][0]["points"][-1][1:4] = [None, None, None]
    ops.view.load_info["nodes"].pop()
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        text = await response.text()
    assert "offload_deployment_request_rate{" not in text
    assert "offload_deployment_latency_p99_seconds{" not in text
    assert 'offload_deployment_cpu_limit_cores{deployment="dep-7f3a"} 1.25' in text
    assert 'node="node-ws-b"' not in text


async def test_api_load_serves_the_views_load(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/api/load") as response:
        assert response.status == 200
        assert await response.json() == sample_load()


async def test_metrics_state_that_empties_reads_zero(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        assert 'offload_deployments{state="running"} 1.0' in await response.text()
    ops.view.deployment_list = []
    ops.view.node_list[1]["state"] = "lost"
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        text = await response.text()
    assert 'offload_deployments{state="running"} 0.0' in text
    assert 'offload_nodes{state="ready"} 1.0' in text
    assert 'offload_nodes{state="lost"} 1.0' in text


def test_metrics_refuse_negative_or_nan_seconds() -> None:
    metrics = BrokerMetrics()
    with pytest.raises(ValueError, match="placement time"):
        metrics.observe_placement(-0.001)
    with pytest.raises(ValueError, match="decision time"):
        metrics.observe_decision(float("nan"))
    with pytest.raises(ValueError, match="migration downtime"):
        metrics.record_migration("succeeded", "operator", float("nan"))
    with pytest.raises(ValueError, match="migration span gap"):
        metrics.observe_span_gap(float("inf"))
    body, _ = metrics.render()
    # The refused migration was not counted either.
    assert b'offload_migrations_total{outcome="succeeded",trigger="operator"} 0.0' in body


def test_every_migration_series_exists_at_zero_from_the_start() -> None:
    body = BrokerMetrics().render()[0].decode()
    assert {str(o) for o in Outcome} == set(MIGRATION_OUTCOMES)
    assert {str(t) for t in MigrationTrigger} == set(MIGRATION_TRIGGERS)
    for outcome in Outcome:
        for trigger in MigrationTrigger:
            series = f'offload_migrations_total{{outcome="{outcome}",trigger="{trigger}"}} 0.0'
            assert series in body


def test_registries_are_independent() -> None:
    first, second = BrokerMetrics(), BrokerMetrics()
    first.observe_placement(0.01)
    assert b"offload_placement_seconds_count 1.0" in first.render()[0]
    assert b"offload_placement_seconds_count 0.0" in second.render()[0]


async def test_page_and_its_files_are_served(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/") as response:
        assert response.status == 200
        assert response.content_type == "text/html"
        assert "default-src 'self'" in response.headers["Content-Security-Policy"]
        page = await response.text()
    assert '<script src="/static/dashboard.js"' in page
    for path, content_type in [
        ("/static/dashboard.js", "text/javascript"),
        ("/static/dashboard.css", "text/css"),
    ]:
        async with ops.http.get(ops.base_url + path) as response:
            assert response.status == 200
            assert response.content_type == content_type
            assert len(await response.read()) > 0


@pytest.mark.parametrize("path", ["/nope", "/api/nodes/extra", "/static/missing.js", "/api"])
async def test_unknown_path_is_json_404(ops: OpsServer, path: str) -> None:
    async with ops.http.get(ops.base_url + path) as response:
        assert response.status == 404
        assert response.content_type == "application/json"
        body = await response.json()
    assert body["status"] == 404
    assert path in body["error"]


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["/api/nodes", "/api/prewarm", "/metrics", "/healthz", "/"])
async def test_other_methods_are_json_405(ops: OpsServer, method: str, path: str) -> None:
    async with ops.http.request(method, ops.base_url + path) as response:
        assert response.status == 405
        assert response.content_type == "application/json"
        assert "GET" in response.headers["Allow"]
        assert (await response.json())["status"] == 405


@pytest.mark.parametrize(
    "path", ["/api/nodes", "/api/deployments", "/api/migrations", "/api/prewarm", "/metrics"]
)
async def test_view_failure_is_logged_json_500(
    ops: OpsServer, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    ops.view.failure = RuntimeError("registry unavailable")
    with caplog.at_level(logging.ERROR, logger="broker.ops.app"):
        async with ops.http.get(ops.base_url + path) as response:
            assert response.status == 500
            assert response.content_type == "application/json"
            body = await response.json()
    assert body["status"] == 500
    assert "RuntimeError: registry unavailable" in body["error"]
    assert any(path in r.getMessage() and r.exc_info for r in caplog.records)


async def test_view_data_json_cannot_carry_is_500(ops: OpsServer) -> None:
    ops.view.deployment_list[0]["epoch"] = float("nan")  # type: ignore[typeddict-item]
    async with ops.http.get(f"{ops.base_url}/api/deployments") as response:
        assert response.status == 500
        assert "not JSON-serialisable" in (await response.json())["error"]


@pytest.mark.parametrize(
    "path",
    ["/api/nodes", "/api/deployments", "/api/migrations", "/api/prewarm", "/api/nope", "/nope"],
)
@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong-token", f"Bearer {OPS_TOKEN}x", OPS_TOKEN, "Bearer "]
)
async def test_api_without_the_token_is_json_401_with_no_data(
    ops: OpsServer, path: str, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    async with (
        aiohttp.ClientSession(headers=headers) as anonymous,
        anonymous.get(ops.base_url + path) as response,
    ):
        assert response.status == 401
        assert response.content_type == "application/json"
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        body = await response.json()
    assert body["status"] == 401
    assert "--ops-token-file" in body["error"]
    assert set(body) == {"error", "status"}


async def test_healthz_and_metrics_stay_open(ops: OpsServer) -> None:
    async with aiohttp.ClientSession() as anonymous:
        for path in ("/healthz", "/metrics", "/static/dashboard.js", "/login"):
            async with anonymous.get(ops.base_url + path) as response:
                assert response.status == 200, path


async def test_metrics_can_require_the_token(locked_metrics: str) -> None:
    async with aiohttp.ClientSession() as anonymous:
        async with anonymous.get(f"{locked_metrics}/metrics") as response:
            assert response.status == 401
        async with anonymous.get(f"{locked_metrics}/healthz") as response:
            assert response.status == 200
    headers = {"Authorization": f"Bearer {OPS_TOKEN}"}
    async with (
        aiohttp.ClientSession(headers=headers) as operator,
        operator.get(f"{locked_metrics}/metrics") as response,
    ):
        assert response.status == 200
        assert "offload_nodes" in await response.text()


async def test_the_dashboard_sends_a_browser_without_a_session_to_login(ops: OpsServer) -> None:
    async with aiohttp.ClientSession() as browser:
        async with browser.get(f"{ops.base_url}/", allow_redirects=False) as response:
            assert response.status == 303
            assert response.headers["Location"] == "/login"
        async with browser.get(f"{ops.base_url}/login") as response:
            page = await response.text()
    assert '<form id="login" method="post" action="/login">' in page
    assert DEPLOYMENT_ID not in page


async def test_login_gives_a_cookie_session_that_reads_the_api(ops: OpsServer) -> None:
    jar = aiohttp.CookieJar(unsafe=True)  # cookies of 127.0.0.1
    async with aiohttp.ClientSession(cookie_jar=jar) as browser:
        login = f"{ops.base_url}/login"
        async with browser.post(login, data={"token": "wrong"}) as response:
            assert response.status == 401
            assert "wrong token" in await response.text()
        assert len(jar) == 0
        async with browser.post(login, data={"token": OPS_TOKEN}, allow_redirects=False) as r:
            assert (r.status, r.headers["Location"]) == (303, "/")
            cookie = r.cookies[SESSION_COOKIE]
        assert cookie["httponly"] and cookie["samesite"] == "Strict"
        assert not cookie["secure"]  # over plain HTTP a Secure cookie would never come back
        assert OPS_TOKEN not in cookie.value
        async with browser.get(f"{ops.base_url}/api/deployments") as response:
            assert response.status == 200
            assert [d["deployment_id"] for d in await response.json()] == [DEPLOYMENT_ID]
        async with browser.post(f"{ops.base_url}/logout", allow_redirects=False) as response:
            assert response.status == 303
        async with browser.get(f"{ops.base_url}/api/deployments") as response:
            assert response.status == 401


async def test_over_https_the_session_cookie_is_secure(tmp_path: Path) -> None:
    ca, ca_key = make_ca("ops test CA")
    cert, key = issue(ca, ca_key, "broker", ["localhost"], ["127.0.0.1"])
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client_context = ssl.create_default_context(cadata=ca.decode())
    app = create_ops_app(StaticOpsView(), BrokerMetrics(), OpsAuth(OPS_TOKEN))
    runner, port = await start_ops_server(app, "127.0.0.1", 0, server_context)
    try:
        base_url = f"https://127.0.0.1:{port}"
        jar = aiohttp.CookieJar(unsafe=True)  # cookies of 127.0.0.1
        async with aiohttp.ClientSession(cookie_jar=jar) as browser:
            async with browser.post(
                f"{base_url}/login", data={"token": OPS_TOKEN}, ssl=client_context,
                allow_redirects=False,
            ) as response:  # fmt: skip
                assert response.status == 303
                cookie = response.cookies[SESSION_COOKIE]
            assert cookie["secure"] and cookie["httponly"] and cookie["samesite"] == "Strict"
            async with browser.get(f"{base_url}/api/nodes", ssl=client_context) as response:
                assert response.status == 200
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"token=\xff\xfe", "application/x-www-form-urlencoded"),
        (
            b'--b\r\nContent-Disposition: form-data; name="token"\r\n\r\n\xff\xfe\r\n--b--\r\n',
            "multipart/form-data; boundary=b",
        ),
    ],
)
async def test_a_login_form_that_is_not_utf8_is_400_without_a_traceback(
    ops: OpsServer, caplog: pytest.LogCaptureFixture, body: bytes, content_type: str
) -> None:
    async with (
        aiohttp.ClientSession() as browser,
        browser.post(
            f"{ops.base_url}/login", data=body, headers={"Content-Type": content_type}
        ) as response,
    ):
        assert response.status == 400
        assert response.content_type == "application/json"
        error = await response.json()
    assert error["status"] == 400 and "UTF-8" in error["error"]
    assert SESSION_COOKIE not in response.cookies
    assert "unreadable login form from 127.0.0.1" in caplog.text
    assert not [record for record in caplog.records if record.exc_info]
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize(("token", "status"), [(OPS_TOKEN, 200), ("some-other-token-0123", 401)])
async def test_a_session_of_another_token_is_refused(
    ops: OpsServer, token: str, status: int
) -> None:
    session = web.Response()
    OpsAuth(token).start_session(session, secure=False)
    jar = aiohttp.CookieJar(unsafe=True)
    jar.update_cookies(session.cookies)
    async with (
        aiohttp.ClientSession(cookie_jar=jar) as browser,
        browser.get(f"{ops.base_url}/api/nodes") as response,
    ):
        assert response.status == status


async def test_api_deployments_carries_the_clients_offload_reports(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/api/deployments") as response:
        (deployment,) = await response.json()
    latest, older = deployment["offload"]
    assert set(latest) == {
        "session", "policy", "local_model", "remote_requests", "local_requests", "remote_share",
        "fallbacks", "decisions", "remote_estimate_ms", "local_estimate_ms", "remote_reachable",
        "reported_at", "reported_age_s",
    }  # fmt: skip
    assert (latest["policy"], latest["remote_share"], latest["fallbacks"]) == ("fastest", 0.2, 3)
    assert (latest["remote_estimate_ms"], latest["local_estimate_ms"]) == (18.25, 6.5)
    assert latest["remote_reachable"] is False
    assert {"target": "local", "reason": "fallback", "requests": 3} in latest["decisions"]
    assert older["local_estimate_ms"] is None and older["reported_at"] < latest["reported_at"]


async def test_metrics_sum_the_offload_reports_and_forget_a_deployment_gone(
    ops: OpsServer,
) -> None:
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        text = await response.text()
    series = f'deployment="{DEPLOYMENT_ID}"'
    # Both sessions' latest reports, summed by target and reason.
    assert (
        f'offload_client_requests_total{{{series},reason="policy",target="remote"}} 12.0' in text
    )
    assert (
        f'offload_client_requests_total{{{series},reason="faster",target="local"}} 150.0' in text
    )
    assert (
        f'offload_client_requests_total{{{series},reason="fallback",target="local"}} 3.0' in text
    )
    assert "# TYPE offload_client_requests_total counter" in text
    # Reachability as the most recent session last said.
    assert f"offload_client_remote_reachable{{{series}}} 0.0" in text
    ops.view.deployment_list[0]["offload"][0]["remote_reachable"] = True
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        assert f"offload_client_remote_reachable{{{series}}} 1.0" in await response.text()
    ops.view.deployment_list = []
    ops.view.load_info["deployments"] = []
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        text = await response.text()
    assert DEPLOYMENT_ID not in text
    assert "# TYPE offload_client_requests_total counter" in text


async def test_metrics_expose_the_standbys_and_their_events(ops: OpsServer) -> None:
    # Nothing set the gauges: the scrape reads them from the view.
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        text = await response.text()
    assert "offload_standbys 2.0" in text
    assert "offload_standby_budget 4.0" in text
    assert "# TYPE offload_standby_events_total counter" in text
    # Every event reads 0 before it happens, so that rates over it work from the start.
    for event in STANDBY_EVENTS:
        assert f'offload_standby_events_total{{event="{event}"}} 0.0' in text
    ops.metrics.count_standby("started")
    ops.metrics.count_standby("started")
    ops.metrics.count_standby("hit")
    ops.view.prewarm_info = {"budget": 0, "standbys": []}
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        text = await response.text()
    assert 'offload_standby_events_total{event="started"} 2.0' in text
    assert 'offload_standby_events_total{event="hit"} 1.0' in text
    assert 'offload_standby_events_total{event="lapsed"} 0.0' in text
    assert "offload_standbys 0.0" in text
    assert "offload_standby_budget 0.0" in text


def test_metrics_refuse_an_unknown_standby_event() -> None:
    metrics = BrokerMetrics()
    with pytest.raises(ValueError, match="unknown standby event"):
        metrics.count_standby("teleported")
    assert b'event="teleported"' not in metrics.render()[0]


async def _mint_login_path(ops: OpsServer) -> str:
    async with ops.http.post(f"{ops.base_url}/api/login-link") as response:
        assert response.status == 200
        assert response.headers["Cache-Control"] == "no-store"
        link = await response.json()
    assert link["expires_in_s"] == LOGIN_CODE_TTL_S
    path = link["path"]
    assert isinstance(path, str) and path.startswith("/login#code=")
    return path


async def _redeem(base_url: str, code: str) -> tuple[int, aiohttp.CookieJar]:
    """A fresh browser posts the code as the login page does; the status and its cookies."""
    jar = aiohttp.CookieJar(unsafe=True)  # cookies of 127.0.0.1
    async with (
        aiohttp.ClientSession(cookie_jar=jar) as browser,
        browser.post(f"{base_url}/login/once", data={"code": code}) as response,
    ):
        return response.status, jar


async def test_a_one_time_login_link_gives_one_session(ops: OpsServer) -> None:
    code = (await _mint_login_path(ops)).removeprefix("/login#code=")
    assert code != OPS_TOKEN and OPS_TOKEN not in code

    status, jar = await _redeem(ops.base_url, code)
    assert status == 204
    (cookie,) = [c for c in jar if c.key == SESSION_COOKIE]
    assert cookie["httponly"] and cookie["samesite"] == "Strict"
    async with (
        aiohttp.ClientSession(cookie_jar=jar) as browser,
        browser.get(f"{ops.base_url}/api/deployments") as response,
    ):
        assert response.status == 200

    again, jar = await _redeem(ops.base_url, code)  # used up
    assert (again, len(jar)) == (401, 0)
    for wrong in ("", "x" * 32, code + "x", "é" * 8, "a" * 4096):
        status, jar = await _redeem(ops.base_url, wrong)
        assert (status, len(jar)) == (401, 0), wrong


async def test_minting_a_login_link_needs_the_ops_token(ops: OpsServer) -> None:
    async with (
        aiohttp.ClientSession() as stranger,
        stranger.post(f"{ops.base_url}/api/login-link") as response,
    ):
        assert response.status == 401
        assert "code" not in await response.text()


async def test_an_expired_login_code_is_refused() -> None:
    now = [1000.0]
    auth = OpsAuth(OPS_TOKEN, clock=lambda: now[0])
    runner, port = await start_ops_server(
        create_ops_app(StaticOpsView(), BrokerMetrics(), auth), "127.0.0.1", 0
    )
    try:
        late, in_time = auth.mint_login_code(), auth.mint_login_code()
        now[0] += LOGIN_CODE_TTL_S - 1
        assert (await _redeem(f"http://127.0.0.1:{port}", in_time))[0] == 204
        now[0] += 2
        assert (await _redeem(f"http://127.0.0.1:{port}", late))[0] == 401
    finally:
        await runner.cleanup()


def test_only_the_newest_login_codes_are_kept() -> None:
    auth = OpsAuth(OPS_TOKEN)
    codes = [auth.mint_login_code() for _ in range(MAX_LOGIN_CODES + 1)]
    assert len(set(codes)) == len(codes)
    assert not auth.redeem_login_code(codes[0])  # the oldest was forgotten
    assert all(auth.redeem_login_code(code) for code in codes[1:])


async def test_the_login_code_never_reaches_the_log(
    ops: OpsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # aiohttp's access log among them
    path = await _mint_login_path(ops)
    code = path.removeprefix("/login#code=")
    async with (
        aiohttp.ClientSession() as browser,
        browser.get(f"{ops.base_url}{path}") as response,  # the fragment stays home
    ):
        assert response.status == 200
        assert 'src="/static/login.js"' in await response.text()
    assert (await _redeem(ops.base_url, code))[0] == 204
    assert (await _redeem(ops.base_url, code))[0] == 401
    assert "login by a one-time link from 127.0.0.1" in caplog.text
    assert "refused a one-time login link from 127.0.0.1" in caplog.text
    assert "POST /login/once" in caplog.text  # the access log is on, and says no more
    assert code not in caplog.text


async def test_api_services_serves_the_views_services(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/api/services") as response:
        assert response.status == 200
        assert await response.json() == sample_services()


async def test_metrics_show_each_services_figures_and_its_clients(ops: OpsServer) -> None:
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        families = {f.name: f for f in text_string_to_metric_families(await response.text())}

    def values(name: str) -> dict[tuple[str, ...], float]:
        return {
            (s.labels["service"], *(v for k, v in s.labels.items() if k != "service")): s.value
            for s in families[name].samples
        }

    assert values("offload_service_replicas") == {
        (SERVICE, "campus-west"): 1,
        (SERVICE, "metro-east"): 1,
    }
    assert values("offload_service_clients") == {(SERVICE,): 3}
    assert values("offload_service_request_rate") == {(SERVICE,): 24.0}
    assert values("offload_service_latency_p99_seconds") == {(SERVICE,): 0.018}
    assert values("offload_service_batch_size_mean") == {(SERVICE,): 3.2}
    assert values("offload_service_class_compute_share") == {
        (SERVICE, "best-effort"): 0.4,
        (SERVICE, "critical"): 0.6,
    }
    assert values("offload_service_client_request_rate") == {
        (SERVICE, "cam-1"): 12.0,
        (SERVICE, "cam-2"): 8.0,
        (SERVICE, "cam-3"): 4.0,
    }
    assert values("offload_service_client_refused_rate")[(SERVICE, "cam-2")] == 1.5
    # A service none of whose replicas reported figures: its counts, and nothing made up.
    ops.view.service_list[0].update(
        request_rate=None, latency_p99_ms=None, batch_size_mean=None, class_shares={},
        busiest_clients=[],
    )  # fmt: skip
    async with ops.http.get(f"{ops.base_url}/metrics") as response:
        text = await response.text()
    assert f'offload_service_clients{{service="{SERVICE}"}} 3.0' in text
    for name in ("request_rate", "latency_p99_seconds", "batch_size_mean"):
        assert f"offload_service_{name}{{" not in text
    assert "offload_service_class_compute_share{" not in text
    assert "offload_service_client_request_rate{" not in text


def test_per_client_series_are_capped_to_the_busiest_of_each_service() -> None:
    metrics = BrokerMetrics()
    clients = {
        f"client-{i:05d}": ServiceClientFigures(request_rate=float(i), refused_rate=0.0)
        for i in range(10_000)
    }
    figures = MetricFigures(
        nodes={}, gpus_free=0, gpus_used=0, deployments={}, standbys=0, standby_budget=0,
        offload_requests={}, remote_reachable={}, load_nodes={}, load_deployments={},
        services={"big": ServiceFigures({"site-a": 4}, 10_000, client_figures=clients)},
    )  # fmt: skip
    metrics.set_figures(figures)
    body = metrics.render()[0].decode()
    shown = {
        s.labels["client"]
        for f in text_string_to_metric_families(body)
        if f.name == "offload_service_client_request_rate"
        for s in f.samples
    }
    busiest = {f"client-{i:05d}" for i in range(10_000 - CLIENT_SERIES_PER_SERVICE, 10_000)}
    assert shown == busiest
    assert body.count("offload_service_client_refused_rate{") == CLIENT_SERIES_PER_SERVICE


def test_the_metrics_page_passes_promtool_check_metrics(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        reason = "promtool not found: install Debian's prometheus (apt-get install prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    metrics = BrokerMetrics()
    view = StaticOpsView()
    metrics.set_figures(
        figures_from_views(
            view.node_list, view.deployment_list, view.prewarm_info, view.load_info,
            view.service_list,
        )
    )  # fmt: skip
    metrics.observe_placement(0.001)
    metrics.record_migration("succeeded", "mobility", 0.05)
    body, _ = metrics.render()
    assert b"offload_service_client_request_rate{" in body
    result = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert result.stdout + result.stderr == b"", (result.stdout + result.stderr).decode()


async def test_status_shows_each_service_with_its_replicas_and_clients(
    ops: OpsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "ops-token"
    token.write_text(OPS_TOKEN)
    args = argparse.Namespace(ops=ops.base_url, ops_token_file=str(token), json=False)
    assert await _status(args) == 0
    text = capsys.readouterr().out
    assert "services     1\n" in text
    assert (
        "  detector (model yolo-n, owner fleet-ops): 3 client(s), 2 replica(s); 24.0 req/s, "
        "p99 18.0 ms, batches of 3.2 rows (best-effort 40%, critical 60%)\n"
    ) in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("replica"))
    assert lines[header].split() == [
        "replica", "site", "node", "state", "clients", "req/s", "p99", "queue", "batch",
    ]  # fmt: skip
    assert lines[header + 1].split() == [
        "dep-svc-01", "metro-east", "node-dgx-a", "running", "3", "24.0", "18.0", "ms", "2",
        "3.2",
    ]  # fmt: skip
    assert lines[header + 2].split() == [
        "dep-svc-02", "campus-west", "-", "pending", "0", "-", "-", "-", "-",
    ]  # fmt: skip
    assert lines[header + 3].strip() == (
        "busiest clients: cam-1 12.0 req/s, cam-2 8.0 req/s (1.5 refused), cam-3 4.0 req/s"
    )
    args.json = True
    assert await _status(args) == 0
    assert json.loads(capsys.readouterr().out)["services"] == sample_services()
    # No service: no section.
    ops.view.service_list = []
    args.json = False
    assert await _status(args) == 0
    assert "services" not in capsys.readouterr().out


async def test_status_of_a_broker_without_the_services_route_leaves_them_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def gone(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    app = create_ops_app(StaticOpsView(), BrokerMetrics(), OpsAuth(OPS_TOKEN))
    app.middlewares.append(
        web.middleware(
            lambda request, handler: (
                gone(request) if request.path == "/api/services" else handler(request)
            )
        )
    )
    runner, port = await start_ops_server(app, "127.0.0.1", 0)
    token = tmp_path / "ops-token"
    token.write_text(OPS_TOKEN)
    try:
        args = argparse.Namespace(
            ops=f"http://127.0.0.1:{port}", ops_token_file=str(token), json=True
        )
        assert await _status(args) == 0
    finally:
        await runner.cleanup()
    status = json.loads(capsys.readouterr().out)
    assert status["services"] is None
    assert status["deployments"] == {"running": 1}
