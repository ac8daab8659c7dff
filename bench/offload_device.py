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
    each keeping its state from one of its blocks to the next.

The plan's blocks are run in rounds (the order rotated by one each round), so that machine
noise falls on every contender alike; before each block the link's conditions are set
through the delaying proxy's control port (`bench.link`), once the block before has no
probe still out (`OffloadClient.probes_settled`: the replica side of a raced probe runs on
after the application's answer, and a link changed under it would show it a link that no
device sees), and gRPC reaches the broker and the replica only through that proxy
(`grpc_proxy` in the environment). Requests are sent one at a time, each timed around its
call. Then the optional switch run: a fresh ``fastest``
client through its phases (lan -> slow -> lan), requests in a row.

Prints one JSON line: per contender, the latencies (ms) and where each request ran, in the
order sent; the switch run's per phase; the clients' failures.

Imports only what the runtime image has (numpy, onnxruntime, grpcio, protobuf) and the
repository mounted on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edge_client.client import OffloadClient

SETTLE_S = 0.2
"""Pause before each block: two CFS periods (100 ms each), so a block does not start in a
period whose quota the previous one (ORT's spinning threads) spent."""

Call = Callable[[], Awaitable[str]]
"""One request; returns where it ran ("local" or "remote")."""


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
    async def call() -> str:
        before = client.stats().offload.local_requests
        await client.infer(inputs)
        return "local" if client.stats().offload.local_requests > before else "remote"

    return call


def ort_default_call(model: Path, inputs: dict[str, np.ndarray]) -> Call:
    session = ort.InferenceSession(str(model))  # ORT's defaults, on purpose: no options

    async def call() -> str:  # blocks the loop, as a plain user's call would block theirs
        session.run(None, inputs)
        return "local"

    return call


async def timed(call: Call, n: int) -> tuple[list[float], list[str]]:
    latencies, targets = [], []
    for _ in range(n):
        started = time.perf_counter()
        target = await call()
        latencies.append((time.perf_counter() - started) * 1000)
        targets.append(target)
    return latencies, targets


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
        blocks = plan["blocks"]
        figures: dict[str, dict[str, list[Any]]] = {
            b["label"]: {"latencies_ms": [], "targets": []} for b in blocks
        }
        for round_ in range(plan["rounds"]):
            for i in range(len(blocks)):
                block = blocks[(i + round_) % len(blocks)]
                await set_link(args.control, *block["conditions"])
                await asyncio.sleep(SETTLE_S)
                latencies, targets = await timed(calls[block["contender"]], block["n"])
                if (contender := clients.get(block["contender"])) is not None:
                    # A raced probe's replica side may still be on the link: the next
                    # block's conditions must not change under it (a real link does not).
                    await contender.probes_settled()
                figures[block["label"]]["latencies_ms"] += latencies
                figures[block["label"]]["targets"] += targets
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
    parser.add_argument("--plan", type=Path, required=True, help="JSON: rounds, blocks, switch")
    args = parser.parse_args()
    plan = json.loads(args.plan.read_text())
    print(json.dumps(asyncio.run(run(args, plan))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
