"""`offload demo` as a user runs it: the whole cluster, a client moving, the report, and
nothing left behind (no container, no process, no folder) after it ends or is interrupted."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from edge_client.demo.cluster import processes_naming
from tests.docker_support import require_docker
from tests.ops_support import ops_headers

DEMO = [sys.executable, "-m", "edge_client.cli", "demo"]
NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}


def run_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DEMO, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def failed_run(done: subprocess.CompletedProcess[str]) -> str:
    """What a failed demo printed, and the warnings and errors of the cluster logs it kept
    (the folder is removed: the message carries what CI needs to tell why)."""
    text = done.stdout + done.stderr
    match = re.search(r"logs of the broker and the nodes are kept in (\S+)", text)
    if not match:
        return text
    kept = Path(match.group(1))
    for log in sorted(kept.glob("*.log")):
        lines = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if " WARNING " in line or " ERROR " in line
        ]
        text += f"\n--- {log.name}: {len(lines)} warning/error lines, the last 40 ---\n"
        text += "\n".join(lines[-40:])
    shutil.rmtree(kept, ignore_errors=True)
    return text


def cluster_folder(output: str) -> Path:
    match = re.search(r"cluster folder (\S+) \(removed at the end\)", output)
    assert match, output
    return Path(match.group(1))


def deployment_id(output: str) -> str:
    match = re.search(r"deployed (d-[0-9a-f]+) on node-a", output)
    assert match, output
    return match.group(1)


def assert_nothing_left(output: str, deployment: str | None) -> None:
    """No folder, no process naming it, no container of the demo's deployment; and the
    demo's own sweep found nothing to kill (the orderly stop did it all)."""
    folder = cluster_folder(output)
    assert not folder.exists(), f"{folder} was left behind"
    assert processes_naming(folder) == []
    assert "had to kill a leftover" not in output, output
    if deployment is not None:
        client = require_docker()
        try:
            left = client.containers.list(
                all=True, filters={"label": f"offload.deployment={deployment}"}
            )
        finally:
            client.close()
        assert left == [], [c.name for c in left]


def assert_report(output: str, runtime: str) -> None:
    assert re.search(rf"^runtime\s+{runtime}\s*$", output, re.M), output
    sent = re.search(r"^requests\s+(\d+) sent, (\d+) ok, 0 failed", output, re.M)
    assert sent and sent.group(1) == sent.group(2) and int(sent.group(1)) > 20, output
    assert re.search(r"^latency\s+p50 [\d.]+ ms, p90 [\d.]+ ms, p99 [\d.]+ ms", output, re.M)
    migrations = re.search(r"^migrations\s+(\d+), (\d+) succeeded", output, re.M)
    assert migrations and migrations.group(1) == migrations.group(2), output
    assert int(migrations.group(1)) >= 2, output
    assert re.search(
        r"^span bound\s+during a migration [+-][\d.]+ ms over the longest gap between them, "
        r"[\d.]+ ms allowed: (within|over) it\s*$",
        output,
        re.M,
    ), output
    # Each migration: its route, its timeline and the downtime the client saw.
    moves = re.findall(
        r"(m-[0-9a-f]+) mobility (node-\w) → (node-\w) make-before-break: succeeded, took \d+ "
        r"ms; client-observed downtime ([\d.]+) ms, 0 failed request",
        output,
    )
    assert [(a, b) for _, a, b, _ in moves] == [
        ("node-a", "node-b"), ("node-b", "node-c"), ("node-c", "node-a"),
    ], output  # fmt: skip
    assert all(float(gap) > 0 for *_, gap in moves)
    assert output.count("decided +0  target_started +") == 3, output
    # The placements, explained: the first one, and each after a migration with its reason.
    assert "first placement: node-a" in output
    assert "why: client moved to site-b: latency 10.50 -> 0.50 ms" in output, output
    assert re.search(r"^dashboard\s+http://127\.0\.0\.1:\d+/", output, re.M), output
    assert "result     ok: no failed request" in output


@pytest.mark.docker
def test_quick_demo_migrates_with_no_failed_request_in_containers() -> None:
    require_docker().close()
    done = run_demo("--quick")
    assert done.returncode == 0, failed_run(done)
    assert_report(done.stdout, "docker")
    assert_nothing_left(done.stdout, deployment_id(done.stdout))


def test_without_docker_the_demo_says_so_and_runs_processes() -> None:
    done = run_demo("--quick", env=NO_DOCKER)
    assert done.returncode == 0, failed_run(done)
    assert "Docker is not usable here" in done.stdout
    assert "`make docker-engine` installs and starts Debian's engine" in done.stdout
    assert_report(done.stdout, "process")
    assert_nothing_left(done.stdout, None)


def _start_and_wait(args: list[str], ready: str, env: dict[str, str]) -> tuple[
    subprocess.Popen[str], list[str]
]:  # fmt: skip
    demo = subprocess.Popen(
        [*DEMO, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
    )
    assert demo.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = demo.stdout.readline()
        if not line:
            break
        lines.append(line)
        if re.search(ready, line):
            return demo, lines
    demo.kill()
    demo.communicate(timeout=30)
    raise AssertionError(f"no {ready!r} from the demo:\n{''.join(lines)}")


@pytest.mark.docker
def test_ctrl_c_mid_migration_stops_everything() -> None:
    require_docker().close()
    demo, lines = _start_and_wait(["--plain"], r"migration m-\w+ started", {})
    demo.send_signal(signal.SIGINT)  # what Ctrl-C sends
    rest, _ = demo.communicate(timeout=120)
    output = "".join(lines) + rest
    assert demo.returncode == 130, output
    assert "SIGINT: stopping the cluster" in output
    assert "report" not in output
    assert_nothing_left(output, deployment_id(output))


def test_keep_leaves_the_dashboard_up_until_ctrl_c() -> None:
    demo, lines = _start_and_wait(
        ["--quick", "--keep", "--runtime", "process"], r"cluster kept running", NO_DOCKER
    )
    output = "".join(lines)
    url = re.search(r"^dashboard\s+(http://\S+)", output, re.M)
    assert url, output
    token_file = re.search(r"OFFLOAD_OPS_TOKEN_FILE=(\S+);", output)
    assert token_file, output
    request = urllib.request.Request(
        f"{url.group(1)}api/deployments", headers=ops_headers(Path(token_file.group(1)))
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read().decode()
    assert '"state": "running"' in body and '"node_id": "node-a"' in body, body
    node_b = (cluster_folder(output) / "node-b.log").read_text()
    demo.send_signal(signal.SIGINT)
    rest, _ = demo.communicate(timeout=120)
    assert demo.returncode == 0, output + rest  # the report's result, not 130
    assert_nothing_left(output + rest, None)
    # The first migration's target fetched the model at the demo's background rate.
    assert re.search(r"model \w+ fetched from broker \S+ at 25 MB/s \(background\)", node_b), (
        node_b
    )


def test_a_killed_demo_takes_its_cluster_with_it() -> None:
    """SIGKILL leaves the demo no time to clean up: its children get SIGTERM from the kernel
    (PR_SET_PDEATHSIG) and stop their replicas; only the folder is left."""
    demo, lines = _start_and_wait(["--runtime", "process", "--plain"], r"deployed d-", NO_DOCKER)
    folder = cluster_folder("".join(lines))
    demo.kill()
    demo.communicate(timeout=30)
    deadline = time.monotonic() + 60
    while processes_naming(folder) and time.monotonic() < deadline:
        time.sleep(0.2)
    running = processes_naming(folder)
    shutil.rmtree(folder, ignore_errors=True)
    assert running == [], running


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "0"], "--rate must be in (0, 1000]"),
        (["--trace", "/nonexistent/trace.yaml"], "cannot read the trace /nonexistent/trace.yaml"),
        (["--time-scale", "0"], "--time-scale must be in (0, 100], got 0"),
        (["--prewarm", "-1"], "--prewarm must be 0 to 64 standby replicas, got -1"),
        (
            ["--background-fetch-rate", "nan"],
            "--background-fetch-rate must be 0 to 100000 MB/s, got nan",
        ),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(args: list[str], message: str) -> None:
    done = run_demo(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert "cluster folder" not in done.stdout  # nothing was started


def test_a_bad_trace_names_its_line(tmp_path: Path) -> None:
    trace = tmp_path / "trip.yaml"
    trace.write_text("waypoints:\n  - {site: site-a, dwell_s: 2}\n  - {site: mars, dwell_s: 2}\n")
    done = run_demo("--trace", str(trace))
    assert done.returncode == 2
    assert f"{trace}:3: waypoint 2: unknown site 'mars'" in done.stderr
    assert "site-a, site-b, site-c" in done.stderr


def test_the_prewarm_mode_drives_a_generated_trace_and_reports_its_hits() -> None:
    trace = Path(__file__).resolve().parents[2] / "edge_client/demo/traces/streets.json"
    done = run_demo(
        "--runtime", "process", "--trace", str(trace), "--prewarm", "--time-scale", "0.1",
        "--model", "mlp", "--plain",
    )  # fmt: skip
    assert done.returncode == 0, failed_run(done)
    out = done.stdout
    assert_nothing_left(out, None)
    # The city's traffic first: the trace's three other vehicles, so the broker knows the road,
    # each a client of its own (the joins between them are no road).
    assert (
        "reported the handovers of the trace's 3 other vehicle(s) (11 reports), each as a "
        "client of its own"
    ) in out, out
    pre_warmed = re.findall(r"^\s+m-[0-9a-f]+ mobility .*\(pre-warmed\): succeeded", out, re.M)
    starting = re.findall(
        r"^\s+m-[0-9a-f]+ mobility .*\(pre-warmed, standby still starting: waited \d+ ms\): "
        r"succeeded",
        out,
        re.M,
    )
    assert pre_warmed or starting, out
    assert out.count("pre-warmed: switched to its standby") == len(pre_warmed), out
    assert out.count("pre-warmed but the standby was still starting") == len(starting), out
    summary = re.search(  # the report's table folds the line at the console's width
        r"\smoves pre-warm on \(budget 2\): (\d+) of (\d+) moves pre-warmed, (\d+) waited for "
        r"a standby still starting; report to first answer at the new site: "
        r"(?:median [\d.]+ ms \(n=(\d+)\)|-) pre-warmed, "
        r"(?:median [\d.]+ ms \(n=(\d+)\)|-) standby still starting",
        " ".join(out.split()),
    )
    assert summary, out
    assert int(summary.group(1)) == len(pre_warmed) == int(summary.group(4) or 0)
    assert int(summary.group(3)) == len(starting) == int(summary.group(5) or 0)
    assert int(summary.group(2)) >= 3, out
    assert "result     ok: no failed request" in out
