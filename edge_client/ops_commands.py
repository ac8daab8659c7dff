"""The people-facing `offload` commands of deployment and mobility:

- `offload deploy MODEL.onnx [--gpus N --gpu-memory MIB --p2p --priority P --site S]`
- `offload delete DEPLOYMENT...` (stops the replica, frees its GPUs and its quota place)
- `offload infer DEPLOYMENT --input NAME=FILE.npy [--output-dir DIR]`
- `offload move CLIENT --site S` (a client's new site; may start a migration)
- `offload migrate DEPLOYMENT [--to NODE] [--strategy make_before_break|stop_start]`
- `offload drain NODE` (operator: the join token)
- `offload retire NODE` (operator: the join token; a node id whose host is gone for good)
- `offload migrations [--deployment ID]` and `offload status`

Client commands use `--broker`/$OFFLOAD_BROKER and `--api-key-file`/$OFFLOAD_API_KEY_FILE;
operator ones `--join-token-file`/$OFFLOAD_JOIN_TOKEN_FILE; read-only views `--ops`/
$OFFLOAD_OPS with `--ops-token-file`/$OFFLOAD_OPS_TOKEN_FILE. Long operations print their
progress.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from edge_client.client import OffloadClient
from edge_client.commands import (
    CommandError,
    _api_key,
    _broker,
    _run,
    broker_call,
    edge_call,
    ops_get,
    ops_token_flag,
    tls_ca,
    tls_flag,
)
from edge_client.errors import OffloadError
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc

FINISHED = ("completed", "rolled_back", "failed")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _deploy(args: argparse.Namespace) -> int:
    if not args.model.is_file():
        raise CommandError(f"{args.model}: no such file")
    started = time.monotonic()
    async with OffloadClient(_broker(args), _api_key(args), tls_ca=tls_ca(args)) as client:
        _say(f"uploading {args.model} ({args.model.stat().st_size / 1e6:.1f} MB) ...")
        try:
            sha = await client.upload_model(args.model)
            _say(f"uploaded, sha256 {sha[:12]}; deploying for site {args.site} ...")
            deployment = await client.deploy(
                sha,
                args.name or args.model.stem,
                gpus=args.gpus,
                gpu_memory_mib=args.gpu_memory,
                p2p=args.p2p,
                priority=args.priority,
                site=args.site,
            )
        except OffloadError as err:
            raise CommandError(str(err)) from err
    _say(f"ready in {time.monotonic() - started:.1f}s")
    if args.json:
        print(json.dumps(dataclasses.asdict(deployment), indent=2))
    else:
        print(
            f"{deployment.deployment_id} running on {deployment.node_id} at {deployment.endpoint}"
        )
    return 0


async def _delete(args: argparse.Namespace) -> int:
    """Delete each deployment named, in order; one that cannot be deleted is reported and
    the others are deleted all the same. Exit status 1 when any could not be."""
    refused = 0
    async with OffloadClient(_broker(args), _api_key(args), tls_ca=tls_ca(args)) as client:
        for deployment_id in args.deployments:
            try:
                deleted = await client.delete(deployment_id)
            except OffloadError as err:
                print(f"offload delete: {err}", file=sys.stderr)
                refused += 1
                continue
            print(f"{deployment_id} {'deleted' if deleted else 'was deleted already'}")
    return 1 if refused else 0


def _inputs(pairs: list[str]) -> dict[str, np.ndarray]:
    inputs = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise CommandError(f"--input {pair!r} is not NAME=FILE.npy")
        try:
            inputs[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise CommandError(f"--input {pair}: cannot read a .npy array ({err})") from err
    if not inputs:
        raise CommandError("give at least one --input NAME=FILE.npy")
    return inputs


async def _infer(args: argparse.Namespace) -> int:
    inputs = _inputs(args.input)
    async with OffloadClient(_broker(args), _api_key(args), tls_ca=tls_ca(args)) as client:
        try:
            await client.attach(args.deployment)
            started = time.perf_counter()
            outputs = await client.infer(inputs)
        except OffloadError as err:
            raise CommandError(str(err)) from err
        elapsed_ms = (time.perf_counter() - started) * 1000
    for name, array in outputs.items():
        line = f"{name}: {array.dtype} {list(array.shape)}"
        if args.output_dir is not None:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            np.save(args.output_dir / f"{name}.npy", array)
            line += f" -> {args.output_dir / (name + '.npy')}"
        print(line)
    _say(f"inference took {elapsed_ms:.1f} ms")
    return 0


def _read_token(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as err:
        raise CommandError(f"cannot read the join token file {path}: {err.strerror}") from err


async def _operator(args: argparse.Namespace, method: str, request: Any) -> Any:
    path = args.join_token_file or os.environ.get("OFFLOAD_JOIN_TOKEN_FILE")
    if not path:
        raise CommandError("give --join-token-file F (or set OFFLOAD_JOIN_TOKEN_FILE)")
    return await broker_call(
        args, pb_grpc.OperatorStub, method, request, _read_token(Path(path)), 30
    )


async def _move(args: argparse.Namespace) -> int:
    reply = await edge_call(
        args, "ReportLocation", pb.ReportLocationRequest(client_id=args.client, site=args.site)
    )
    if reply.migration_id:
        print(f"{args.client} is at {args.site}: migration {reply.migration_id} started")
    else:
        print(f"{args.client} is at {args.site}: no migration (see the broker log for why)")
    return 0


def _describe(m: pb.Migration) -> str:
    gap = "-" if m.downtime_ms < 0 else f"{m.downtime_ms:.1f} ms"
    span = "-" if m.span_gap_ms < 0 else f"{m.span_gap_ms:.1f} ms"
    warm = " (pre-warmed)" if m.prewarmed else ""
    reason = f" ({m.reason})" if m.reason else ""
    return (
        f"{m.migration_id} {m.deployment_id} {m.trigger} {m.source_node} -> {m.target_node} "
        f"{m.strategy}{warm}: {m.state}{reason}; client gap {gap} at the switch, {span} over "
        "the migration"
    )


async def _wait(args: argparse.Namespace, migration: pb.Migration, operator: bool) -> pb.Migration:
    seen: set[str] = set()
    started = time.monotonic()
    while True:
        request = pb.ListMigrationsRequest(deployment_id=migration.deployment_id)
        if operator:
            reply = await _operator(args, "ListMigrations", request)
        else:
            reply = await edge_call(args, "ListMigrations", request)
        current = next(m for m in reply.migrations if m.migration_id == migration.migration_id)
        for event in current.timeline:
            if event.event not in seen:
                seen.add(event.event)
                _say(f"  +{(event.at - current.timeline[0].at) * 1000:7.1f} ms  {event.event}")
        if current.state in FINISHED:
            return current
        if time.monotonic() - started > 300:
            raise CommandError(f"migration {migration.migration_id} not finished after 300 s")
        await asyncio.sleep(0.2)


async def _migrate(args: argparse.Namespace) -> int:
    request = pb.MigrateRequest(
        deployment_id=args.deployment, to_node=args.to or "", strategy=args.strategy
    )
    if args.join_token_file or os.environ.get("OFFLOAD_JOIN_TOKEN_FILE"):
        migration, operator = await _operator(args, "Migrate", request), True
    else:
        migration, operator = await edge_call(args, "Migrate", request), False
    _say(f"migration {migration.migration_id}: {migration.source_node} -> {migration.target_node}")
    done = await _wait(args, migration, operator)
    print(_describe(done))
    return 0 if done.outcome == "succeeded" else 1


async def _drain(args: argparse.Namespace) -> int:
    reply = await _operator(args, "DrainNode", pb.DrainNodeRequest(node_id=args.node))
    if not reply.migration_ids:
        print(f"{args.node} drained: nothing ran there")
        return 0
    _say(f"draining {args.node}: {len(reply.migration_ids)} migration(s)")
    failed = 0
    for migration_id in reply.migration_ids:
        listed = await _operator(args, "ListMigrations", pb.ListMigrationsRequest())
        migration = next(m for m in listed.migrations if m.migration_id == migration_id)
        done = await _wait(args, migration, operator=True)
        print(_describe(done))
        failed += done.outcome != "succeeded"
    return 1 if failed else 0


async def _retire(args: argparse.Namespace) -> int:
    await _operator(args, "RetireNode", pb.RetireNodeRequest(node_id=args.node))
    print(
        f"{args.node} retired: the next node daemon to register this id binds it to its own "
        "node secret"
    )
    return 0


async def _migrations(args: argparse.Namespace) -> int:
    migrations = await ops_get(args, "/api/migrations")
    if args.deployment:
        migrations = [m for m in migrations if m["deployment_id"] == args.deployment]
    if args.json:
        print(json.dumps(migrations, indent=2))
        return 0
    table = Table("migration", "deployment", "trigger", "from", "to", "strategy", "outcome",
                  "gap at switch", "worst gap", "failed")  # fmt: skip
    for m in migrations:
        gap, span = m["downtime_ms"], m.get("span_gap_ms")  # absent from an older broker
        table.add_row(
            m["migration_id"], m["deployment_id"], m["trigger"], m["source"] or "-",
            m["target"] or "-",
            m["strategy"] + (" (pre-warmed)" if m.get("prewarmed") else ""),
            m["outcome"] or "under way",
            "-" if gap is None else f"{gap:.1f} ms",
            "-" if span is None else f"{span:.1f} ms",
            "-" if m["failed_requests"] is None else str(m["failed_requests"]),
        )  # fmt: skip
    Console().print(table)
    return 0


async def _status(args: argparse.Namespace) -> int:
    nodes = await ops_get(args, "/api/nodes")
    deployments = await ops_get(args, "/api/deployments")
    migrations = await ops_get(args, "/api/migrations")
    gpus = [g for n in nodes for g in n["gpus"]]
    node_states = Counter(n["state"] for n in nodes)
    deployment_states = Counter(d["state"] for d in deployments)
    free = sum(g["free"] for g in gpus)
    last = migrations[0] if migrations else None
    offload = _offload_totals(deployments)
    # None from a broker older than services' figures (no such route).
    services = await ops_get(args, "/api/services", missing_ok=True)
    if args.json:
        summary = {
            "nodes": node_states,
            "gpus": {"total": len(gpus), "free": free},
            "deployments": deployment_states,
            "migrations": len(migrations),
            "last_migration": last,
            "offload": offload,
            "services": services,
        }
        print(json.dumps(summary, indent=2))
        return 0
    print(f"nodes        {_listing(node_states)}")
    print(f"GPUs         {free} free of {len(gpus)}")
    print(f"deployments  {_listing(deployment_states)}")
    print(
        f"migrations   {len(migrations)}"
        + (f"; last {last['migration_id']} {last['outcome'] or 'under way'}" if last else "")
    )
    if offload["deployments"]:
        unreachable = offload["replica_unreachable"]
        print(
            f"offload      {offload['deployments']} deployment(s) with a device model: "
            f"{offload['remote_requests']} remote, {offload['local_requests']} local, "
            f"{offload['fallbacks']} fallback(s)"
            + (f"; replica unreachable: {', '.join(unreachable)}" if unreachable else "")
        )
    if services:
        print(f"services     {len(services)}")
        for service in services:
            for line in _service_lines(service):
                print(f"  {line}")
    return 0


def _figure(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{name} {share:.0%}" for name, share in sorted(shares.items()))


def _service_lines(service: dict[str, Any]) -> list[str]:
    """A service's summary line, then a line per replica and its busiest clients."""
    replicas = service["replicas"]
    batching = (
        f", batches of {service['batch_size_mean']:.1f} rows"
        if service["batch_size_mean"] is not None
        else ""
    )
    shares = f" ({_shares(service['class_shares'])})" if service["class_shares"] else ""
    lines = [
        f"{service['name']} (model {service['model_name']}, owner {service['owner']}): "
        f"{service['clients']} client(s), {len(replicas)} replica(s); "
        f"{_figure(service['request_rate'])} req/s, "
        f"p99 {_figure(service['latency_p99_ms'], ' ms')}{batching}{shares}"
    ]
    rows = [
        ("replica", "site", "node", "state", "clients", "req/s", "p99", "queue", "batch")
    ] + [
        (
            r["deployment_id"], r["site"], r["node_id"] or "-", r["state"], str(r["clients"]),
            _figure(r["request_rate"]), _figure(r["latency_p99_ms"], " ms"),
            "-" if r["queued"] is None else str(r["queued"]), _figure(r["batch_size_mean"]),
        )
        for r in replicas
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]  # fmt: skip
    if service["busiest_clients"]:
        busiest = ", ".join(
            f"{c['client_id']} {c['request_rate']:.1f} req/s"
            + (f" ({c['refused_rate']:.1f} refused)" if c["refused_rate"] else "")
            for c in service["busiest_clients"]
        )
        lines.append(f"  busiest clients: {busiest}")
    return lines


def _offload_totals(deployments: list[dict[str, Any]]) -> dict[str, Any]:
    """The clients' offload reports summed over deployments and sessions; which deployments'
    clients last saw their replica unreachable."""
    reported = [d for d in deployments if d.get("offload")]  # absent from an older broker
    sessions = [o for d in reported for o in d["offload"]]
    return {
        "deployments": len(reported),
        "remote_requests": sum(o["remote_requests"] for o in sessions),
        "local_requests": sum(o["local_requests"] for o in sessions),
        "fallbacks": sum(o["fallbacks"] for o in sessions),
        "replica_unreachable": [
            d["deployment_id"] for d in reported if not d["offload"][0]["remote_reachable"]
        ],
    }


def _listing(counts: Counter[str]) -> str:
    return ", ".join(f"{n} {state}" for state, n in counts.items()) or "none"


def _operator_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a command only an operator may run: the broker, the join token, TLS."""
    p.add_argument(
        "--broker",
        help="the broker's gRPC address HOST:PORT, or several, comma-separated ($OFFLOAD_BROKER)",
    )
    p.add_argument("--join-token-file", help="the cluster's join token ($OFFLOAD_JOIN_TOKEN_FILE)")
    tls_flag(p)


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--broker",
        help="the broker's gRPC address HOST:PORT, or several, comma-separated ($OFFLOAD_BROKER)",
    )
    p.add_argument("--api-key-file", help="file holding your API key ($OFFLOAD_API_KEY_FILE)")
    tls_flag(p)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("deploy", help="upload a model and deploy it; prints its id")
    p.add_argument("model", type=Path, help="the .onnx file")
    p.add_argument("--name", help="the name to serve it under (default: the file's stem)")
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument(
        "--gpu-memory",
        type=int,
        default=0,
        metavar="MIB",
        help="a memory share per GPU instead of whole GPUs",
    )
    p.add_argument("--p2p", action="store_true", help="the GPUs must be P2P-linked")
    p.add_argument(
        "--priority", default="standard", choices=["best-effort", "standard", "critical"]
    )
    p.add_argument("--site", required=True, help="where the client is now")
    p.add_argument("--json", action="store_true")
    _client_flags(p)
    p.set_defaults(func=_run(_deploy))

    p = subparsers.add_parser(
        "delete",
        help="undeploy: stop deployments' replicas, free their GPUs and quota",
        description="Delete your deployments: each one's replica is stopped (drained first), "
        "its GPUs are freed, and it no longer counts against your "
        "--max-deployments-per-client quota. A pending or failed deployment holds no GPUs: "
        "it is only deleted, which is how a failed one stops counting. Deleting a deployment "
        "you deleted already is fine: it says so and changes nothing. An id there never was "
        "is NOT_FOUND; another client's deployment is PERMISSION_DENIED. Prints one line per "
        "deployment; exit status 1 when any could not be deleted (the others still are). "
        "`offload deployments` lists your deployments and their ids.",
    )
    p.add_argument("deployments", nargs="+", metavar="DEPLOYMENT", help="a deployment id (d-...)")
    _client_flags(p)
    p.set_defaults(func=_run(_delete))

    p = subparsers.add_parser("infer", help="one inference on a deployment")
    p.add_argument("deployment")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    p.add_argument("--output-dir", type=Path, help="save each output as NAME.npy here")
    _client_flags(p)
    p.set_defaults(func=_run(_infer))

    p = subparsers.add_parser("move", help="report a client's new site (may migrate)")
    p.add_argument("client", help="the client id (must be the API key's)")
    p.add_argument("--site", required=True)
    _client_flags(p)
    p.set_defaults(func=_run(_move))

    p = subparsers.add_parser("migrate", help="move a deployment now, with progress")
    p.add_argument("deployment")
    p.add_argument("--to", help="the target node (default: the best for its site)")
    p.add_argument(
        "--strategy", default="make_before_break", choices=["make_before_break", "stop_start"]
    )
    p.add_argument(
        "--join-token-file", help="act as operator (any deployment) ($OFFLOAD_JOIN_TOKEN_FILE)"
    )
    _client_flags(p)
    p.set_defaults(func=_run(_migrate))

    p = subparsers.add_parser("drain", help="move every deployment off a node (operator)")
    p.add_argument("node")
    _operator_flags(p)
    p.set_defaults(func=_run(_drain))

    p = subparsers.add_parser(
        "retire",
        help="free a node id whose host is gone for good, or lost its state dir (operator)",
    )
    p.add_argument("node")
    _operator_flags(p)
    p.set_defaults(func=_run(_retire))

    for name, helptext, handler in (
        ("migrations", "migrations with their outcome and client-observed gap", _migrations),
        ("status", "the cluster at a glance", _status),
    ):
        p = subparsers.add_parser(name, help=helptext)
        if name == "migrations":
            p.add_argument("--deployment", help="only this deployment's")
        p.add_argument("--ops", help="the broker's ops URL ($OFFLOAD_OPS)")
        ops_token_flag(p)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=_run(handler))
