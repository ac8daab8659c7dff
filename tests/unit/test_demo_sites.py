"""`offload demo`: each site's node on CPUs of its own where the machine has one per site,
as separate machines would be; sharing them, and saying so, where it has not."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from edge_client.cli import build_parser
from edge_client.demo.cluster import DEMO_NODES
from edge_client.demo.run import site_plans
from edge_client.demo.view import print_report
from tests.unit.test_demo_view import report


def test_with_a_cpu_per_site_each_node_gets_a_run_of_its_own() -> None:
    plans, line = site_plans(DEMO_NODES, range(8), share=False)
    assert [plan.node_id for plan in plans] == ["node-a", "node-b", "node-c"]
    assert [plan.flags[-2:] for plan in plans] == [
        ("--cpuset", "0,1,2"),
        ("--cpuset", "3,4,5"),
        ("--cpuset", "6,7"),
    ]
    # what else a plan says is kept
    assert [dataclasses.replace(plan, flags=()) for plan in plans] == list(DEMO_NODES)
    assert line == (
        "each site on CPUs of its own, as separate machines: "
        "node-a 0,1,2, node-b 3,4,5, node-c 6,7"
    )


def test_with_fewer_cpus_than_sites_they_share_and_the_line_says_why() -> None:
    plans, line = site_plans(DEMO_NODES, [0, 1], share=False)
    assert plans == DEMO_NODES
    assert line == (
        "the 3 sites share 2 CPU(s): a migration's target starts on the CPUs serving the "
        "client (a CPU of its own per site needs 3)"
    )


def test_share_cpus_keeps_every_node_on_every_cpu() -> None:
    plans, line = site_plans(DEMO_NODES, range(8), share=True)
    assert plans == DEMO_NODES
    assert line == "every site on all 8 CPUs (--share-cpus)"
    args = build_parser().parse_args(["demo", "--share-cpus"])
    assert args.share_cpus is True
    assert build_parser().parse_args(["demo"]).share_cpus is False


def test_the_report_says_which_cpus_the_sites_ran_on() -> None:
    console = Console(record=True, width=200, color_system=None)
    print_report(
        console, dataclasses.replace(report(0, "succeeded"), cpus="every site on all 8 CPUs")
    )
    assert "\nCPUs         every site on all 8 CPUs " in console.export_text()
