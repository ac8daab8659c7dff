"""The edge-offload Grafana dashboard, built with Grafana's foundation SDK.

edge-offload.json, next to this file, is what this script writes: Grafana provisions the
JSON, and this is its source. Edit the dashboard here, never the JSON, then regenerate:

    .venv/bin/python deploy/grafana/build.py

and commit both. `--check` writes nothing and exits 1, with a diff, when the committed JSON is
not what this script would write (tests/integration/test_prometheus_rules.py runs it in CI).
The SDK (grafana-foundation-sdk, pinned in pyproject.toml's dev extras) types every field, so
a misspelt option or a wrong kind of value fails here, before Grafana ever reads the JSON.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    AnnotationQuery,
    DashboardCursorSync,
    DataSourceRef,
    DynamicConfigValue,
    FieldColor,
    FieldColorModeId,
    GridPos,
    Panel,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.dashboard import Dashboard as DashboardModel
from grafana_foundation_sdk.models.prometheus import QueryEditorMode

OUTPUT = Path(__file__).resolve().with_name("edge-offload.json")

# Every panel, target, annotation and query variable reads the Prometheus data source that
# the dashboard's `datasource` variable picks.
PROMETHEUS = DataSourceRef(type_val="prometheus", uid="${datasource}")

# Field override properties.
DASHED = DynamicConfigValue(
    id_val="custom.lineStyle", value=common.LineStyle(fill="dash", dash=[10, 10])
)
RED = DynamicConfigValue(
    id_val="color", value=FieldColor(mode=FieldColorModeId.FIXED, fixed_color="red")
)
STEPPED = DynamicConfigValue(
    id_val="custom.lineInterpolation", value=common.LineInterpolation.STEP_AFTER
)
RIGHT_AXIS = DynamicConfigValue(id_val="custom.axisPlacement", value=common.AxisPlacement.RIGHT)


def at(x: int, y: int, w: int, h: int) -> GridPos:
    """A panel's place on the dashboard's 24-column grid."""
    return GridPos(x=x, y=y, w=w, h=h)


def thresholds(*steps: tuple[float | None, str]) -> dashboard.ThresholdsConfig:
    """Absolute thresholds, as (value, colour) from the lowest, whose value is None."""
    return (
        dashboard.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=value, color=color) for value, color in steps])
    )


def query(expr: str, legend: str) -> prometheus.Dataquery:
    """A PromQL target, as the code editor writes it; its panel gives it its refId."""
    return (
        prometheus.Dataquery()
        .datasource(PROMETHEUS)
        .editor_mode(QueryEditorMode.CODE)
        .expr(expr)
        .legend_format(legend)
    )


def targets(
    queries: Sequence[prometheus.Dataquery], *, instant: bool
) -> list[cogbuilder.Builder[cogvariants.Dataquery]]:
    """`queries` as instant or range queries, with refIds A, B, C..."""
    return [
        (q.instant() if instant else q.range()).ref_id(chr(ord("A") + n))
        for n, q in enumerate(queries)
    ]


def stat_panel(
    panel_id: int,
    title: str,
    *,
    grid: GridPos,
    unit: str,
    description: str,
    queries: Sequence[prometheus.Dataquery],
) -> stat.Panel:
    """A stat panel of ours: each series' last value and name, coloured by its thresholds."""
    return (
        stat.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(PROMETHEUS)
        .grid_pos(grid)
        .unit(unit)
        .color_scheme(dashboard.FieldColor().mode(FieldColorModeId.PALETTE_CLASSIC))
        .reduce_options(
            common_builders.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)
        )
        .orientation(common.VizOrientation.AUTO)
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .color_mode(common.BigValueColorMode.VALUE)
        .graph_mode(common.BigValueGraphMode.NONE)
        .justify_mode(common.BigValueJustifyMode.AUTO)
        .targets(targets(queries, instant=True))
    )


def timeseries_panel(
    panel_id: int,
    title: str,
    *,
    grid: GridPos,
    unit: str,
    description: str,
    queries: Sequence[prometheus.Dataquery],
) -> timeseries.Panel:
    """A time series panel of ours: thin lines from 0, the legend below, and a tooltip that
    lists every series, largest first."""
    return (
        timeseries.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .datasource(PROMETHEUS)
        .grid_pos(grid)
        .unit(unit)
        .min(0)
        .color_scheme(dashboard.FieldColor().mode(FieldColorModeId.PALETTE_CLASSIC))
        .draw_style(common.GraphDrawStyle.LINE)
        .line_width(1)
        .fill_opacity(0)
        .show_points(common.VisibilityMode.NEVER)
        .span_nulls(False)
        .line_interpolation(common.LineInterpolation.LINEAR)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
        .targets(targets(queries, instant=False))
    )


def dashed_thresholds() -> common_builders.GraphThresholdsStyleConfig:
    """Draw a time series panel's thresholds as dashed lines."""
    return common_builders.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.DASHED)


class PrometheusAnnotation(AnnotationQuery, cogbuilder.Builder[AnnotationQuery]):
    """Events from a PromQL query, marked on every chart. The SDK's AnnotationQuery has `expr`
    but not the other fields Grafana's Prometheus data source reads from an annotation (each
    event's title and text, the evaluation step); this adds them to its JSON. It is its own
    builder, for Dashboard.annotation()."""

    def __init__(
        self, name: str, *, icon_color: str, expr: str, title: str, text: str, step: str = "1m"
    ) -> None:
        super().__init__(
            name=name, datasource=PROMETHEUS, enable=True, icon_color=icon_color, expr=expr
        )
        self.title_format = title
        self.text_format = text
        self.step = step

    def build(self) -> Self:
        return self

    def to_json(self) -> dict[str, object]:
        return {
            **super().to_json(),
            "step": self.step,
            "titleFormat": self.title_format,
            "textFormat": self.text_format,
            "useValueForTime": False,
        }


def label_values_variable(name: str, *, label: str, metric: str) -> dashboard.QueryVariable:
    """A variable of the values `metric`'s label `name` takes, any number of them, "All" (any
    value, not only those listed) by default."""
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(PROMETHEUS)
        .query(
            {
                "qryType": 1,
                "query": f"label_values({metric}, {name})",
                "refId": "PrometheusVariableQueryEditor-VariableQuery",
            }
        )
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(VariableOption(selected=True, text=["All"], value=["$__all"]))
        .options([])
        .regex("")
    )


def panels() -> list[cogbuilder.Builder[Panel]]:
    """The panels, left to right and top to bottom: three stats, then the time series. Each
    has its place set (the SDK would lay out a panel left at 0, 0 after the one before)."""
    return [
        stat_panel(
            1,
            "Nodes by state",
            grid=at(0, 0, 8, 4),
            unit="short",
            description=(
                "Nodes the broker knows, by state (offload_nodes)."
                " A lost node fires OffloadNodeLost."
            ),
            queries=[query("sum by (state) (offload_nodes)", "{{state}}")],
        )
        .thresholds(thresholds((None, "green")))
        .override_by_regexp(
            "lost",
            [
                DynamicConfigValue(
                    id_val="thresholds", value=thresholds((None, "green"), (1, "red")).build()
                )
            ],
        ),
        stat_panel(
            2,
            "Deployments by state",
            grid=at(8, 0, 8, 4),
            unit="short",
            description="Deployments by state (offload_deployments).",
            queries=[query("sum by (state) (offload_deployments)", "{{state}}")],
        ).thresholds(thresholds((None, "blue"))),
        stat_panel(
            3,
            "Cluster load",
            grid=at(16, 0, 8, 4),
            unit="percentunit",
            description="Mean and largest node load (offload_node_load, 0..1).",
            queries=[
                query("avg(offload_node_load)", "mean"),
                query("max(offload_node_load)", "max"),
            ],
        )
        .min(0)
        .max(1)
        .thresholds(thresholds((None, "green"), (0.8, "orange"), (0.85, "red"))),
        timeseries_panel(
            4,
            "Node load",
            grid=at(0, 4, 12, 8),
            unit="percentunit",
            description=(
                "Each node's load as placement weighs it: the larger of its replicas' CPU share"
                " of the cores it offers and its GPUs' mean utilization (offload_node_load)."
                " OffloadNodeLoadHigh fires above 0.85 for 5 minutes; the rebalancer calls a"
                " node hot at 0.8 by default."
            ),
            queries=[query('offload_node_load{node=~"$node"}', "{{node}} ({{site}})")],
        )
        .max(1)
        .thresholds(thresholds((None, "green"), (0.85, "red")))
        .thresholds_style(dashed_thresholds()),
        timeseries_panel(
            5,
            "CPU used vs offered per node",
            grid=at(12, 4, 12, 8),
            unit="short",
            description=(
                "Cores each node's replicas used over its last sampling interval (solid),"
                " and the cores it offers to replicas (dashed)."
            ),
            queries=[
                query('offload_node_cpu_used_cores{node=~"$node"}', "{{node}} used"),
                query('offload_node_cpu_cores{node=~"$node"}', "{{node}} offered"),
            ],
        ).override_by_regexp(".* offered", [DASHED]),
        timeseries_panel(
            6,
            "Deployment request rate",
            grid=at(0, 12, 12, 8),
            unit="reqps",
            description=(
                "Requests per second each deployment's replica answered (solid) and failed"
                " (dashed), over its node's last sampling interval. OffloadDeploymentFailing"
                " fires when failures last 2 minutes."
            ),
            queries=[
                query(
                    'offload_deployment_request_rate{deployment=~"$deployment"}',
                    "{{deployment}}",
                ),
                query(
                    'offload_deployment_failure_rate{deployment=~"$deployment"} > 0',
                    "{{deployment}} failed",
                ),
            ],
        ).override_by_regexp(".* failed", [DASHED, RED]),
        timeseries_panel(
            7,
            "Latency p50 / p99 vs SLO",
            grid=at(12, 12, 12, 8),
            unit="s",
            description=(
                "Request latency at each deployment's replica (histogram bucket bounds): p50,"
                " p99, and its SLO (dashed; deployments without one have none)."
                " OffloadDeploymentLatencyOverSLO fires when p99 stays over the SLO for 5"
                " minutes."
            ),
            queries=[
                query(
                    'offload_deployment_latency_p50_seconds{deployment=~"$deployment"}',
                    "{{deployment}} p50",
                ),
                query(
                    'offload_deployment_latency_p99_seconds{deployment=~"$deployment"}',
                    "{{deployment}} p99",
                ),
                query(
                    'offload_deployment_latency_slo_seconds{deployment=~"$deployment"} > 0',
                    "{{deployment}} SLO",
                ),
            ],
        ).override_by_regexp(".* SLO", [DASHED]),
        timeseries_panel(
            8,
            "CPU limit vs used per deployment",
            grid=at(0, 20, 12, 8),
            unit="short",
            description=(
                "Cores each deployment's replica used (solid) and its CPU quota (dashed,"
                " stepped: a resize by the node's resource manager shows as a step; unlimited"
                " replicas have none). Resizes are also marked on every chart (the Resizes"
                " annotation)."
            ),
            queries=[
                query(
                    'offload_deployment_cpu_used_cores{deployment=~"$deployment"}',
                    "{{deployment}} used",
                ),
                query(
                    'offload_deployment_cpu_limit_cores{deployment=~"$deployment"} > 0',
                    "{{deployment}} limit",
                ),
            ],
        ).override_by_regexp(".* limit", [DASHED, STEPPED]),
        timeseries_panel(
            9,
            "p99 SLO attainment (30 min)",
            grid=at(12, 20, 12, 8),
            unit="percentunit",
            description=(
                "Share of the last 30 minutes' rule evaluations at which each deployment's p99"
                " was within its SLO (recording rule"
                " deployment:offload_latency_p99_slo_attainment:ratio_30m from"
                " deploy/prometheus/rules.yml; empty without it)."
                " OffloadDeploymentSLOAttainmentLow fires under 0.9 for 10 minutes."
            ),
            queries=[
                query(
                    "deployment:offload_latency_p99_slo_attainment:ratio_30m"
                    '{deployment=~"$deployment"}',
                    "{{deployment}}",
                )
            ],
        )
        .max(1)
        .thresholds(thresholds((None, "red"), (0.9, "green")))
        .thresholds_style(dashed_thresholds()),
        timeseries_panel(
            10,
            "Resizes by policy and direction",
            grid=at(0, 28, 12, 8),
            unit="ops",
            description=(
                "CPU changes the nodes' resource managers made to replicas, per second"
                " (offload_resizes_total)."
            ),
            queries=[
                query(
                    "sum by (policy, direction) (rate(offload_resizes_total[$__rate_interval]))",
                    "{{policy}} {{direction}}",
                )
            ],
        ),
        timeseries_panel(
            11,
            "Migrations by trigger",
            grid=at(12, 28, 12, 8),
            unit="ops",
            description=(
                "Finished migrations per second by what started them (mobility, node_lost,"
                " drain, rebalance, operator) and how they ended (offload_migrations_total)."
                " OffloadRebalanceFlapping fires past 6 rebalances in 30 minutes."
            ),
            queries=[
                query(
                    "sum by (trigger, outcome) (rate(offload_migrations_total[$__rate_interval]))",
                    "{{trigger}} {{outcome}}",
                )
            ],
        ).override_by_regexp(".* (failed|rolled_back)", [RED]),
        timeseries_panel(
            12,
            "Migration downtime",
            grid=at(0, 36, 12, 8),
            unit="s",
            description=(
                "Longest gap clients observed across a migration's switch, p50 and p99 over"
                " the dashboard's rate interval (offload_migration_downtime_seconds); 5 s is"
                " the bound the design must beat (OffloadMigrationDowntimeHigh)."
            ),
            queries=[
                query(
                    f"histogram_quantile({q}, sum by (le)"
                    " (rate(offload_migration_downtime_seconds_bucket[$__rate_interval])))",
                    legend,
                )
                for q, legend in [("0.5", "p50"), ("0.99", "p99")]
            ],
        ),
        timeseries_panel(
            13,
            "Standbys",
            grid=at(12, 36, 12, 8),
            unit="short",
            description=(
                "Pre-warmed standby replicas held (solid) against --prewarm-budget (dashed),"
                " and what became of standbys, per second (offload_standby_events_total,"
                " right axis)."
            ),
            queries=[
                query("offload_standbys", "held"),
                query("offload_standby_budget", "budget"),
                query(
                    "sum by (event) (rate(offload_standby_events_total[$__rate_interval])) > 0",
                    "{{event}}/s",
                ),
            ],
        )
        .override_by_regexp("budget", [DASHED])
        .override_by_regexp(".*/s", [RIGHT_AXIS, DynamicConfigValue(id_val="unit", value="ops")]),
        timeseries_panel(
            14,
            "Node memory used",
            grid=at(0, 44, 8, 8),
            unit="bytes",
            description="Memory each node's replicas use (offload_node_memory_used_bytes).",
            queries=[query('offload_node_memory_used_bytes{node=~"$node"}', "{{node}}")],
        ),
        timeseries_panel(
            15,
            "Nodes by state over time",
            grid=at(8, 44, 8, 8),
            unit="short",
            description="Nodes the broker knows, by state (offload_nodes), stacked.",
            queries=[query("sum by (state) (offload_nodes)", "{{state}}")],
        )
        .decimals(0)
        .fill_opacity(30)
        .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL).group("A"))
        .override_by_regexp("lost", [RED]),
        timeseries_panel(
            16,
            "Placement decision time",
            grid=at(16, 44, 8, 8),
            unit="s",
            description=(
                "p50 and p99 time the broker took to take one placement decision"
                " (offload_placement_seconds)."
            ),
            queries=[
                query(
                    f"histogram_quantile({q}, sum by (le)"
                    " (rate(offload_placement_seconds_bucket[$__rate_interval])))",
                    legend,
                )
                for q, legend in [("0.5", "p50"), ("0.99", "p99")]
            ],
        ),
        timeseries_panel(
            17,
            "Client requests: remote vs local",
            grid=at(0, 52, 12, 8),
            unit="reqps",
            description=(
                "Requests edge clients ran on their replica (remote) or their own model"
                " (local), by reason, per second (offload_client_requests_total)."
            ),
            queries=[
                query(
                    "sum by (target, reason) (rate(offload_client_requests_total"
                    '{deployment=~"$deployment"}[$__rate_interval]))',
                    "{{target}} {{reason}}",
                )
            ],
        ),
        timeseries_panel(
            18,
            "Client sees its replica",
            grid=at(12, 52, 12, 8),
            unit="short",
            description=(
                "1 while a deployment's client last reported its replica reachable, 0 after a"
                " failure (offload_client_remote_reachable)."
            ),
            queries=[
                query(
                    'offload_client_remote_reachable{deployment=~"$deployment"}',
                    "{{deployment}}",
                )
            ],
        )
        .max(1)
        .decimals(0)
        .line_interpolation(common.LineInterpolation.STEP_AFTER),
    ]


def build() -> DashboardModel:
    """The dashboard, as the SDK's model."""
    builder = (
        dashboard.Dashboard("edge-offload")
        .uid("edge-offload")
        .description(
            "Nodes, deployments, resizes and migrations of an edge-offload broker (its"
            " /metrics; deploy/prometheus/rules.yml for the SLO attainment panel)."
        )
        .tags(["edge-offload"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .version(1)
        .with_variable(
            dashboard.DatasourceVariable("datasource")
            .label("Data source")
            .type("prometheus")
            .regex("")
        )
        .with_variable(label_values_variable("node", label="Node", metric="offload_node_load"))
        .with_variable(
            label_values_variable(
                "deployment", label="Deployment", metric="offload_deployment_cpu_used_cores"
            )
        )
        # Grafana adds its own "Annotations & Alerts" (builtIn) to a dashboard without one.
        .annotation(
            PrometheusAnnotation(
                "Resizes",
                icon_color="orange",
                expr="sum by (policy, direction)"
                " (increase(offload_resizes_total[$__interval])) > 0",
                title="resize",
                text="{{policy}} {{direction}}",
            )
        )
        .annotation(
            PrometheusAnnotation(
                "Migrations",
                icon_color="purple",
                expr="sum by (trigger, outcome)"
                " (increase(offload_migrations_total[$__interval])) > 0",
                title="migration",
                text="{{trigger}} {{outcome}}",
            )
        )
    )
    for panel in panels():
        builder = builder.with_panel(panel)
    return builder.build()


def render(model: DashboardModel) -> str:
    """The dashboard's JSON, deterministic: keys sorted, two-space indents, newline at end."""
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(
            "Write the edge-offload Grafana dashboard, built here with Grafana's foundation"
            " SDK, as JSON for Grafana to provision. Edit this script, not the JSON, then run"
            " it and commit both."
        ),
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=OUTPUT,
        metavar="PATH",
        help=f"the JSON file to write or check (default: {OUTPUT.name} next to this script)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help=(
            "write nothing; exit 1, showing a diff, when PATH is not what this script would"
            " write (it is stale, or was edited by hand)"
        ),
    )
    args = parser.parse_args(argv)
    output: Path = args.output
    expected = render(build())
    if not args.check:
        output.write_text(expected)
        print(f"wrote {output}")
        return 0
    regenerate = "python deploy/grafana/build.py" + (
        "" if output == OUTPUT else f" --output {output}"
    )
    try:
        actual = output.read_text()
    except FileNotFoundError:
        print(f"{output} is missing: run `{regenerate}` to write it", file=sys.stderr)
        return 1
    if actual == expected:
        return 0
    diff = difflib.unified_diff(
        actual.splitlines(keepends=True),
        expected.splitlines(keepends=True),
        fromfile=f"{output} (as it is)",
        tofile=f"{output} (as generated)",
    )
    sys.stderr.writelines(diff)
    print(
        f"{output} is not what deploy/grafana/build.py generates: edit the script, not the"
        f" JSON, and run `{regenerate}` to regenerate it",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
