"""`offload nodes`, `offload deployments`, `offload explain`: what runs where, and why;
`offload login-link`: a one-time link that logs a browser into the dashboard.

`nodes` and `login-link` use the broker's ops API (`--ops URL --ops-token-file F`, or
$OFFLOAD_OPS and $OFFLOAD_OPS_TOKEN_FILE); `deployments` and
`explain` call the broker's EdgeBroker service with a client's API key (`--broker HOST:PORT
--api-key-file F`, or $OFFLOAD_BROKER and $OFFLOAD_API_KEY_FILE). Tables for people, `--json`
for scripts. `--tls-ca F` (or $OFFLOAD_TLS_CA) is the CA a TLS broker's certificate must
chain to, for its gRPC port and its HTTPS ops API alike; without it they are plaintext.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from rich.console import Console
from rich.table import Table

from common.brokers import BrokerAddresses, leader_hint, parse_broker_addresses
from common.certs import CertError, TlsIdentity, load_ca
from edge_client.client import tls_hint
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from runtime.tls import open_channel

_PRIORITY = {1: "best-effort", 2: "standard", 3: "critical"}


class CommandError(Exception):
    """A problem the user can fix; the message says how."""


def _secret(path: str | None, flag: str, env: str, what: str, hint: str = "") -> str:
    """The secret in the file `path` (the value of `flag`) or in the file $`env` names.
    CommandError when neither is given (with `hint`: which file that is), or the file cannot
    be read or is empty."""
    path = path or os.environ.get(env)
    if not path:
        raise CommandError(f"give {flag} F (or set {env}){hint}")
    try:
        secret = Path(path).read_text().strip()
    except OSError as err:
        raise CommandError(f"cannot read the {what} file {path}: {err.strerror}") from err
    if not secret:
        raise CommandError(f"the {what} file {path} is empty")
    return secret


def _api_key(args: argparse.Namespace) -> str:
    return _secret(args.api_key_file, "--api-key-file", "OFFLOAD_API_KEY_FILE", "API key")


def _broker(args: argparse.Namespace) -> str:
    """`--broker` or $OFFLOAD_BROKER: one HOST:PORT or several, comma-separated (brokers
    sharing one state; calls go to whichever leads). CommandError when absent or malformed."""
    address = args.broker or os.environ.get("OFFLOAD_BROKER")
    if not address:
        raise CommandError("give --broker HOST:PORT (or set OFFLOAD_BROKER)")
    try:
        parse_broker_addresses(address)
    except ValueError as err:
        raise CommandError(str(err)) from None
    return address


def _tls(args: argparse.Namespace) -> TlsIdentity | None:
    """The CA of `--tls-ca`/$OFFLOAD_TLS_CA, checked; None without one (plaintext).
    CommandError when it is not a valid PEM certificate."""
    path = getattr(args, "tls_ca", None) or os.environ.get("OFFLOAD_TLS_CA")
    if not path:
        return None
    try:
        return TlsIdentity(ca=load_ca(Path(path)))
    except CertError as err:
        raise CommandError(str(err)) from None


def tls_ca(args: argparse.Namespace) -> str | None:
    """The `--tls-ca` file (or $OFFLOAD_TLS_CA), checked as `_tls` does; None: plaintext."""
    if _tls(args) is None:
        return None
    return str(getattr(args, "tls_ca", None) or os.environ["OFFLOAD_TLS_CA"])


async def broker_call(
    args: argparse.Namespace,
    stub_class: Any,
    method: str,
    request: Any,
    token: str,
    deadline_s: float,
) -> Any:
    """One call to the broker (`--broker`, over TLS with `--tls-ca`) with `token` as bearer;
    CommandError with the status, and what TLS has to do with it. With several brokers, an
    UNAVAILABLE one (a standby, or one down) is passed over for the leader it named or the
    next one, each broker at most twice."""
    metadata = (("authorization", f"Bearer {token}"),)
    brokers = BrokerAddresses(parse_broker_addresses(_broker(args)))
    tls = _tls(args)
    attempts = 2 * len(brokers.all)
    while True:
        attempts -= 1
        async with open_channel(brokers.current, tls) as channel:
            try:
                return await getattr(stub_class(channel), method)(
                    request, metadata=metadata, timeout=deadline_s
                )
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or tls_hint(err) or not attempts:
                    raise CommandError(
                        f"{err.code().name}: {err.details()}{tls_hint(err)}"
                    ) from err
                brokers.failed(leader_hint(err.trailing_metadata()))


async def edge_call(args: argparse.Namespace, method: str, request: Any) -> Any:
    return await broker_call(args, pb_grpc.EdgeBrokerStub, method, request, _api_key(args), 15)


def _ops_token(args: argparse.Namespace) -> str:
    return _secret(
        args.ops_token_file,
        "--ops-token-file",
        "OFFLOAD_OPS_TOKEN_FILE",
        "ops token",
        ": the broker's --ops-token-file, or <state-dir>/ops-token when it runs without one",
    )


async def ops_get(args: argparse.Namespace, path: str, missing_ok: bool = False) -> Any:
    """GET the broker's ops API (`--ops` or $OFFLOAD_OPS) with the ops token
    (`--ops-token-file` or $OFFLOAD_OPS_TOKEN_FILE) and return its JSON; None for a 404 with
    `missing_ok` (a route an older broker does not have)."""
    url = (args.ops or os.environ.get("OFFLOAD_OPS") or "").rstrip("/")
    if not url:
        raise CommandError("give --ops URL, the broker's ops address (or set OFFLOAD_OPS)")
    headers = {"Authorization": f"Bearer {_ops_token(args)}"}
    tls = _tls(args)
    context = ssl.create_default_context(cadata=tls.ca.decode()) if tls is not None else None
    try:
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=15), headers=headers
            ) as http,
            http.get(f"{url}{path}", ssl=context if context is not None else True) as response,
        ):
            if response.status == 401:
                raise CommandError(
                    f"{url}{path} refused the ops token: check --ops-token-file "
                    "(or OFFLOAD_OPS_TOKEN_FILE)"
                )
            if response.status == 404 and missing_ok:
                return None
            if response.status != 200:
                raise CommandError(f"{url}{path} answered HTTP {response.status}")
            return await response.json()
    except aiohttp.ClientError as err:
        raise CommandError(f"cannot reach the broker's ops API at {url}: {err}") from err


async def request_login_link(
    ops_url: str, headers: dict[str, str], ssl_context: ssl.SSLContext | None = None
) -> tuple[str, float]:
    """A one-time dashboard login link from the broker's ops API at `ops_url` (`headers`
    carry the ops token): the link, and for how many seconds it logs in once. The link
    holds its code in its fragment, which a browser never sends (see `broker.ops.auth`).
    CommandError when the broker cannot be reached or refuses."""
    url = ops_url.rstrip("/")
    try:
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=15), headers=headers
            ) as http,
            http.post(
                f"{url}/api/login-link", ssl=ssl_context if ssl_context is not None else True
            ) as response,
        ):
            if response.status == 401:
                raise CommandError(
                    f"{url} refused the ops token: check --ops-token-file "
                    "(or OFFLOAD_OPS_TOKEN_FILE)"
                )
            if response.status != 200:
                raise CommandError(
                    f"{url}/api/login-link answered HTTP {response.status} (a broker too old "
                    "for one-time links answers 404: paste the ops token instead)"
                )
            link = await response.json()
    except aiohttp.ClientError as err:
        raise CommandError(f"cannot reach the broker's ops API at {url}: {err}") from err
    return f"{url}{link['path']}", float(link["expires_in_s"])


def login_link_line(link: str, valid_s: float) -> str:
    """What to tell a person about a one-time login link."""
    return (
        f"open {link} to log in to the dashboard: it works once, within "
        f"{valid_s / 60:g} minutes (then ask for another: offload login-link)"
    )


async def _login_link(args: argparse.Namespace) -> int:
    url = (args.ops or os.environ.get("OFFLOAD_OPS") or "").rstrip("/")
    if not url:
        raise CommandError("give --ops URL, the broker's ops address (or set OFFLOAD_OPS)")
    tls = _tls(args)
    context = ssl.create_default_context(cadata=tls.ca.decode()) if tls is not None else None
    link, valid_s = await request_login_link(
        url, {"Authorization": f"Bearer {_ops_token(args)}"}, context
    )
    print(login_link_line(link, valid_s))
    return 0


async def _nodes(args: argparse.Namespace) -> int:
    nodes = await ops_get(args, "/api/nodes")
    if args.json:
        print(json.dumps(nodes, indent=2))
        return 0
    table = Table("node", "site", "state", "GPUs free", "GPU model", "heartbeat", "address")
    for n in nodes:
        gpus = n["gpus"]
        age = n["last_heartbeat_age_s"]
        table.add_row(
            n["node_id"],
            n["site"],
            n["state"],
            f"{sum(g['free'] for g in gpus)}/{len(gpus)}",
            gpus[0]["name"] if gpus else "-",
            "never" if age is None else f"{age:.1f}s ago",
            n["address"],
        )
    Console().print(table)
    return 0


async def _deployments(args: argparse.Namespace) -> int:
    reply = await edge_call(args, "ListDeployments", pb.ListDeploymentsRequest())
    deployments = list(reply.deployments)
    if args.json:
        print(json.dumps([_deployment_dict(d) for d in deployments], indent=2))
        return 0
    table = Table("deployment", "model", "state", "node", "GPUs", "endpoint", "epoch", "priority")
    for d in deployments:
        table.add_row(
            d.deployment_id,
            d.model_name,
            d.state + (f" ({_short_reason(d.reason)})" if d.reason else ""),
            d.node_id or "-",
            str(len(d.gpu_uuids)),
            d.endpoint or "-",
            str(d.epoch),
            _PRIORITY.get(d.priority, str(d.priority)),
        )
    Console().print(table)
    failed = [d.deployment_id for d in deployments if d.state == "failed"]
    if failed:
        print(
            f"{len(failed)} failed deployment(s) still count against your "
            "--max-deployments-per-client quota; delete them with: "
            f"offload delete {' '.join(failed)} (`offload explain ID` shows the whole reason)"
        )
    return 0


def _short_reason(reason: str) -> str:
    """`reason` on one line, for a table: its first line and, when it goes on (the log tail
    of a replica that failed), its last, which is where the replica said why."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    return " ... ".join(lines[:1] + lines[1:][-1:])


def _deployment_dict(d: pb.Deployment) -> dict[str, Any]:
    return {
        "deployment_id": d.deployment_id,
        "model_name": d.model_name,
        "model_sha256": d.model_sha256,
        "state": d.state,
        "reason": d.reason,
        "node_id": d.node_id,
        "gpu_uuids": list(d.gpu_uuids),
        "endpoint": d.endpoint,
        "epoch": d.epoch,
        "priority": _PRIORITY.get(d.priority, str(d.priority)),
        "site": d.site,
    }


async def _explain(args: argparse.Namespace) -> int:
    d = await edge_call(
        args, "GetDeployment", pb.GetDeploymentRequest(deployment_id=args.deployment)
    )
    explanation = json.loads(d.explanation_json or "{}")
    resizes = [
        {
            "at": r.at,
            "replica_id": r.replica_id,
            "cpus_before": r.cpus_before,
            "cpus_after": r.cpus_after,
            "policy": r.policy,
            "reason": r.reason,
        }
        for r in d.resizes
    ]
    if args.json:
        print(
            json.dumps(
                {**_deployment_dict(d), "explanation": explanation, "resizes": resizes}, indent=2
            )
        )
        return 0
    print(f"deployment {d.deployment_id} ({d.model_name}) is {d.state}" + (
        f": {d.reason}" if d.reason else ""))  # fmt: skip
    print(explanation.get("text") or "(no placement recorded)")
    if resizes:
        print("CPU resizes by the node's resource manager (most recent last):")
    for r in resizes:
        when = time.strftime("%H:%M:%S", time.localtime(r["at"]))
        print(
            f"  {when} {r['replica_id']}: {r['cpus_before']:.2f} -> {r['cpus_after']:.2f} "
            f"cores ({r['policy']}): {r['reason']}"
        )
    return 0


def ops_token_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ops-token-file", help="file holding the broker's ops token ($OFFLOAD_OPS_TOKEN_FILE)"
    )
    tls_flag(p)


def tls_flag(p: argparse.ArgumentParser) -> None:
    """`--tls-ca`, for every command that talks to the broker."""
    p.add_argument(
        "--tls-ca",
        help="the CA (PEM) the broker's certificate must chain to: TLS to its gRPC port and "
        "HTTPS to its ops API ($OFFLOAD_TLS_CA; default: plaintext)",
    )


def _run(handler: Any) -> Any:
    def main(args: argparse.Namespace) -> int:
        try:
            return int(asyncio.run(handler(args)))
        except CommandError as err:
            print(f"offload {args.command}: {err}", file=sys.stderr)
            return 1

    return main


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    nodes = subparsers.add_parser("nodes", help="the broker's nodes, their GPUs and state")
    nodes.add_argument("--ops", help="the broker's ops URL, e.g. http://broker:8080")
    ops_token_flag(nodes)
    nodes.add_argument("--json", action="store_true", help="print JSON instead of a table")
    nodes.set_defaults(func=_run(_nodes))
    login = subparsers.add_parser(
        "login-link",
        help="a one-time link that logs a browser into the broker's dashboard (valid once, "
        "for 5 minutes; the ops token needed)",
    )
    login.add_argument("--ops", help="the broker's ops URL, e.g. http://broker:8080")
    ops_token_flag(login)
    login.set_defaults(func=_run(_login_link))
    for name, helptext, handler in (
        (
            "deployments",
            "your deployments, where they run, and why any failed (`offload delete ID` "
            "removes one)",
            _deployments,
        ),
        ("explain", "why a deployment runs where it does", _explain),
    ):
        p = subparsers.add_parser(name, help=helptext)
        if name == "explain":
            p.add_argument("deployment", help="the deployment id")
        p.add_argument(
            "--broker",
            help="the broker's gRPC address HOST:PORT, or several, comma-separated "
            "($OFFLOAD_BROKER)",
        )
        p.add_argument("--api-key-file", help="file holding your API key")
        tls_flag(p)
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.set_defaults(func=_run(handler))
