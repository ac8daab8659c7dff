"""The chaos suite: a real cluster on loopback under concurrency, faults and hostile input
(issue 10), and a table of what it tried and what held.

    python -m bench.chaos [--quick] [--scenarios NAME ...] [--json FILE] [--seed N]

It starts the demo's cluster (`edge_client.demo.cluster.LocalCluster`): an `offload broker`
and three `offload node` daemons as subprocesses, process-runtime replicas, topology-file
GPUs, with a short `--orphan-grace` (3 s). 21 clients have keys in `--api-keys-file`; each
uploads the test model (`mlp`), then the broker is restarted so that it has verified none of
their keys. Then, each scenario bounded in time:

- deploy-storm: 200 concurrent Deploys from 20 clients whose keys are cold (full mode: a
  second wave with warm keys), random GPU counts, priorities and sites, each client from an
  address of its own as devices are (127.0.0.10, .11, ... through `bench.relay`), while 60
  callers send well-formed bogus keys from 127.0.0.1 (a call each at most every 0.1 s);
  then the running deployments must hold every GPU of the nodes;
- bogus-flood: the 60 bogus-key callers alone, a valid client's calls timed meanwhile, the
  nodes' heartbeat ages watched;
- cancelled-deploys: Deploys whose client deadline (0.3-0.5 s) expires mid-start, then as
  many normal Deploys at the same site (they would get a GPU a leaked replica still holds),
  in rounds with every deployment deleted between them;
- broker-kill-deploy / broker-kill-migrate: SIGKILL of the broker at a random point of
  Deploys, of make-before-break migrations (Operator.Migrate) and of mobility migrations
  (ReportLocation), then a restart on the same state dir;
- node-kill: SIGKILL of a node daemon at a random point of a Deploy or a migration to it,
  then a restart (same node id and state dir: it adopts its replicas);
- fuzz: every RPC of the broker (EdgeBroker, Operator, NodeRegistry), of a node daemon
  (NodeAgent) and of a replica (GRPCInferenceService) with random field values from the
  message descriptors (NaN, inf, huge, strings that are not UTF-8) and random raw bytes.

After each scenario it waits (up to a bound) for the store, the nodes' ListReplicas and the
replica processes to agree (`bench.chaos_check`), records what does not, and deletes every
deployment before the next one. What it checks, per scenario: requests by gRPC status;
UNKNOWN/INTERNAL answers; answers outside what the scenario allows (a refused Deploy in the
storm must be RESOURCE_EXHAUSTED for want of room, not a key-check throttle, a bogus key
UNAUTHENTICATED or RESOURCE_EXHAUSTED; an error message must be short and carry no escape
codes or tracebacks); nodes marked lost while their daemon ran (the broker's log and
`/api/nodes`); a storm that leaves some of the nodes' GPUs free; leaked replicas; GPUs
double-booked; lost or duplicated deployments; deployments neither running nor pending.

Exit status: 0 when every invariant held, 1 when one failed (the table says which), 2 for bad
arguments, 130 after Ctrl-C. Everything it started is stopped on the way out, whatever ends it.
Short mode takes about two minutes on a 2-core machine, the full one about six; the details
are in docs/OPERATIONS.md. It is not one of `python -m bench`'s benchmarks: those measure
figures against a baseline and fail only when they break, while this exits 1 when the system
under test breaks an invariant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import aiohttp
import grpc

import modelzoo
from bench.chaos_check import (
    Problems,
    Stored,
    Unobservable,
    node_address,
    replica_processes,
    settle,
    stored_deployments,
)
from bench.chaos_fuzz import Known, call_raw, random_requests
from bench.relay import SourceRelay
from broker.errors import MESSAGE_CHARS
from broker.state.api_keys import new_api_key
from common.beacons import BEACON_BYTES
from common.beacons import VERSION as BEACON_VERSION
from edge_client.client import OffloadClient
from edge_client.demo.cluster import ClusterError, LocalCluster
from edge_client.demo.run import install_stop_signals, keep_logs
from protos.inference import grpc_service_pb2 as ipb
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from protos.offload.v1 import node_pb2 as npb

T = TypeVar("T")
Code: TypeAlias = grpc.StatusCode

SCENARIOS = (
    "deploy-storm",
    "bogus-flood",
    "cancelled-deploys",
    "broker-kill-deploy",
    "broker-kill-migrate",
    "node-kill",
    "fuzz",
)
ORPHAN_GRACE_S = 3.0
LOST_AFTER_S = 5.0
BROKER_FLAGS = (
    "--heartbeat-interval", "0.5", "--lost-after", str(LOST_AFTER_S),
    "--orphan-grace", str(ORPHAN_GRACE_S),
    # Mobility migrations at once (no cooldown); the old replica waits 1 s for a switch ack
    # that the suite's raw calls never send.
    "--cooldown", "0", "--drain-timeout", "1",
)  # fmt: skip
MODEL = "mlp"
PRIORITIES = (
    pb.PRIORITY_CLASS_BEST_EFFORT,
    pb.PRIORITY_CLASS_STANDARD,
    pb.PRIORITY_CLASS_CRITICAL,
)
NEVER = frozenset({Code.UNKNOWN, Code.INTERNAL})
ANY = frozenset(Code) - NEVER
"""Every status but UNKNOWN and INTERNAL: where nothing more specific is promised."""
FAULTED = frozenset(
    {Code.OK, Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED, Code.FAILED_PRECONDITION, Code.ABORTED}
)
"""What a call may answer while the broker or a node is killed under it."""
CALL_TIMEOUT_S = 10.0
BEACON_FUZZ_PER_FIELD_CALL = 10
"""Random datagrams of each kind the fuzz sends the beacon port per random-field call."""
BEACON_SETTLE_S = 1.0
"""How long after the fuzz's datagrams `/metrics` is read again (the broker reads its beacon
socket every 100 ms)."""
BEACON_SERIES = re.compile(r'^offload_node_beacons_total\{result="([a-z]+)"\} (\S+)$', re.M)
DEPLOY_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 30.0
BOGUS_PAUSE_S = 0.1
MONITOR_PERIOD_S = 0.5
SAMPLES = 5
"""Lines kept per failed invariant and scenario."""
CLIENT_BUG = "Internal error from Core"
"""What grpc.aio's client says, as INTERNAL, when the server refuses a client stream while
it is still sending (grpc/grpc#36066, see docs/OPERATIONS.md): not the server's answer."""
_VARYING = re.compile(r"\d+\.\d+|\b[0-9a-f]*\d[0-9a-f]*\b")
"""Ids and numbers (retry in 1.3s), folded so that one reason of refusal counts once."""
_LOST_LINE = re.compile(rb"node=(\S+) lost")


def storm_source(i: int) -> str:
    """The address the storm's `i`th client calls from (`bench.relay`); the bogus callers and
    everything else call from 127.0.0.1."""
    return f"127.0.0.{10 + i}"


@dataclass(frozen=True, slots=True)
class Mode:
    """How much each scenario tries."""

    name: str
    storm_waves: int
    """Deploy storms: the first with cold keys, the others with warm ones."""
    flood_s: float
    cancelled_rounds: int
    broker_kills: int
    """Per broker-kill scenario."""
    node_kills: int
    fuzz_field_calls: int
    """Per RPC; then a third as many calls of random bytes."""
    settle_s: float
    """How long the cluster gets to agree after a scenario (and its replicas to stop after
    every deployment was deleted)."""
    scenario_s: float
    """The bound on one scenario's own calls and faults."""
    storm_clients: int = 20
    storm_deploys: int = 200
    bogus_callers: int = 60


QUICK = Mode("quick", 1, 8, 2, 3, 3, 9, settle_s=20, scenario_s=90)
FULL = Mode("full", 2, 20, 4, 16, 16, 60, settle_s=45, scenario_s=300)


@dataclass(slots=True)
class Outcome:
    """One scenario's record: what it sent, how it was answered, what did not hold."""

    name: str
    tried: str = ""
    calls: dict[str, Counter[str]] = field(default_factory=dict)
    """Kind of call -> status name -> count."""
    refusals: Counter[str] = field(default_factory=Counter)
    """"kind: STATUS message prefix" -> count, of the calls that were not OK."""
    never: list[str] = field(default_factory=list)
    """UNKNOWN/INTERNAL answers (samples)."""
    unexpected: list[str] = field(default_factory=list)
    """Answers outside what the scenario allows (samples), and the count of them all."""
    unexpected_count: int = 0
    false_lost: list[str] = field(default_factory=list)
    unplaced: list[str] = field(default_factory=list)
    """Storm waves whose running deployments left some of the nodes' GPUs free."""
    problems: Problems = field(default_factory=Problems)
    errors: list[str] = field(default_factory=list)
    """What kept the scenario from running as planned (a daemon that did not come back)."""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def record(
        self, kind: str, code: Code, details: str, allowed: Collection[Code], where: str = ""
    ) -> None:
        """Count an answer under `kind`; keep a sample (naming `where`, default `kind`) when
        it is UNKNOWN/INTERNAL or not `allowed`."""
        self.calls.setdefault(kind, Counter())[code.name] += 1
        if code is not Code.OK:
            self.refusals[f"{kind}: {code.name} {_VARYING.sub('#', details[:70])}"] += 1
        what = f"{where or kind}: {code.name} {details[:240]!r}"
        if code in NEVER:
            if len(self.never) < SAMPLES:
                self.never.append(what)
            return
        bad_message = len(details) > MESSAGE_CHARS or "\x1b" in details or "Traceback" in details
        if code not in allowed or bad_message:
            self.unexpected_count += 1
            if len(self.unexpected) < SAMPLES:
                self.unexpected.append(what + (f" ({len(details)} chars)" if bad_message else ""))

    def failures(self) -> dict[str, int]:
        """Invariant -> how many times it failed; only the failed ones."""
        counts = {
            "UNKNOWN/INTERNAL": sum(c[n.name] for c in self.calls.values() for n in NEVER),
            "unexpected answers": self.unexpected_count,
            "nodes falsely lost": len(self.false_lost),
            "placed below room": len(self.unplaced),
            "leaked replicas": len(self.problems.leaked),
            "double-booked GPUs": len(self.problems.double_booked),
            "deployments lost/duplicated": len(self.problems.lost_or_duplicated),
            "not running or pending": len(self.problems.unsettled),
            "harness errors": len(self.errors) + len(self.problems.unobservable),
        }
        return {name: n for name, n in counts.items() if n}

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tried": self.tried,
            "seconds": round(self.seconds, 1),
            "held": not self.failures(),
            "failures": self.failures(),
            "calls": {kind: dict(codes) for kind, codes in self.calls.items()},
            "refusals": dict(self.refusals.most_common()),
            "unknown_or_internal": self.never,
            "unexpected": self.unexpected,
            "nodes_falsely_lost": self.false_lost,
            "placed_below_room": self.unplaced,
            **{name: lines for name, lines in asdict(self.problems).items()},
            "errors": self.errors,
            "notes": self.notes,
        }


class Chaos:
    """The scenarios, over one running cluster."""

    def __init__(
        self, root: Path, mode: Mode, rng: random.Random, broker_flags: Sequence[str]
    ) -> None:
        """A cluster in `root` (not started yet): the demo's nodes, process runtime."""
        self.mode = mode
        self.rng = rng
        self.clients = {
            f"storm-{i:02d}": new_api_key(f"storm-{i:02d}") for i in range(mode.storm_clients)
        }
        self.cluster = LocalCluster(
            root,
            runtime="process",
            broker_flags=broker_flags,
            client_id="chaos",
            more_api_keys=list(self.clients.values()),
        )
        # Half name real clients with a wrong secret (a full check), half unknown ones.
        self.bogus_keys = [
            f"storm-{i % mode.storm_clients:02d}.{secrets.token_urlsafe(24)}"
            if i % 2
            else f"nobody-{i:02d}.{secrets.token_urlsafe(24)}"
            for i in range(mode.bogus_callers)
        ]
        self.sha = ""
        self.current = Outcome("setup")
        self.acknowledged: set[str] = set()
        self.excused: dict[str, float] = {}
        """node id -> until when (loop time) its daemon may be marked lost: it was killed."""
        self.heartbeat_age_max = 0.0
        self.bogus_wait_max = 0.0
        """Seconds, the slowest answer to a bogus-key call since it was reset."""
        self._log_offset = 0

    # --- the cluster ---------------------------------------------------------------------

    @property
    def ops_headers(self) -> dict[str, str]:
        return self.cluster.ops_headers

    @property
    def join_token(self) -> str:
        return self.cluster.join_token_file.read_text().strip()

    @property
    def all_keys(self) -> list[str]:
        return [self.cluster.api_key, *self.clients.values()]

    def metadata(self, key: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {key}"),)

    def node_ids(self) -> list[str]:
        return [plan.node_id for plan in self.cluster.nodes]

    def site_of(self, node_id: str) -> str:
        return next(plan.site for plan in self.cluster.nodes if plan.node_id == node_id)

    async def ops(self, http: aiohttp.ClientSession, path: str) -> Any:
        """GET an ops API route; None when it does not answer 200."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with http.get(
                f"{self.cluster.ops_url}api/{path}", headers=self.ops_headers
            ) as response:
                if response.status == 200:
                    return await response.json()
        return None

    async def nodes_ready(self, http: aiohttp.ClientSession) -> None:
        """Until the ops API lists every node ready and its heartbeat age has dropped since
        the previous look (a heartbeat arrived: a restarted broker lists its store's nodes,
        with a fresh age, before they reach it again); an error on the scenario if not
        within READY_TIMEOUT_S."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        ages: dict[str, float] = {}
        heard: set[str] = set()
        while time.monotonic() < deadline:
            for n in await self.ops(http, "nodes") or []:
                age = n["last_heartbeat_age_s"]
                if n["state"] != "ready" or age is None:
                    continue
                if age < ages.get(n["node_id"], -1.0):
                    heard.add(n["node_id"])
                ages[n["node_id"]] = age
            if heard >= set(self.node_ids()):
                return
            await asyncio.sleep(0.1)
        self.current.errors.append(
            f"nodes not all heartbeating {READY_TIMEOUT_S:.0f}s after a restart"
        )

    async def restart_broker(self, http: aiohttp.ClientSession, *, kill: bool) -> None:
        """SIGKILL (or SIGTERM) the broker, start it again on the same state dir."""
        if kill:
            await self.cluster.kill("broker")
        else:
            process = self.cluster.processes["broker"]
            process.terminate()
            await asyncio.to_thread(process.wait)
        await self.cluster.start_broker()
        await self.nodes_ready(http)

    async def monitor(self, http: aiohttp.ClientSession) -> None:
        """Forever: each lost mark of a running daemon's node in the broker's log, and each
        node listed lost by `/api/nodes` while its daemon runs, is a false loss."""
        log = self.cluster.log("broker")
        while True:
            await asyncio.sleep(MONITOR_PERIOD_S)
            now = asyncio.get_running_loop().time()
            excused = {n for n, until in self.excused.items() if until > now}
            data = await asyncio.to_thread(_read_from, log, self._log_offset)
            # Whole lines only: a line half written now is read whole next time.
            data = data[: data.rfind(b"\n") + 1]
            self._log_offset += len(data)
            for match in _LOST_LINE.finditer(data):
                node_id = match.group(1).decode(errors="replace")
                if node_id in self.node_ids() and node_id not in excused:
                    self.current.false_lost.append(f"{node_id} (broker log: {match.group(0)!r})")
            for node in await self.ops(http, "nodes") or []:
                node_id = node["node_id"]
                if node_id not in self.node_ids() or node_id in excused:
                    continue
                if node["state"] == "lost" and not any(
                    line.startswith(f"{node_id} ") for line in self.current.false_lost
                ):
                    self.current.false_lost.append(f"{node_id} (/api/nodes lists it lost)")
                age = node.get("last_heartbeat_age_s")
                if isinstance(age, int | float) and math.isfinite(age):
                    self.heartbeat_age_max = max(self.heartbeat_age_max, age)

    # --- calls ---------------------------------------------------------------------------

    async def call(
        self, kind: str, call: Callable[[], Awaitable[T]], allowed: Collection[Code]
    ) -> T | None:
        """Make one call, record its status; its reply, or None when it failed."""
        try:
            reply = await call()
        except grpc.aio.AioRpcError as err:
            self.current.record(kind, err.code(), err.details() or "", allowed)
            return None
        self.current.record(kind, Code.OK, "", allowed)
        return reply

    def deploy_request(
        self, *, site: str = "", gpus: int = 0, priority: int = 0
    ) -> pb.DeployRequest:
        return pb.DeployRequest(
            model_sha256=self.sha,
            model_name=MODEL,
            gpus=gpus or self.rng.choice((1, 1, 2, 4)),
            priority=priority or self.rng.choice(PRIORITIES),  # type: ignore[arg-type]
            site=site or self.rng.choice([plan.site for plan in self.cluster.nodes]),
        )

    async def deploy(
        self,
        kind: str,
        channel: grpc.aio.Channel,
        key: str,
        request: pb.DeployRequest,
        allowed: Collection[Code],
        timeout_s: float = DEPLOY_TIMEOUT_S,
    ) -> pb.Deployment | None:
        stub = pb_grpc.EdgeBrokerStub(channel)
        reply = await self.call(
            kind,
            lambda: stub.Deploy(request, metadata=self.metadata(key), timeout=timeout_s),
            allowed,
        )
        if reply is not None:
            self.acknowledged.add(reply.deployment_id)
        return reply

    async def bogus_caller(self, key: str, stop: asyncio.Event) -> None:
        async with grpc.aio.insecure_channel(self.cluster.broker_address) as channel:
            stub = pb_grpc.EdgeBrokerStub(channel)
            while not stop.is_set():
                started = time.monotonic()
                await self.call(
                    "bogus key",
                    lambda: stub.ListDeployments(
                        pb.ListDeploymentsRequest(),
                        metadata=self.metadata(key),
                        timeout=CALL_TIMEOUT_S,
                    ),
                    {Code.UNAUTHENTICATED, Code.RESOURCE_EXHAUSTED},
                )
                self.bogus_wait_max = max(self.bogus_wait_max, time.monotonic() - started)
                await asyncio.sleep(BOGUS_PAUSE_S)

    @contextlib.asynccontextmanager
    async def bogus_flood(self) -> Any:
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(self.bogus_caller(key, stop), name=f"bogus-{i}")
            for i, key in enumerate(self.bogus_keys)
        ]
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(*tasks)

    # --- set-up and clean-up ---------------------------------------------------------------

    async def upload_models(self) -> None:
        """Every client uploads the model (a client deploys only what it uploaded)."""
        path = await asyncio.to_thread(modelzoo.model_path, MODEL)
        for key in self.all_keys:
            async with OffloadClient(self.cluster.broker_address, key) as client:
                self.sha = await client.upload_model(path)

    async def delete_everything(self, http: aiohttp.ClientSession) -> None:
        """Delete every deployment, wait for the replicas to go; a replica process still
        running after that is leaked: recorded, then killed so the next scenario starts
        clean."""
        keys = {"chaos": self.cluster.api_key, **self.clients}
        deadline = time.monotonic() + self.mode.settle_s
        left: list[Stored] = []
        async with grpc.aio.insecure_channel(self.cluster.broker_address) as channel:
            stub = pb_grpc.EdgeBrokerStub(channel)
            while time.monotonic() < deadline:
                with contextlib.suppress(Unobservable):
                    left = await stored_deployments(http, self.cluster, self.ops_headers)
                    if not left:
                        break
                    for d in left:
                        if d.client_id not in keys or d.state == "deleting":
                            continue
                        with contextlib.suppress(grpc.aio.AioRpcError):
                            await stub.DeleteDeployment(
                                pb.DeleteDeploymentRequest(deployment_id=d.deployment_id),
                                metadata=self.metadata(keys[d.client_id]),
                                timeout=CALL_TIMEOUT_S,
                            )
                await asyncio.sleep(0.5)
        if left:
            self.current.errors.append(
                f"{len(left)} deployment(s) still listed {self.mode.settle_s:.0f}s after "
                f"deleting them: " + ", ".join(f"{d.deployment_id} {d.state}" for d in left[:5])
            )
        self.acknowledged.clear()
        deadline = time.monotonic() + self.mode.settle_s
        while time.monotonic() < deadline:
            if not await asyncio.to_thread(replica_processes, self.cluster.root):
                return
            await asyncio.sleep(0.5)
        for p in await asyncio.to_thread(replica_processes, self.cluster.root):
            self.current.problems.leaked.append(
                f"pid {p.pid} (replica {p.replica_id} of {p.node_id}) still runs "
                f"{self.mode.settle_s:.0f}s after every deployment was deleted; killed"
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)

    async def warm_keys(self) -> None:
        """Have the broker verify every client's key, retrying while it throttles this
        address (its per-address budget of failed checks, spent by the bogus keys); an error
        on the scenario when a key is still refused after READY_TIMEOUT_S."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with grpc.aio.insecure_channel(self.cluster.broker_address) as channel:
            stub = pb_grpc.EdgeBrokerStub(channel)
            for key in self.all_keys:
                while True:
                    try:
                        await stub.ListDeployments(
                            pb.ListDeploymentsRequest(),
                            metadata=self.metadata(key),
                            timeout=CALL_TIMEOUT_S,
                        )
                        break
                    except grpc.aio.AioRpcError as err:
                        if time.monotonic() > deadline:
                            self.current.errors.append(
                                f"a client's key still refused: {err.code().name} "
                                f"{(err.details() or '')[:120]}"
                            )
                            return
                        await asyncio.sleep(1.0)

    async def revive(self, http: aiohttp.ClientSession) -> None:
        """Start again whatever died by itself (an error on the scenario)."""
        for name, process in list(self.cluster.processes.items()):
            if process.poll() is None:
                continue
            self.current.errors.append(f"{name} exited by itself (code {process.returncode})")
            if name == "broker":
                await self.cluster.start_broker()
            else:
                await self.cluster.start_node(
                    next(p for p in self.cluster.nodes if p.node_id == name)
                )
        await self.nodes_ready(http)

    # --- scenarios -----------------------------------------------------------------------

    async def deploy_storm(self, http: aiohttp.ClientSession) -> None:
        per_client = self.mode.storm_deploys // self.mode.storm_clients
        room = await self.room(http)
        self.current.tried = (
            f"{self.mode.storm_deploys} concurrent Deploys from {self.mode.storm_clients} "
            f"clients, each from an address of its own ({storm_source(0)} to "
            f"{storm_source(self.mode.storm_clients - 1)}), first wave with "
            f"keys never verified, x{self.mode.storm_waves} wave(s), "
            f"{self.mode.bogus_callers} bogus-key callers from 127.0.0.1 meanwhile; "
            f"the nodes have {room} GPUs"
        )
        host, _, port = self.cluster.broker_address.rpartition(":")
        for wave in range(self.mode.storm_waves):
            kind = "Deploy (cold keys)" if wave == 0 else "Deploy (warm keys)"
            if wave:
                await self.delete_everything(http)
                await self.warm_keys()
            async with contextlib.AsyncExitStack() as stack:
                # One address per client, as devices have: the broker's throttle of failed
                # key checks is per address, and the bogus callers all share 127.0.0.1.
                channels = []
                for i in range(len(self.clients)):
                    relay = await stack.enter_async_context(
                        SourceRelay(host, int(port), storm_source(i))
                    )
                    channels.append(
                        await stack.enter_async_context(grpc.aio.insecure_channel(relay.address))
                    )
                self.bogus_wait_max = 0.0
                await stack.enter_async_context(self.bogus_flood())
                await asyncio.gather(
                    *(
                        self.deploy(
                            kind,
                            channel,
                            key,
                            self.deploy_request(),
                            {Code.OK, Code.RESOURCE_EXHAUSTED},
                        )
                        for channel, key in zip(channels, self.clients.values(), strict=True)
                        for _ in range(per_client)
                    )
                )
            self.current.notes.append(
                f"{kind}: the slowest bogus-key call took {self.bogus_wait_max:.1f}s "
                f"(deadline {CALL_TIMEOUT_S:g}s)"
            )
            self.count_key_refusals(kind)
            await self.check_filled(http, room, kind)

    async def room(self, http: aiohttp.ClientSession) -> int:
        """How many whole GPUs the cluster's nodes have (the storm asks for whole GPUs, no
        memory shares); a harness error when the ops API does not list them all free."""
        nodes = [n for n in await self.ops(http, "nodes") or [] if n["node_id"] in self.node_ids()]
        gpus = [g for n in nodes for g in n["gpus"]]
        if len(nodes) != len(self.node_ids()) or not all(g["free"] for g in gpus):
            self.current.errors.append(
                f"before the storm: {len(nodes)} of {len(self.node_ids())} nodes listed, "
                f"{sum(not g['free'] for g in gpus)} of {len(gpus)} GPUs held"
            )
        return len(gpus)

    def count_key_refusals(self, kind: str) -> None:
        """A storm client's valid key refused by the broker's key-check bounds is an
        unexpected answer (RESOURCE_EXHAUSTED is allowed for want of room only): no bogus key
        spends a storm client's address, and its 20 keys stay below the bound on keys
        waiting for a check."""
        for reason, n in self.current.refusals.items():
            if reason.startswith(f"{kind}: ") and "API key" in reason:
                self.current.unexpected_count += n
                if len(self.current.unexpected) < SAMPLES:
                    self.current.unexpected.append(f"{n} x {reason}")

    async def check_filled(self, http: aiohttp.ClientSession, room: int, kind: str) -> None:
        """Wait (up to the settle bound) until running deployments hold every one of the
        nodes' `room` GPUs, then note how many were placed; a failure when they hold fewer.
        The storm asks for about ten times the room, half of it one GPU at a time, so a GPU
        left free is one a refused or pending Deploy could have had."""
        deadline = time.monotonic() + self.mode.settle_s
        while True:
            listed = await self.ops(http, "deployments") or []
            running = [d for d in listed if d["state"] == "running"]
            held = sum(len(d["gpus"]) for d in running)
            if held >= room or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        states = Counter(d["state"] for d in listed)
        placed = (
            f"{kind}: {len(running)} deployments placed, holding {held} of the nodes' "
            f"{room} GPUs; " + ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        )
        self.current.notes.append(placed)
        if held < room:
            self.current.unplaced.append(placed)

    async def bogus_flood_alone(self, http: aiohttp.ClientSession) -> None:
        self.current.tried = (
            f"{self.mode.bogus_callers} bogus-key callers for {self.mode.flood_s:.0f}s; a "
            "valid client's ListDeployments every 0.2s timed meanwhile"
        )
        self.heartbeat_age_max = 0.0
        latencies: list[float] = []
        async with (
            grpc.aio.insecure_channel(self.cluster.broker_address) as channel,
            self.bogus_flood(),
        ):
            stub = pb_grpc.EdgeBrokerStub(channel)
            end = time.monotonic() + self.mode.flood_s
            while time.monotonic() < end:
                started = time.monotonic()
                await self.call(
                    "ListDeployments (valid key)",
                    lambda: stub.ListDeployments(
                        pb.ListDeploymentsRequest(),
                        metadata=self.metadata(self.cluster.api_key),
                        timeout=CALL_TIMEOUT_S,
                    ),
                    {Code.OK},
                )
                latencies.append(time.monotonic() - started)
                await asyncio.sleep(0.2)
        self.current.notes.append(
            f"valid calls: max {max(latencies):.2f}s; nodes' heartbeat age: max "
            f"{self.heartbeat_age_max:.1f}s (lost after {LOST_AFTER_S:g}s)"
        )

    async def cancelled_deploys(self, http: aiohttp.ClientSession) -> None:
        first = self.cluster.nodes[0]
        nodes = await self.ops(http, "nodes") or []
        gpus = next((len(n["gpus"]) for n in nodes if n["node_id"] == first.node_id), 4)
        site = first.site
        self.current.tried = (
            f"{self.mode.cancelled_rounds} round(s): {gpus} concurrent Deploys at {site} "
            f"with a 0.3-0.5s deadline, then {gpus} normal ones there, each of its own client"
        )
        # One client per Deploy: a per-client quota must not be what refuses them.
        keys = itertools.cycle(self.clients.values())
        standard = pb.PRIORITY_CLASS_STANDARD
        async with grpc.aio.insecure_channel(self.cluster.broker_address) as channel:
            for round_ in range(self.mode.cancelled_rounds):
                if round_:  # the cancelled starts may well have finished: free their GPUs
                    await self.delete_everything(http)
                await asyncio.gather(
                    *(
                        self.deploy(
                            "Deploy (deadline 0.3-0.5s)",
                            channel,
                            next(keys),
                            self.deploy_request(site=site, gpus=1, priority=standard),
                            {Code.DEADLINE_EXCEEDED, Code.OK, Code.RESOURCE_EXHAUSTED},
                            timeout_s=self.rng.uniform(0.3, 0.5),
                        )
                        for _ in range(gpus)
                    )
                )
                for _ in range(gpus):
                    await self.deploy(
                        "Deploy (after the cancelled ones)",
                        channel,
                        next(keys),
                        self.deploy_request(site=site, gpus=1, priority=standard),
                        {Code.OK, Code.RESOURCE_EXHAUSTED},
                    )
        cancelled = self.current.calls.get("Deploy (deadline 0.3-0.5s)", Counter())
        if not cancelled[Code.DEADLINE_EXCEEDED.name]:
            self.current.notes.append("no Deploy was cancelled: each was answered in time")

    async def broker_kill_deploy(self, http: aiohttp.ClientSession) -> None:
        self.current.tried = (
            f"{self.mode.broker_kills} round(s): 2 concurrent Deploys, SIGKILL of the broker "
            "0-3s in, restart on the same state dir"
        )
        for _ in range(self.mode.broker_kills):
            async with grpc.aio.insecure_channel(self.cluster.broker_address) as channel:
                key = self.rng.choice(list(self.clients.values()))
                calls = [
                    asyncio.create_task(
                        self.deploy(
                            "Deploy (broker killed)",
                            channel,
                            key,
                            self.deploy_request(gpus=1),
                            FAULTED,
                        )
                    )
                    for _ in range(2)
                ]
                await self.kill_broker_within(3.0, http, calls)
                await asyncio.gather(*calls)

    async def kill_broker_within(
        self,
        seconds: float,
        http: aiohttp.ClientSession,
        calls: Sequence[asyncio.Task[Any]],
        *,
        migrations: bool = False,
    ) -> None:
        """SIGKILL the broker 0-`seconds` in and restart it; the note says when, and what was
        under way just before (`calls` not ended, migrations without an outcome): whether
        the kill landed mid-operation."""
        at = self.rng.uniform(0, seconds)
        await asyncio.sleep(at)
        under_way = await self.under_way(http, calls, migrations=migrations)
        await self.restart_broker(http, kill=True)
        self.current.notes.append(f"broker killed {at:.2f}s in, {under_way}")

    async def under_way(
        self,
        http: aiohttp.ClientSession,
        calls: Sequence[asyncio.Task[Any]],
        *,
        migrations: bool,
    ) -> str:
        """In words: how many of `calls` have not ended, and (with `migrations`) how many
        migrations have no outcome yet: a migration goes on after the call that began it."""
        said = f"{sum(not c.done() for c in calls)} of {len(calls)} call(s) in flight"
        if migrations:
            listed = await self.ops(http, "migrations")
            count = "?" if listed is None else sum(not m["outcome"] for m in listed)
            said += f", {count} migration(s) under way"
        return said

    async def placed(self, kind: str, count: int, site: str) -> list[tuple[str, pb.Deployment]]:
        """`count` deployments at `site` (one GPU, standard priority), each of its own
        client: (the client's key, the deployment) of those that were placed."""
        out = []
        async with grpc.aio.insecure_channel(self.cluster.broker_address) as channel:
            for key in list(self.clients.values())[:count]:
                request = self.deploy_request(
                    site=site, gpus=1, priority=pb.PRIORITY_CLASS_STANDARD
                )
                reply = await self.deploy(kind, channel, key, request, {Code.OK})
                if reply is not None:
                    out.append((key, reply))
        return out

    async def migrate(self, kind: str, key: str, deployment_id: str, to_node: str) -> None:
        """A make-before-break migration to `to_node`: half the time an operator's Migrate,
        else the client reporting it is at `to_node`'s site (a mobility migration)."""
        async with grpc.aio.insecure_channel(self.cluster.broker_address) as channel:
            if self.rng.random() < 0.5:
                operator = pb_grpc.OperatorStub(channel)
                request = pb.MigrateRequest(
                    deployment_id=deployment_id, to_node=to_node, strategy="make_before_break"
                )
                await self.call(
                    f"Operator.Migrate ({kind})",
                    lambda: operator.Migrate(
                        request, metadata=self.metadata(self.join_token), timeout=30
                    ),
                    FAULTED,
                )
            else:
                stub = pb_grpc.EdgeBrokerStub(channel)
                location = pb.ReportLocationRequest(site=self.site_of(to_node))
                await self.call(
                    f"ReportLocation ({kind})",
                    lambda: stub.ReportLocation(location, metadata=self.metadata(key), timeout=30),
                    FAULTED,
                )

    async def where(self, key: str, deployment_id: str) -> str:
        """The deployment's node now; "" when it has none or the broker does not answer."""
        async with grpc.aio.insecure_channel(self.cluster.broker_address) as channel:
            with contextlib.suppress(grpc.aio.AioRpcError):
                d = await pb_grpc.EdgeBrokerStub(channel).GetDeployment(
                    pb.GetDeploymentRequest(deployment_id=deployment_id),
                    metadata=self.metadata(key),
                    timeout=CALL_TIMEOUT_S,
                )
                return d.node_id
        return ""

    async def broker_kill_migrate(self, http: aiohttp.ClientSession) -> None:
        self.current.tried = (
            f"2 deployments; {self.mode.broker_kills} round(s): a make-before-break migration "
            "(Operator.Migrate or ReportLocation), SIGKILL of the broker 0-3s in, restart"
        )
        deployments = await self.placed("Deploy (set-up)", 2, self.cluster.nodes[0].site)
        for round_ in range(self.mode.broker_kills if deployments else 0):
            key, d = deployments[round_ % len(deployments)]
            source = await self.where(key, d.deployment_id)
            target = self.rng.choice([n for n in self.node_ids() if n != source])
            moving = asyncio.create_task(
                self.migrate("broker killed", key, d.deployment_id, target)
            )
            await self.kill_broker_within(3.0, http, [moving], migrations=True)
            await moving

    async def node_kill(self, http: aiohttp.ClientSession) -> None:
        self.current.tried = (
            f"2 deployments; {self.mode.node_kills} round(s): a Deploy at a node's site or a "
            "migration to it, SIGKILL of that node's daemon 0-3s in, restart 0-1.5s later"
        )
        deployments = await self.placed("Deploy (set-up)", 2, self.cluster.nodes[0].site)
        loop = asyncio.get_running_loop()
        for round_ in range(self.mode.node_kills):
            plan = self.rng.choice(self.cluster.nodes)
            migrating = bool(deployments and round_ % 2)
            if migrating:
                key, d = deployments[round_ % len(deployments)]
                if await self.where(key, d.deployment_id) == plan.node_id:
                    plan = next(p for p in self.cluster.nodes if p is not plan)
                action = self.migrate("node killed", key, d.deployment_id, plan.node_id)
            else:
                action = self._deploy_at(plan.site)
            task = asyncio.create_task(action)
            at = self.rng.uniform(0, 3.0)
            await asyncio.sleep(at)
            self.excused[plan.node_id] = math.inf
            under_way = await self.under_way(http, [task], migrations=migrating)
            await self.cluster.kill(plan.node_id)
            down = self.rng.uniform(0, 1.5)
            await asyncio.sleep(down)
            try:
                await self.cluster.start_node(plan)
            finally:
                # A lost mark may still land a heartbeat or two after the re-registration.
                self.excused[plan.node_id] = loop.time() + 2.0
            self.current.notes.append(
                f"{plan.node_id} killed {at:.2f}s in, {under_way}, down {down:.2f}s"
            )
            await task

    async def _deploy_at(self, site: str) -> None:
        async with grpc.aio.insecure_channel(self.cluster.broker_address) as channel:
            await self.deploy(
                "Deploy (node killed)",
                channel,
                self.rng.choice(list(self.clients.values())),
                self.deploy_request(site=site, gpus=1),
                FAULTED,
            )

    async def fuzz(self, http: aiohttp.ClientSession) -> None:
        field_calls = self.mode.fuzz_field_calls
        byte_calls = max(1, field_calls // 3)
        self.current.tried = (
            f"every RPC of the broker, node-a and a replica: {field_calls} calls with random "
            f"fields (a third with a string that is not UTF-8) and {byte_calls} with random "
            "bytes each"
        )
        placed = await self.placed("Deploy (set-up)", 1, self.cluster.nodes[0].site)
        if not placed:
            self.current.errors.append("no deployment to fuzz a replica of")
            return
        key, d = placed[0]
        known = Known(
            {
                "deployment_id": (d.deployment_id, "d-0123456789"),
                "migration_id": ("m-0123456789",),
                "sha256": (self.sha, "0" * 64),
                "model_sha256": (self.sha, "0" * 64),
                "model_name": (MODEL,),
                "name": (MODEL,),
                "site": ("site-a", "mars"),
                "client_id": ("storm-00", "nobody"),
                # No real node id and no reachable address: an accepted Register or
                # Heartbeat would take over a node of the cluster.
                "node_id": ("node-zz",),
                "to_node": ("node-zz", *self.node_ids()),
                "address": ("127.0.0.1:99999", "127.0.0.1:1"),
                "strategy": ("make_before_break", "stop_start"),
            }
        )
        broker, node_a = self.cluster.broker_address, node_address(self.cluster, "node-a")
        # The replica first, the broker's client API last: its DeleteDeployment and
        # Migrate calls may move or delete the deployment (so it is no longer owed).
        targets = [
            (ipb.DESCRIPTOR.services_by_name["GRPCInferenceService"], d.endpoint, d.token),
            # What the broker shows a NodeAgent: the node's own secret (the join token opens
            # none any more, issue 50).
            (
                npb.DESCRIPTOR.services_by_name["NodeAgent"],
                node_a,
                self.cluster.node_secret("node-a"),
            ),
            (
                pb.DESCRIPTOR.services_by_name["NodeRegistry"],
                self.cluster.registry_address,
                self.join_token,
            ),
            (pb.DESCRIPTOR.services_by_name["Operator"], broker, self.join_token),
            (pb.DESCRIPTOR.services_by_name["EdgeBroker"], broker, key),
        ]
        self.acknowledged.discard(d.deployment_id)
        options = [("grpc.max_send_message_length", 8 * 1024 * 1024)]
        for service, address, secret in targets:
            # DeleteDeployment last: it may delete the deployment the others reach for.
            methods = sorted(service.methods, key=lambda m: m.name == "DeleteDeployment")
            async with grpc.aio.insecure_channel(address, options=options) as channel:
                for method in methods:
                    rng = random.Random(f"{self.rng.random()}{method.full_name}")
                    for messages in random_requests(method, rng, known, field_calls, byte_calls):
                        code, details = await call_raw(
                            channel, method, messages, self.metadata(secret), CALL_TIMEOUT_S
                        )
                        if code is Code.INTERNAL and details == CLIENT_BUG:
                            # The server answered; the client library lost its status.
                            counts = self.current.calls.setdefault(service.name, Counter())
                            counts["INTERNAL in the client (grpc/grpc#36066)"] += 1
                            continue
                        self.current.record(service.name, code, details, ANY, method.full_name)
            # A credential the service stopped accepting would leave it fuzzed at the door.
            answered = self.current.calls.get(service.name, Counter())
            refused = answered[Code.UNAUTHENTICATED.name] + answered[Code.PERMISSION_DENIED.name]
            if refused == answered.total():
                self.current.errors.append(
                    f"every {service.name} call was refused UNAUTHENTICATED or PERMISSION_DENIED:"
                    " the fuzz reached none of its handlers (the credential the suite shows it "
                    "no longer opens it)"
                )
        await self.fuzz_beacons(http)
        if await self.ops(http, "migrations") is None:
            self.current.errors.append("/api/migrations does not answer 200 after the fuzz")

    async def fuzz_beacons(self, http: aiohttp.ClientSession) -> None:
        """Random datagrams at the node port's number on UDP, where the broker takes the
        nodes' beacons (`broker.beacons`): random bytes of random lengths, and beacon-shaped
        ones (the version byte, then a random id, counter and MAC). None may be taken; each
        must be counted dropped in `/metrics` (`offload_node_beacons_total`), while the
        nodes' own beacons go on being taken."""
        rng = random.Random(f"{self.rng.random()}beacons")
        count = BEACON_FUZZ_PER_FIELD_CALL * self.mode.fuzz_field_calls
        datagrams = [rng.randbytes(rng.randrange(0, 80)) for _ in range(count)]
        datagrams += [
            bytes([BEACON_VERSION]) + rng.randbytes(BEACON_BYTES - 1) for _ in range(count)
        ]
        before = await self.beacon_counts(http)
        host, _, port = self.cluster.registry_address.rpartition(":")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            for datagram in datagrams:
                sender.sendto(datagram, (host, int(port)))
        await asyncio.sleep(BEACON_SETTLE_S)
        after = await self.beacon_counts(http)
        if before is None or after is None:
            self.current.errors.append("/metrics does not answer 200 around the beacon fuzz")
            return
        moved = {result: after.get(result, 0) - before.get(result, 0) for result in after}
        counts = self.current.calls.setdefault("NodeBeacons (UDP)", Counter())
        for result, delta in sorted(moved.items()):
            if delta and result != "taken":
                counts[result] += int(delta)
        dropped = sum(d for r, d in moved.items() if r != "taken")
        if dropped != len(datagrams):
            self.current.errors.append(
                f"{len(datagrams)} random datagrams sent to the beacon port, {dropped:g} "
                "counted dropped"
            )
        if moved.get("taken", 0) <= 0:
            self.current.errors.append("no node beacon was taken while the beacon port was fuzzed")

    async def beacon_counts(self, http: aiohttp.ClientSession) -> dict[str, float] | None:
        """`offload_node_beacons_total` by result, from `/metrics`; None when it does not
        answer 200."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.get(
                f"{self.cluster.ops_url}metrics", headers=self.ops_headers
            ) as response:
                if response.status == 200:
                    return {
                        m[1]: float(m[2]) for m in BEACON_SERIES.finditer(await response.text())
                    }
        return None

    def runs(self) -> dict[str, Callable[[aiohttp.ClientSession], Awaitable[None]]]:
        return {
            "deploy-storm": self.deploy_storm,
            "bogus-flood": self.bogus_flood_alone,
            "cancelled-deploys": self.cancelled_deploys,
            "broker-kill-deploy": self.broker_kill_deploy,
            "broker-kill-migrate": self.broker_kill_migrate,
            "node-kill": self.node_kill,
            "fuzz": self.fuzz,
        }

    async def scenario(self, name: str, http: aiohttp.ClientSession) -> Outcome:
        """Run one scenario, let the cluster settle, check, clean up."""
        self.current = outcome = Outcome(name)
        started = time.monotonic()
        try:
            if name != "deploy-storm":  # the storm's first wave wants cold keys
                await self.warm_keys()
            await asyncio.wait_for(self.runs()[name](http), timeout=self.mode.scenario_s)
        except (TimeoutError, ClusterError) as err:
            outcome.errors.append(f"{type(err).__name__}: {str(err)[:300]}")
        except Exception as err:  # a bug of the suite: say so, and go on with the others
            traceback.print_exc()
            outcome.errors.append(f"the suite failed: {type(err).__name__}: {str(err)[:300]}")
        await self.revive(http)
        found = await settle(
            http,
            self.cluster,
            self.ops_headers,
            self.join_token,
            self.mode.settle_s,
            self.acknowledged,
        )
        for name_, lines in asdict(found).items():
            getattr(outcome.problems, name_).extend(lines)
        await self.delete_everything(http)
        outcome.seconds = time.monotonic() - started
        return outcome


def _read_from(path: Path, offset: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read()


@dataclass(slots=True)
class Run:
    """The whole run, filled in as it goes (so that a failed run still reports)."""

    mode: Mode
    seed: int
    root: Path
    outcomes: list[Outcome] = field(default_factory=list)
    logs: Path | None = None
    """Where the cluster's logs were kept (a run that did not hold)."""
    seconds: float = 0.0

    @property
    def held(self) -> bool:
        return bool(self.outcomes) and not any(o.failures() for o in self.outcomes)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode.name,
            "seed": self.seed,
            "seconds": round(self.seconds, 1),
            "cluster_folder": str(self.root),
            "logs": str(self.logs) if self.logs else None,
            "broker_flags": list(BROKER_FLAGS),
            "held": self.held,
            "scenarios": [o.to_json() for o in self.outcomes],
        }


async def run(report: Run, names: Sequence[str], say: Callable[[str], None]) -> None:
    """Start the cluster, run the scenarios `names` in order, stop everything (whatever ends
    the run) and remove the cluster's folder; the outcomes go to `report` as they come."""
    started = time.monotonic()
    report.root.mkdir(parents=True)
    chaos = Chaos(report.root, report.mode, random.Random(report.seed), BROKER_FLAGS)
    setup = chaos.current
    cancelled = False
    try:
        await chaos.cluster.start(say)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            monitor = asyncio.create_task(chaos.monitor(http), name="chaos-monitor")
            try:
                if set(names) - {"bogus-flood"}:
                    say(f"{len(chaos.all_keys)} clients upload {MODEL}")
                    await chaos.upload_models()
                if "deploy-storm" in names:
                    say("broker restarted: no client key is verified now")
                    await chaos.restart_broker(http, kill=False)
                if setup.errors or setup.false_lost:
                    report.outcomes.append(setup)
                for name in names:
                    say(f"scenario {name}")
                    outcome = await chaos.scenario(name, http)
                    report.outcomes.append(outcome)
                    failed = outcome.failures()
                    say(
                        f"scenario {name}: {outcome.seconds:.0f}s, "
                        + ("held" if not failed else f"FAILED {failed}")
                    )
            finally:
                monitor.cancel()
                await asyncio.gather(monitor, return_exceptions=True)
    except asyncio.CancelledError:
        cancelled = True  # stopped by the user: nothing to investigate
        raise
    finally:
        teardown = Outcome("teardown", tried="stop the nodes and the broker (SIGTERM), sweep")
        for leftover in await chaos.cluster.stop():
            teardown.problems.leaked.append(f"the sweep had to kill {leftover}")
        if teardown.failures():
            report.outcomes.append(teardown)
        if not report.held and not cancelled:
            report.logs = await asyncio.to_thread(keep_logs, report.root, "offload-chaos-logs-")
        await asyncio.to_thread(shutil.rmtree, report.root, True)
        report.seconds = time.monotonic() - started


COLUMNS = (
    ("UNKNOWN/INTERNAL", "unk/int"),
    ("unexpected answers", "unexpected"),
    ("nodes falsely lost", "lost nodes"),
    ("placed below room", "unplaced"),
    ("leaked replicas", "leaked"),
    ("double-booked GPUs", "double GPU"),
    ("deployments lost/duplicated", "lost/dup"),
    ("not running or pending", "unsettled"),
    ("harness errors", "errors"),
)


def print_report(report: Run) -> None:
    """The table of what was tried and what held, then the details of what did not."""
    header = f"{'scenario':<20} {'secs':>5} {'calls':>6} " + " ".join(
        f"{short:>10}" for _, short in COLUMNS
    )
    print(f"\n{header}  held")
    for o in report.outcomes:
        failed = o.failures()
        calls = sum(sum(c.values()) for c in o.calls.values())
        cells = " ".join(f"{failed.get(name, 0):>10}" for name, _ in COLUMNS)
        print(
            f"{o.name:<20} {o.seconds:>5.0f} {calls:>6} {cells}  {'yes' if not failed else 'NO'}"
        )
    print("\nwhat each scenario tried, and the answers by gRPC status:")
    for o in report.outcomes:
        print(f"  {o.name}: {o.tried}")
        for kind, codes in o.calls.items():
            by_status = ", ".join(f"{code} {n}" for code, n in codes.most_common())
            print(f"    {kind}: {by_status}")
        for reason, n in o.refusals.most_common(4):
            print(f"    {n:>5} x {reason}")
        for note in o.notes:
            print(f"    note: {note}")
    details = [
        (o.name, label, lines)
        for o in report.outcomes
        for label, lines in (
            ("UNKNOWN/INTERNAL", o.never),
            ("unexpected answer", o.unexpected),
            ("node falsely lost", o.false_lost),
            ("placed below room", o.unplaced),
            ("leaked replica", o.problems.leaked),
            ("double-booked GPU", o.problems.double_booked),
            ("deployment lost/duplicated", o.problems.lost_or_duplicated),
            ("not running or pending", o.problems.unsettled),
            ("harness error", [*o.errors, *o.problems.unobservable]),
        )
        if lines
    ]
    if details:
        print(f"\nwhat did not hold (at most {SAMPLES} lines each):")
    for name, label, lines in details:
        for line in lines[:SAMPLES]:
            print(f"  {name}: {label}: {line}")
        if len(lines) > SAMPLES:
            print(f"  {name}: {label}: ... {len(lines) - SAMPLES} more")
    failing = [o for o in report.outcomes if o.failures()]
    if report.logs:
        print(f"\nthe logs of the broker and the nodes are kept in {report.logs}")
    print(
        f"\nchaos ({report.mode.name} mode, seed {report.seed}, {report.seconds:.0f}s): "
        f"{len(report.outcomes) - len(failing)} of {len(report.outcomes)} held"
        + "".join(
            f"; {o.name} failed: " + ", ".join(f"{k} {v}" for k, v in o.failures().items())
            for o in failing
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="short mode (CI, `make chaos`)")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=SCENARIOS,
        default=list(SCENARIOS),
        metavar="NAME",
        help=f"run only these, in this order ({', '.join(SCENARIOS)})",
    )
    parser.add_argument("--json", type=Path, help="write the results to this file")
    parser.add_argument("--seed", type=int, help="for the random choices (default: random)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    root = Path(tempfile.mkdtemp(prefix="offload-chaos-")) / "cluster"
    report = Run(QUICK if args.quick else FULL, seed, root)
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True)

    async def whole() -> int:
        await run(report, args.scenarios, say)
        return 0

    async def guarded() -> int:
        task = asyncio.create_task(whole())
        install_stop_signals(task, say)
        try:
            return await task
        except asyncio.CancelledError:
            return 130

    try:
        code = asyncio.run(guarded())
    except ClusterError as err:
        print(f"chaos: the cluster did not come up: {err}", file=sys.stderr)
        code = 1
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    if code == 130:
        return code
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=2))
    return 0 if report.held and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
