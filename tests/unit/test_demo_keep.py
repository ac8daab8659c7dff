"""`offload demo --keep`: the line it ends on says how to log in to the kept cluster's
dashboard: a one-time link from the broker's ops app, or where the ops token is."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import aiohttp

from broker.ops import BrokerMetrics, OpsAuth, create_ops_app, start_ops_server
from broker.ops.auth import LOGIN_CODE_TTL_S
from edge_client.demo.cluster import LocalCluster
from edge_client.demo.run import kept_message, request_login_link
from tests.ops_support import OPS_TOKEN, StaticOpsView


async def test_the_kept_demo_names_a_one_time_link_that_logs_in_once(tmp_path: Path) -> None:
    runner, port = await start_ops_server(
        create_ops_app(StaticOpsView(), BrokerMetrics(), OpsAuth(OPS_TOKEN)), "127.0.0.1", 0
    )
    try:
        cluster = LocalCluster(tmp_path, runtime="process")
        cluster.ops_port = port
        cluster.ops_token_file.write_text(OPS_TOKEN + "\n")
        login = await request_login_link(cluster.ops_url, cluster.ops_headers)
        line = kept_message(cluster, login)

        match = re.search(r"Dashboard: open (\S+) to log in", line)
        assert match, line
        link = match.group(1)
        assert link.startswith(f"http://127.0.0.1:{port}/login#code=")
        assert "works once, within 5 minutes" in line and LOGIN_CODE_TTL_S == 300
        assert OPS_TOKEN not in line
        code = link.partition("#code=")[2]
        statuses = []
        for _ in range(2):
            async with (
                aiohttp.ClientSession() as browser,
                browser.post(f"{cluster.ops_url}login/once", data={"code": code}) as response,
            ):
                statuses.append(response.status)
        assert statuses == [204, 401]
    finally:
        await runner.cleanup()


def test_without_a_link_the_kept_demo_names_the_token_file(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, runtime="process")
    line = kept_message(cluster, None)
    assert f"Dashboard: log in with the ops token in {tmp_path / 'ops-token'}" in line
    assert f"OFFLOAD_OPS_TOKEN_FILE={tmp_path / 'ops-token'}" in line


async def test_offload_login_link_prints_a_link_for_the_token_holder(tmp_path: Path) -> None:
    runner, port = await start_ops_server(
        create_ops_app(StaticOpsView(), BrokerMetrics(), OpsAuth(OPS_TOKEN)), "127.0.0.1", 0
    )
    try:
        token_file = tmp_path / "ops-token"
        outputs = []
        for token in (OPS_TOKEN, "not-the-token"):
            token_file.write_text(token + "\n")
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "edge_client.cli", "login-link",
                "--ops", f"http://127.0.0.1:{port}", "--ops-token-file", str(token_file),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await cli.communicate()
            outputs.append((cli.returncode, out.decode(), err.decode()))
    finally:
        await runner.cleanup()
    (ok, printed, _), (refused, nothing, complaint) = outputs
    assert ok == 0 and re.match(rf"open http://127\.0\.0\.1:{port}/login#code=\S+ to log", printed)
    assert (refused, nothing) == (1, "")
    assert "refused the ops token" in complaint
