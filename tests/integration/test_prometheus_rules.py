"""The operators' kit under deploy/: Prometheus rules, their unit tests and an example config,
checked with Prometheus' own promtool; and the Grafana dashboard, checked to be what
deploy/grafana/build.py generates with Grafana's foundation SDK, for the structure Grafana's
dashboard model needs, for queries promtool parses, and for metrics the broker exports.
Without promtool (Debian's `prometheus` package) the promtool tests skip, or fail under
CI=true (where .ci/run installs it)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from broker.ops.metrics import BrokerMetrics, DeploymentFigures, NodeFigures

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "rules.yml"
RULES_TESTS = PROMETHEUS_DIR / "rules.test.yml"
CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "edge-offload.json"
DASHBOARD_BUILD = REPO / "deploy" / "grafana" / "build.py"
PROMTOOL_TIMEOUT_S = 120.0
BUILD_TIMEOUT_S = 120.0

# The live-load and resize metrics, named in issue 13's brief while they were being added to
# broker/ops/metrics.py. BrokerMetrics renders every one of them now; the set stays as an
# explicit list of what the rules and the dashboard were written against. It only ever adds
# to the rendered names, so delete it once no one is changing these metrics: then a rename in
# BrokerMetrics fails test_every_metric_is_exported.
LISTED_METRICS = frozenset(
    {
        "offload_node_load",
        "offload_node_cpu_used_cores",
        "offload_node_cpu_cores",
        "offload_node_memory_used_bytes",
        "offload_deployment_request_rate",
        "offload_deployment_failure_rate",
        "offload_deployment_latency_p50_seconds",
        "offload_deployment_latency_p99_seconds",
        "offload_deployment_latency_slo_seconds",
        "offload_deployment_cpu_used_cores",
        "offload_deployment_cpu_limit_cores",
        "offload_resizes_total",
        "offload_migrations_total",
    }
)
# Series Prometheus makes itself for every target, and the labels it adds to every series.
PROMETHEUS_SERIES = {"up": frozenset({"job", "instance"})}
TARGET_LABELS = frozenset({"job", "instance"})

GRID_COLUMNS = 24
# Grafana's own variables, with stand-ins that PromQL accepts.
GRAFANA_BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
    "__interval_ms": "60000",
    "__range_s": "3600",
}
PROMQL_KEYWORDS = frozenset(
    {"and", "or", "unless", "offset", "bool", "atan2", "inf", "nan", "start", "end"}
)
# A selector's name and its braces (string literals already blanked).
SELECTOR = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
IDENTIFIER = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(\s*\()?")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.*?)\s*,\s*(\w+)\s*\)\s*$")


def require_promtool() -> str:
    """The promtool binary; skips the test without one, or fails it under CI=true."""
    if binary := shutil.which("promtool"):
        return binary
    reason = "promtool not found: install Debian's prometheus (apt-get install prometheus)"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run promtool with `args`; its exit status and output (stdout and stderr together)."""
    return subprocess.run(
        [require_promtool(), *map(str, args)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=PROMTOOL_TIMEOUT_S,
        check=False,
    )


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def rules_of(rules_file: Any) -> list[dict[str, Any]]:
    return [rule for group in rules_file["groups"] for rule in group["rules"]]


# --- what the broker exports -------------------------------------------------------------


def exported_series() -> dict[str, frozenset[str]]:
    """Every series name a busy broker's /metrics has, with its label names: a real
    BrokerMetrics with every family given a sample, parsed back from its text render."""
    metrics = BrokerMetrics()
    metrics.set_nodes({"ready": 1, "lost": 1, "draining": 1})
    metrics.set_gpus(free=1, used=1)
    metrics.set_deployments({"running": 1, "pending": 1})
    metrics.set_offload({("d1", "remote", "policy"): 3}, {"d1": True})
    metrics.set_load(
        {"n1": NodeFigures("site-a", 0.5, 1.0, 2.0, 1024.0)},
        {
            "d1": DeploymentFigures(
                latency_slo_seconds=0.1,
                cpu_used_cores=0.5,
                cpu_limit_cores=1.0,
                request_rate=10.0,
                failure_rate=0.0,
                latency_p50_seconds=0.01,
                latency_p99_seconds=0.05,
            )
        },
    )
    metrics.count_resize("usage", up=True)
    metrics.record_migration("succeeded", "rebalance", 0.2)
    metrics.observe_span_gap(0.3)
    metrics.observe_placement(0.001)
    metrics.set_standbys(1)
    metrics.set_standby_budget(2)
    metrics.count_standby("started")
    body, _ = metrics.render()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in series.items()}


def known_series() -> dict[str, frozenset[str] | None]:
    """Names a rule or a panel may use: what the broker exports (with its label names),
    LISTED_METRICS, Prometheus' own series, and the recording rules' names (labels None:
    not checked)."""
    known: dict[str, frozenset[str] | None] = {
        name: labels | TARGET_LABELS for name, labels in exported_series().items()
    }
    for name in LISTED_METRICS:
        known.setdefault(name, None)
    known.update(PROMETHEUS_SERIES)
    for rule in rules_of(load_yaml(RULES)):
        if "record" in rule:
            known[rule["record"]] = None
    return known


# --- PromQL, without a PromQL parser: promtool checks the syntax, this finds the names -----


def substitute_variables(expr: str) -> str:
    """`expr` with Grafana's variables replaced: its interval variables by durations, the
    dashboard's own ($node, ${deployment}) by `.*`, as their "All" value."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        return GRAFANA_BUILTINS.get(name, ".*")

    return VARIABLE.sub(value, expr)


def variables_in(expr: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in VARIABLE.finditer(expr)}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (functions, keywords, label names and
    durations left out). Assumes an expression promtool accepts."""
    text = STRING.sub('""', expr)
    text = re.sub(r"\[[^\]]*\]", "[]", text)
    text = GROUPING.sub(" ", text)
    text = re.sub(r"\{[^}]*\}", "{}", text)
    return {
        match.group(1)
        for match in IDENTIFIER.finditer(text)
        if match.group(2) is None and match.group(1) not in PROMQL_KEYWORDS
    }


def selector_labels(expr: str) -> dict[str, set[str]]:
    """For each series name selected with braces, the label names its matchers use."""
    text = STRING.sub('""', expr)
    found: dict[str, set[str]] = {}
    for match in SELECTOR.finditer(text):
        labels = {m.group(1) for m in re.finditer(r"(\w+)\s*(?:=~|!~|!=|=)", match.group(2))}
        found.setdefault(match.group(1), set()).update(labels)
    return found


def unknown_names(exprs: dict[str, str], known: dict[str, frozenset[str] | None]) -> list[str]:
    """Problems with the names in `exprs` (where -> PromQL): a series no one exports, or a
    label matcher on a label its series does not have."""
    problems = []
    for where, expr in exprs.items():
        names = metric_names(expr)
        if not names:
            problems.append(f"{where}: no metric found in {expr!r}")
        problems += [f"{where}: unknown metric {n}" for n in sorted(names - known.keys())]
        for name, labels in selector_labels(expr).items():
            if (has := known.get(name)) is not None and (extra := labels - has):
                problems.append(f"{where}: {name} has no label {', '.join(sorted(extra))}")
    return problems


def check_promql(
    exprs: dict[str, str], tmp_path: Path
) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """`promtool check rules` on `exprs` (where -> PromQL) written as recording rules, one per
    expression; its result, and which record (`check:<n>`, what promtool names) is where."""
    records = {f"check:{n}": where for n, where in enumerate(exprs)}
    rules = [{"record": r, "expr": exprs[where]} for r, where in records.items()]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    return promtool("check", "rules", path), records


# --- the dashboard ---------------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def dashboard_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """Every PromQL query of the dashboard (panels' targets, annotations, query variables'
    label_values(...) metric), by where it is, as written."""
    queries: dict[str, str] = {}
    for panel in dashboard.get("panels", []):
        for target in panel.get("targets", []):
            if "expr" in target:
                queries[f"panel {panel.get('title')!r} {target.get('refId')}"] = target["expr"]
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            queries[f"annotation {annotation.get('name')!r}"] = annotation["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query)
            if match := LABEL_VALUES.match(text):
                queries[f"variable {variable.get('name')}"] = match.group(1)
            else:
                queries[f"variable {variable.get('name')}"] = text
    return queries


def _typed(obj: dict[str, Any], where: str, fields: Mapping[str, type]) -> list[str]:
    problems = []
    for field, kind in fields.items():
        if field not in obj:
            problems.append(f"{where}: no {field}")
        elif not isinstance(obj[field], kind) or (isinstance(obj[field], bool) and kind is int):
            problems.append(f"{where}: {field} is {type(obj[field]).__name__}, not {kind}")
    return problems


def dashboard_problems(dashboard: dict[str, Any]) -> list[str]:
    """What keeps `dashboard` from being a valid Grafana dashboard of ours: the fields
    Grafana's dashboard model requires, with their types; unique panel ids; panels within the
    24 columns, not overlapping; every panel with a Prometheus data source and at least one
    target; every variable a query uses defined. Empty when there is nothing."""
    problems = _typed(
        dashboard,
        "dashboard",
        {
            "title": str,
            "uid": str,
            "schemaVersion": int,
            "version": int,
            "time": dict,
            "panels": list,
            "templating": dict,
            "annotations": dict,
            "tags": list,
            "editable": bool,
            "refresh": str,
        },
    )
    if problems:
        return problems
    if not 36 <= dashboard["schemaVersion"] <= 41:
        problems.append(f"schemaVersion {dashboard['schemaVersion']}: expected about 39")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"]):
        problems.append(f"uid {dashboard['uid']!r}: 1-40 letters, digits, - or _")
    problems += _typed(dashboard["time"], "time", {"from": str, "to": str})
    variables = dashboard["templating"].get("list")
    annotations = dashboard["annotations"].get("list")
    if not isinstance(variables, list) or not isinstance(annotations, list):
        return [*problems, "templating.list and annotations.list must be lists"]
    names = [v.get("name") for v in variables]
    if len(set(names)) != len(names):
        problems.append(f"variables defined twice: {names}")
    datasource_variables = {
        v["name"]
        for v in variables
        if v.get("type") == "datasource" and v.get("query") == "prometheus"
    }
    defined = set(names) | set(GRAFANA_BUILTINS)

    def check_datasource(where: str, datasource: Any) -> None:
        if not isinstance(datasource, dict) or datasource.get("type") != "prometheus":
            problems.append(f"{where}: datasource is not a Prometheus one: {datasource!r}")
            return
        uid = str(datasource.get("uid", ""))
        used = variables_in(uid)
        if not used or not used <= datasource_variables:
            problems.append(f"{where}: datasource uid {uid!r} is not a data source variable")

    for variable in variables:
        where = f"variable {variable.get('name')}"
        problems += _typed(variable, where, {"name": str, "type": str})
        if variable.get("type") == "query":
            check_datasource(where, variable.get("datasource"))
    for annotation in annotations:
        if "expr" in annotation:
            check_datasource(
                f"annotation {annotation.get('name')!r}", annotation.get("datasource")
            )

    ids: dict[Any, str] = {}
    cells: dict[tuple[int, int], str] = {}
    for index, panel in enumerate(dashboard["panels"]):
        where = f"panel {panel.get('title', index)!r}"
        fields = {"id": int, "type": str, "title": str, "gridPos": dict, "targets": list}
        if panel_problems := _typed(panel, where, fields):
            problems += panel_problems
            continue
        if panel["id"] in ids:
            problems.append(f"{where}: id {panel['id']} is {ids[panel['id']]}'s too")
        ids[panel["id"]] = where
        grid = panel["gridPos"]
        if grid_problems := _typed(grid, f"{where} gridPos", dict.fromkeys("xywh", int)):
            problems += grid_problems
            continue
        x, y, w, h = (grid[k] for k in "xywh")
        if x < 0 or y < 0 or w < 1 or h < 1 or x + w > GRID_COLUMNS:
            problems.append(f"{where}: gridPos {grid} is outside the {GRID_COLUMNS} columns")
            continue
        for cell in ((cx, cy) for cx in range(x, x + w) for cy in range(y, y + h)):
            if cell in cells:
                problems.append(f"{where}: overlaps {cells[cell]} at {cell}")
                break
            cells[cell] = where
        check_datasource(where, panel.get("datasource"))
        if not panel["targets"]:
            problems.append(f"{where}: no targets")
        refs = [t.get("refId") for t in panel["targets"]]
        if len(set(refs)) != len(refs) or not all(refs):
            problems.append(f"{where}: refIds {refs} are not unique and set")
        for target in panel["targets"]:
            if not str(target.get("expr", "")).strip():
                problems.append(f"{where} {target.get('refId')}: no expr")
            check_datasource(f"{where} {target.get('refId')}", target.get("datasource"))
    for where, query in dashboard_queries(dashboard).items():
        if undefined := variables_in(query) - defined:
            problems.append(f"{where}: undefined variable(s) {sorted(undefined)}")
    return problems


# --- rules.yml and its unit tests ------------------------------------------------------------


def test_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", RULES)
    assert result.returncode == 0, result.stdout
    count = len(rules_of(load_yaml(RULES)))
    assert f"SUCCESS: {count} rules found" in result.stdout, result.stdout


def test_rules_unit_tests_pass() -> None:
    result = promtool("test", "rules", RULES_TESTS, cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_quiet_and_every_record_evaluated() -> None:
    rules = rules_of(load_yaml(RULES))
    tests = load_yaml(RULES_TESTS)
    assert tests["rule_files"] == [RULES.name]
    firing: set[str] = set()
    quiet: set[str] = set()
    evaluated: set[str] = set()
    for case in tests["tests"]:
        for alert_test in case.get("alert_rule_test", []):
            (firing if alert_test["exp_alerts"] else quiet).add(alert_test["alertname"])
        for expr_test in case.get("promql_expr_test", []):
            evaluated |= metric_names(expr_test["expr"])
    alerts = {rule["alert"] for rule in rules if "alert" in rule}
    records = {rule["record"] for rule in rules if "record" in rule}
    assert len(alerts) >= 9
    assert alerts - firing == set(), "alerts never tested firing"
    assert alerts - quiet == set(), "alerts never tested quiet"
    assert records - evaluated == set(), "recording rules never evaluated"
    for rule in rules:
        if "alert" in rule:
            assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
            assert {"summary", "description"} <= rule["annotations"].keys(), rule["alert"]


# One change per alert (and one recording rule) that its unit tests must catch.
BREAKAGES = [
    ("OffloadNodeLoadHigh", "offload_node_load > 0.85", "offload_node_load >= 0.85"),
    (
        "OffloadDeploymentLatencyOverSLO",
        "\n            and offload_deployment_latency_slo_seconds > 0\n",
        "\n",
    ),
    ("OffloadDeploymentSLOAttainmentLow", "< 0.9", "< 0.1"),
    ("OffloadDeploymentFailing", "for: 2m", "for: 0m"),
    ("OffloadNodeLost", 'offload_nodes{state="lost"} > 0', 'offload_nodes{state="lost"} > 1'),
    (
        "OffloadMigrationsFailing",
        'offload_migrations_total{outcome=~"failed|rolled_back"} offset 15m',
        'offload_migrations_total{outcome=~"failed|rolled_back"}',
    ),
    ("OffloadMigrationDowntimeHigh", 'le="5.0"', 'le="+Inf"'),
    ("OffloadRebalanceFlapping", '{trigger="rebalance"}', ""),
    ("OffloadBrokerDown", 'job="edge-offload-broker"', 'job=~".+"'),
    ("cluster:offload_node_load:avg", "avg(offload_node_load)", "max(offload_node_load)"),
]


@pytest.mark.parametrize(("rule", "old", "new"), BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_the_unit_tests_catch_a_broken_rule(tmp_path: Path, rule: str, old: str, new: str) -> None:
    text = RULES.read_text()
    start = re.search(rf"- (?:alert|record): {re.escape(rule)}\n", text)
    assert start, rule
    end = re.compile(r"\n      - (?:alert|record): ").search(text, start.end())
    stop = end.start() if end else len(text)
    block = text[start.start() : stop]
    assert block.count(old) == 1, f"{old!r} is not once in {rule}"
    (tmp_path / RULES.name).write_text(
        text[: start.start()] + block.replace(old, new) + text[stop:]
    )
    shutil.copy(RULES_TESTS, tmp_path)
    assert promtool("check", "rules", tmp_path / RULES.name).returncode == 0
    result = promtool("test", "rules", RULES_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0, result.stdout
    assert "FAILED" in result.stdout
    if not rule.startswith("cluster:"):
        assert f"alertname: {rule}," in result.stdout, result.stdout


def test_the_example_config_passes_promtool_check(tmp_path: Path) -> None:
    config = load_yaml(CONFIG)
    assert config["rule_files"] == [RULES.name]
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    # The token comes from a file, never inline.
    assert set(job["authorization"]) == {"type", "credentials_file"}
    assert "bearer_token" not in job
    # The ops server is HTTPS with the cluster's certificate, verified with its CA (promtool
    # does not open the file; Prometheus does at each scrape).
    assert job["scheme"] == "https"
    assert set(job["tls_config"]) == {"ca_file"}
    # OffloadBrokerDown watches this job.
    assert f'up{{job="{job["job_name"]}"}}' in RULES.read_text()

    folder = tmp_path / "etc-prometheus"
    folder.mkdir()
    shutil.copy(CONFIG, folder)
    shutil.copy(RULES, folder)
    # From another folder: rules.yml and the token file are found next to the config.
    missing = promtool("check", "config", folder / CONFIG.name, cwd=tmp_path)
    assert missing.returncode != 0, missing.stdout
    assert job["authorization"]["credentials_file"] in missing.stdout
    token = folder / job["authorization"]["credentials_file"]
    token.write_text("0123456789abcdef0123456789abcdef\n")
    token.chmod(0o600)
    result = promtool("check", "config", folder / CONFIG.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    assert "is valid prometheus config file syntax" in result.stdout
    count = len(rules_of(load_yaml(RULES)))
    assert f"SUCCESS: {count} rules found" in result.stdout, result.stdout


# --- the dashboard -------------------------------------------------------------------------


def test_the_dashboard_is_well_formed() -> None:
    dashboard = load_dashboard()
    assert dashboard_problems(dashboard) == []
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {
        "Node load",
        "CPU used vs offered per node",
        "Deployment request rate",
        "Latency p50 / p99 vs SLO",
        "CPU limit vs used per deployment",
        "Resizes by policy and direction",
        "Migrations by trigger",
        "Standbys",
        "Nodes by state",
    } <= titles


def build_dashboard(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """deploy/grafana/build.py, run with `args`."""
    return subprocess.run(
        [sys.executable, DASHBOARD_BUILD, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )


def test_the_dashboard_is_what_its_build_script_generates() -> None:
    result = build_dashboard("--check")
    assert result.returncode == 0, (
        f"{result.stderr}\nregenerate it: .venv/bin/python deploy/grafana/build.py"
    )


def test_the_build_check_finds_an_edited_dashboard(tmp_path: Path) -> None:
    copy_of_dashboard = tmp_path / DASHBOARD.name
    shutil.copyfile(DASHBOARD, copy_of_dashboard)
    unchanged = build_dashboard("--check", "--output", copy_of_dashboard)
    assert unchanged.returncode == 0, unchanged.stderr
    text = copy_of_dashboard.read_text()
    assert text.count('"title": "Standbys"') == 1
    copy_of_dashboard.write_text(text.replace('"title": "Standbys"', '"title": "Standby"'))
    edited = build_dashboard("--check", "--output", copy_of_dashboard)
    assert edited.returncode == 1, (edited.stdout, edited.stderr)
    assert f"{copy_of_dashboard} is not what deploy/grafana/build.py generates" in edited.stderr
    assert '-      "title": "Standby",' in edited.stderr
    # Without --check it writes the file back as it was.
    rewritten = build_dashboard("--output", copy_of_dashboard)
    assert rewritten.returncode == 0, rewritten.stderr
    assert copy_of_dashboard.read_text() == text


def _broken(change: str) -> dict[str, Any]:
    dashboard = copy.deepcopy(load_dashboard())
    panels = dashboard["panels"]
    if change == "duplicate id":
        panels[1]["id"] = panels[0]["id"]
    elif change == "overlap":
        panels[1]["gridPos"] = dict(panels[0]["gridPos"], x=panels[0]["gridPos"]["x"] + 1)
    elif change == "past 24 columns":
        panels[0]["gridPos"]["w"] = 25
    elif change == "no datasource":
        del panels[0]["datasource"]
    elif change == "no targets":
        panels[0]["targets"] = []
    elif change == "undefined variable":
        panels[3]["targets"][0]["expr"] += " * $nowhere"
    elif change == "no schemaVersion":
        del dashboard["schemaVersion"]
    return dashboard


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ("duplicate id", "is panel"),
        ("overlap", "overlaps"),
        ("past 24 columns", "outside the 24 columns"),
        ("no datasource", "not a Prometheus one"),
        ("no targets", "no targets"),
        ("undefined variable", "undefined variable(s) ['nowhere']"),
        ("no schemaVersion", "no schemaVersion"),
    ],
)
def test_the_dashboard_check_finds_a_broken_dashboard(change: str, problem: str) -> None:
    problems = dashboard_problems(_broken(change))
    assert any(problem in p for p in problems), problems


def test_the_dashboard_queries_parse(tmp_path: Path) -> None:
    queries = dashboard_queries(load_dashboard())
    assert len(queries) >= 20
    result, records = check_promql(
        {where: substitute_variables(query) for where, query in queries.items()}, tmp_path
    )
    assert result.returncode == 0, re.sub(
        r'"(check:\d+)"', lambda m: repr(records[m.group(1)]), result.stdout
    )
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout, result.stdout


def test_the_query_check_finds_a_bad_query(tmp_path: Path) -> None:
    queries = {w: substitute_variables(q) for w, q in dashboard_queries(load_dashboard()).items()}
    broken = next(where for where in queries if where.startswith("panel 'Node load'"))
    queries[broken] = "max(rate(offload_node_load[1m])"
    result, records = check_promql(queries, tmp_path)
    assert result.returncode != 0, result.stdout
    named = set(re.findall(r'"(check:\d+)": could not parse expression', result.stdout))
    assert {records[record] for record in named} == {broken}, result.stdout


def test_variables_become_valid_promql() -> None:
    expr = 'rate(offload_resizes_total{node=~"$node",d=~"${deployment}"}[$__rate_interval])'
    assert substitute_variables(expr) == 'rate(offload_resizes_total{node=~".*",d=~".*"}[1m])'


def test_every_metric_is_exported() -> None:
    known = known_series()
    rule_exprs = {
        f"rule {rule.get('alert') or rule.get('record')}": rule["expr"]
        for rule in rules_of(load_yaml(RULES))
    }
    dashboard_exprs = {
        where: substitute_variables(query)
        for where, query in dashboard_queries(load_dashboard()).items()
    }
    assert unknown_names(rule_exprs, known) == []
    assert unknown_names(dashboard_exprs, known) == []
    # The names really come out of the expressions.
    used = set().union(*map(metric_names, [*rule_exprs.values(), *dashboard_exprs.values()]))
    assert {
        "offload_node_load",
        "offload_migrations_total",
        "offload_migration_downtime_seconds_bucket",
        "up",
        "deployment:offload_latency_p99_slo_attainment:ratio_30m",
    } <= used


def test_the_name_check_finds_unknown_metrics_and_labels() -> None:
    known = known_series()
    assert known["offload_migrations_total"] is not None
    assert "trigger" in known["offload_migrations_total"]
    problems = unknown_names(
        {
            "typo": "sum by (trigger) (rate(ofload_migrations_total[5m]))",
            "label": 'offload_node_cpu_cores{site="a"}',
            "fine": 'max by (node) (offload_node_load{site="a"}) > bool 0.5',
        },
        known,
    )
    assert problems == [
        "typo: unknown metric ofload_migrations_total",
        "label: offload_node_cpu_cores has no label site",
    ]


def test_metric_names_skips_functions_keywords_labels_and_durations() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{le=~"5.0|+Inf"}[5m] offset 1h)))'
        " > on (job) group_left (instance) b_total unless c:rec:ratio and bool_metric or 1e3"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c:rec:ratio", "bool_metric"}
