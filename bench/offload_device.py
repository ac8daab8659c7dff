"""The emulated device of `bench.offload`: runs inside a CPU-limited container of the runtime
image (a CFS quota of N CPUs, `bench.offload.cpu_limit`), so its local inference gets only
that much CPU.

Contenders, all open at once in this one process:

  - ``ort-default``: what a device user runs without us, a plain
    `onnxruntime.InferenceSession(path)` with no session options (ONNX Runtime's default
    intra-op threads, one per core it sees, and its default thread spinning), timed around
    `session.run` called directly;
  - ``local``: an `OffloadClient` with policy ``local`` (our local path: `edge_client.local`,
    `--threads` intra-op threads, no spinning);
  - ``remote``: an `OffloadClient` with policy ``remote`` and no local model;
  - ``fastest/lan``, ``fastest/slow``: one `OffloadClient` with policy ``fastest`` per link,
    each keeping its state from one of its turns to the next.

The plan's units (`bench.offload.plan`) are run in rounds, the order rotated by one each
round. A unit runs under one link's conditions, and its members take turns, one request
each, in an order that changes from turn to turn (`turn`), so that machine noise falls on
the contenders that are compared alike. Before each unit the link's conditions are set
through the delaying proxy's control port (`bench.link`), once the unit before has no
probe still out (`OffloadClient.probes_settled`: the replica side of a raced probe runs on
after the application's answer, and a link changed under it would show it a link that no
device sees), and gRPC reaches the broker and the replica only through that proxy
(`grpc_proxy` in the environment). Requests are sent one at a time, each timed around its
inference call alone (`OffloadClient.infer`, or the plain session's `run`: the bench's own
bookkeeping, such as reading where a request ran, is outside the time). Then the optional
switch run: a fresh ``fastest`` client through its phases (lan -> slow -> lan), requests
in a row.

Prints one JSON line: per contender, the latencies (ms), where each request ran and whether
it was a raced probe, in the order sent; the switch run's per phase; the clients' failures.

Imports only what the runtime image has (numpy, onnxruntime, grpcio, protobuf) and the
repository mounted on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edge_client.adaptive import Reason
from edge_client.client import OffloadClient

SETTLE_S = 0.2
"""Pause before each unit: many CFS periods (at most 100 ms each), so a unit does not start
in a period whose quota the previous one (ORT's spinning threads) spent."""

WARMUP_LIMIT = 50
"""Requests a `fastest` client may take to compare its two sides before the rounds."""

Call = Callable[[], Awaitable[tuple[float, str, bool]]]
"""One request; returns its inference call's time (seconds), where it ran ("local" or
"remote") and whether it was a probe of the replica raced against the local model."""


async def set_link(control: str, delay_ms: float, rate_mbit: float) -> None:
    host, _, port = control.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"{delay_ms} {rate_mbit}\n".encode())
    await writer.drain()
    if (await reader.readline()).strip() != b"ok":
        raise RuntimeError("the link refused its conditions")
    writer.close()
    await writer.wait_closed()


def client_call(client: OffloadClient, inputs: dict[str, np.ndarray]) -> Call:
    async def call() -> tuple[float, str, bool]:
        before = client.stats().offload
        started = time.perf_counter()
        await client.infer(inputs)
        seconds = time.perf_counter() - started
        after = client.stats().offload
        target = "local" if after.local_requests > before.local_requests else "remote"
        return seconds, target, after.raced > before.raced

    return call


def ort_default_call(model: Path, inputs: dict[str, np.ndarray]) -> Call:
    session = ort.InferenceSession(str(model))  # ORT's defaults, on purpose: no options

    async def call() -> tuple[float, str, bool]:  # blocks the loop, as a plain user's would
        started = time.perf_counter()
        session.run(None, inputs)
        return time.perf_counter() - started, "local", False

    return call


def turn(members: list[dict[str, Any]], index: int) -> tuple[dict[str, Any], ...]:
    """The order of turn `index`, from a Williams design (`balanced_orders`): over each
    cycle of its orders every member follows every other one, and is first, equally often
    (a rotation would keep one order of neighbours: under a CPU quota a request after a
    remote one, which left the CPU idle, runs on a fuller quota than one after a local
    one)."""
    orders = balanced_orders(len(members))
    return tuple(members[i] for i in orders[index % len(orders)])


@functools.cache
def balanced_orders(n: int) -> tuple[tuple[int, ...], ...]:
    """A Williams design for `n` members: `n` orders (2n for odd n, each with its mirror),
    balanced for who comes first and for who follows whom; cycles short enough that a
    unit's turns (50 in full mode) run through whole ones."""
    first, low, high = [0], 1, n - 1
    while low <= high:
        first.append(low)
        low += 1
        if low <= high:
            first.append(high)
            high -= 1
    orders = [tuple((i + shift) % n for i in first) for shift in range(n)]
    if n % 2:
        orders += [order[::-1] for order in orders]
    return tuple(orders)


async def timed(call: Call, n: int) -> tuple[list[float], list[str]]:
    latencies, targets = [], []
    for _ in range(n):
        seconds, target, _ = await call()
        latencies.append(seconds * 1000)
        targets.append(target)
    return latencies, targets


async def until_compared(client: OffloadClient, call: Call) -> None:
    """Requests until `fastest` has measured both sides and compared them (a request that
    is not a measuring one), then until no probe is out: its steady state is what the
    rounds time; how soon it gets there is the switch run's figure."""
    for _ in range(WARMUP_LIMIT):
        before = measuring(client)
        await call()
        if measuring(client) == before:
            break
    else:
        raise RuntimeError(f"fastest still measuring after {WARMUP_LIMIT} requests")
    await client.probes_settled()


def measuring(client: OffloadClient) -> int:
    decisions = client.stats().offload.decisions
    return sum(d.requests for d in decisions if d.reason == Reason.MEASURING)


async def run(args: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    inputs = dict(np.load(args.inputs))
    async with contextlib.AsyncExitStack() as stack:

        async def client(policy: str, local: bool) -> OffloadClient:
            opened = await stack.enter_async_context(
                OffloadClient(
                    args.broker,
                    args.api_key,
                    local_model=args.model if local else None,
                    policy=policy,
                    local_threads=args.threads,
                    offload_report_s=0,
                )
            )
            await opened.attach(args.deployment)
            return opened

        clients = {
            "local": await client("local", True),
            "remote": await client("remote", False),
            "fastest/lan": await client("fastest", True),
            "fastest/slow": await client("fastest", True),
        }
        calls = {name: client_call(c, inputs) for name, c in clients.items()}
        calls["ort-default"] = ort_default_call(args.model, inputs)
        await set_link(args.control, 0.0, 0.0)
        for name in ("ort-default", "local", "remote"):
            await timed(calls[name], plan["warmup"])
        units = plan["units"]
        for unit in units:
            for member in unit["members"]:
                if member["contender"].startswith("fastest"):
                    await set_link(args.control, *unit["conditions"])
                    await until_compared(clients[member["contender"]], calls[member["contender"]])
        figures: dict[str, dict[str, list[Any]]] = {
            m["label"]: {"latencies_ms": [], "targets": [], "raced": []}
            for u in units
            for m in u["members"]
        }
        for round_ in range(plan["rounds"]):
            for i in range(len(units)):
                unit = units[(i + round_) % len(units)]
                await set_link(args.control, *unit["conditions"])
                await asyncio.sleep(SETTLE_S)
                members = unit["members"]
                for step in range(unit["steps"]):
                    for member in turn(members, round_ * unit["steps"] + step):
                        if step >= member.get("steps", unit["steps"]):
                            continue
                        seconds, target, raced = await calls[member["contender"]]()
                        figures[member["label"]]["latencies_ms"].append(seconds * 1000)
                        figures[member["label"]]["targets"].append(target)
                        figures[member["label"]]["raced"].append(raced)
                for member in members:
                    if (contender := clients.get(member["contender"])) is not None:
                        # A raced probe's replica side may still be on the link: the next
                        # unit's conditions must not change under it (a real link does not).
                        await contender.probes_settled()
        switch = []
        if plan.get("switch"):
            switching = await client("fastest", True)
            clients["switch"] = switching
            for phase in plan["switch"]:
                await set_link(args.control, *phase["conditions"])
                latencies, targets = await timed(client_call(switching, inputs), phase["n"])
                switch.append({"latencies_ms": latencies, "targets": targets})
        failures = sum(c.stats().failures for c in clients.values())
    return {"contenders": figures, "switch": switch, "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.offload_device")
    parser.add_argument("--broker", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--deployment", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--inputs", type=Path, required=True, help=".npz of the inputs")
    parser.add_argument("--control", required=True, help="the link's control host:port")
    parser.add_argument("--threads", type=int, default=1, help="our local path's threads")
    parser.add_argument(
        "--plan", type=Path, required=True, help="JSON: warmup, rounds, units, switch"
    )
    args = parser.parse_args()
    plan = json.loads(args.plan.read_text())
    print(json.dumps(asyncio.run(run(args, plan))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
