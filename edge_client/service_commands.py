"""`offload service create|list|show|delete`: a model published once for many clients
(issue 52). Calls the broker's EdgeBroker service with the owner's API key (`--broker
HOST:PORT --api-key-file F`, or $OFFLOAD_BROKER and $OFFLOAD_API_KEY_FILE). Clients put
themselves on a service's replica with the SDK (`OffloadClient.use_service`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from edge_client.client import OffloadClient
from edge_client.commands import CommandError, _api_key, _broker, _run, edge_call, tls_ca, tls_flag
from edge_client.errors import OffloadError
from protos.offload.v1 import broker_pb2 as pb


def _service_dict(s: pb.Service) -> dict[str, Any]:
    spec = s.spec
    return {
        "name": s.name,
        "owner": s.owner,
        "model_name": spec.model_name,
        "model_sha256": spec.model_sha256,
        "gpus": spec.gpus,
        "gpu_memory_mib": spec.gpu_memory_mib,
        "clients": "any" if spec.any_client else list(spec.clients),
        "min_replicas_per_site": spec.min_replicas_per_site,
        "max_replicas": spec.max_replicas,
        "latency_slo_ms": spec.latency_slo_ms,
        "max_rps_per_client": spec.max_rps_per_client,
        "clients_attached": s.clients,
        "replicas": [
            {
                "deployment_id": r.deployment_id,
                "site": r.site,
                "node_id": r.node_id,
                "state": r.state,
                "endpoint": r.endpoint,
                "clients": r.clients,
            }
            for r in s.replicas
        ],
        "events": [
            {
                "at": e.at,
                "action": e.action,
                "deployment_id": e.deployment_id,
                "site": e.site,
                "reason": e.reason,
            }
            for e in s.events
        ],
    }


def _clients(text: str) -> list[str]:
    """`--clients ID,ID,...` as a list; CommandError for an empty item."""
    ids = [item.strip() for item in text.split(",")]
    if not all(ids):
        raise CommandError(f"--clients {text!r}: give client ids separated by commas")
    return ids


async def _create(args: argparse.Namespace) -> int:
    model: Path = args.model
    try:
        size = (await asyncio.to_thread(model.stat)).st_size
    except OSError as err:
        raise CommandError(f"{model}: {err.strerror}") from None
    clients = _clients(args.clients) if args.clients else []
    async with OffloadClient(_broker(args), _api_key(args), tls_ca=tls_ca(args)) as client:
        try:
            print(f"uploading {model} ({size / 1e6:.1f} MB) ...", file=sys.stderr)
            sha = await client.upload_model(model)
            service = await client.create_service(
                args.name,
                sha,
                args.model_name or model.stem,
                gpus=args.gpus,
                gpu_memory_mib=args.gpu_memory,
                clients=clients,
                any_client=args.any_client,
                min_replicas_per_site=args.min_replicas_per_site,
                max_replicas=args.max_replicas,
                latency_slo_ms=args.latency_slo_ms,
                max_rps_per_client=args.max_rps_per_client,
            )
        except OffloadError as err:
            raise CommandError(str(err)) from err
    return _show_one(service, args.json)


def _show_one(service: pb.Service, as_json: bool) -> int:
    if as_json:
        print(json.dumps(_service_dict(service), indent=2))
        return 0
    spec = service.spec
    who = "any client" if spec.any_client else ", ".join([service.owner, *spec.clients])
    print(
        f"service {service.name} ({spec.model_name}, owner {service.owner}): "
        f"{len(service.replicas)} replica(s), {service.clients} client(s); for {who}"
    )
    table = Table("replica (deployment)", "site", "node", "state", "endpoint", "clients")
    for r in service.replicas:
        table.add_row(
            r.deployment_id, r.site, r.node_id or "-", r.state, r.endpoint or "-", str(r.clients)
        )
    if service.replicas:
        Console().print(table)
    if service.events:
        print("scale decisions (most recent last):")
    for e in service.events:
        when = time.strftime("%H:%M:%S", time.localtime(e.at))
        print(f"  {when} {e.action} {e.deployment_id} at {e.site}: {e.reason}")
    return 0


async def _list(args: argparse.Namespace) -> int:
    reply = await edge_call(args, "ListServices", pb.ListServicesRequest())
    services = list(reply.services)
    if args.json:
        print(json.dumps([_service_dict(s) for s in services], indent=2))
        return 0
    table = Table("service", "model", "owner", "replicas", "clients", "for")
    for s in services:
        table.add_row(
            s.name,
            s.spec.model_name,
            s.owner,
            str(len(s.replicas)),
            str(s.clients),
            "any client" if s.spec.any_client else str(len(s.spec.clients) + 1) + " client(s)",
        )
    Console().print(table)
    return 0


async def _show(args: argparse.Namespace) -> int:
    return _show_one(
        await edge_call(args, "GetService", pb.GetServiceRequest(name=args.name)), args.json
    )


async def _delete(args: argparse.Namespace) -> int:
    await edge_call(args, "DeleteService", pb.DeleteServiceRequest(name=args.name))
    print(f"service {args.name} deleted: its replicas stop, its clients' tokens end")
    return 0


def _connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--broker",
        help="the broker's gRPC address HOST:PORT, or several, comma-separated ($OFFLOAD_BROKER)",
    )
    p.add_argument("--api-key-file", help="file holding your API key ($OFFLOAD_API_KEY_FILE)")
    tls_flag(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _non_negative(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value >= 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
        return value

    return parse


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    service = subparsers.add_parser(
        "service",
        help="models published once for many clients: create, list, show, delete",
        description="A service is one model for many clients: each client puts itself on "
        "the best replica for its site with the SDK (OffloadClient.use_service), with a "
        "token of its own; replicas start where clients need one.",
    )
    verbs = service.add_subparsers(dest="verb", required=True)
    create = verbs.add_parser("create", help="upload a model and publish it as a service you own")
    create.add_argument("name", help="the service's name: lowercase letters, digits and '-'")
    create.add_argument("model", type=Path, help="the ONNX model file")
    create.add_argument(
        "--model-name", help="the model's name at the replicas (default: the file's stem)"
    )
    resources = create.add_mutually_exclusive_group()
    resources.add_argument("--gpus", type=_non_negative(int), default=0, help="GPUs per replica")
    resources.add_argument(
        "--gpu-memory",
        type=_non_negative(int),
        default=0,
        metavar="MIB",
        help="a share of one GPU's memory per replica, in MiB (implies one GPU)",
    )
    who = create.add_mutually_exclusive_group()
    who.add_argument(
        "--clients",
        metavar="ID,ID,...",
        help="the client ids that may use it besides you (default: you alone)",
    )
    who.add_argument(
        "--any-client", action="store_true", help="any client of the broker may use it"
    )
    create.add_argument(
        "--min-replicas-per-site",
        type=_non_negative(int),
        default=0,
        metavar="M",
        help="replicas kept at every site whatever the demand (default 0: started on demand)",
    )
    create.add_argument(
        "--max-replicas",
        type=_non_negative(int),
        default=0,
        metavar="R",
        help="at most this many replicas in all (default: the broker's, 16)",
    )
    create.add_argument(
        "--latency-slo-ms",
        type=_non_negative(float),
        default=0.0,
        metavar="L",
        help="a client goes to a replica at most this far from its site, else one starts "
        "there (default 0: any replica in reach)",
    )
    create.add_argument(
        "--max-rps-per-client",
        type=_non_negative(float),
        default=0.0,
        metavar="N",
        help="each client's inference calls per second at a replica (default 0: no limit)",
    )
    _connection_flags(create)
    create.set_defaults(func=_run(_create))
    listing = verbs.add_parser("list", help="the services you own or may use")
    _connection_flags(listing)
    listing.set_defaults(func=_run(_list))
    for verb, helptext, handler in (
        ("show", "a service, its replicas and how many clients each serves", _show),
        ("delete", "delete a service you own: its replicas stop", _delete),
    ):
        p = verbs.add_parser(verb, help=helptext)
        p.add_argument("name", help="the service's name")
        _connection_flags(p)
        p.set_defaults(func=_run(handler))
