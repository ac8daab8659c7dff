"""What liveness costs a Python server per node, apart from everything else the broker does
(issue 51's floor): an HTTP/2 keepalive ping, and the UDP beacon that replaced it on the node
port (`broker.beacons`; its pings go every 20 s now).

A `grpc.aio` server process with keepalive settings as the broker's node port has them
(`broker.server.keepalive`: a ping after --interval seconds without a frame from the peer,
answered within 1 s; 2 s by default, what the node port pinged at before beacons) over TLS,
as production's node port, and --connections idle connections to it, each with one open
bidirectional stream that sent one message and got its answer (as a node's Heartbeats
stream between lease renewals), opened from two client processes. Then the server's CPU
(/proc/<pid>/stat) over --seconds, once with the pings and once without (the same server
with no keepalive settings): the difference, over the pings the interval implies
(connections / interval), is gRPC core's CPU per ping. No Python runs for a ping, so this
is what any server on grpcio pays for this liveness on this machine, before a single
message. Each arm runs twice, interleaved (none, pings, none, pings), and both runs are
printed.

Then the beacons, the same way: the broker's beacon reader (`broker.beacons.BeaconReceiver`,
reading every 100 ms) in a process of its own, holding a key for each of --connections
nodes, and the nodes' senders (`node_daemon.broker_link.BeaconSender`, one per node, a
beacon a second, their starts spread over the first second) in two client processes; the
reader's CPU with them and with none (its keys issued, nothing sent), twice each,
interleaved: the difference over the beacons taken per second is its CPU per beacon. The
reader counts what it took and what it dropped; every beacon sent must be taken.

    python -m bench.ping_cost [--quick] [--connections N] [--seconds S] [--interval S]
                              [--json FILE]

--quick: 200 connections (and nodes beaconing) over 3 s. Full: 2,000 (bench.control_plane's
largest step) over 20 s, about five minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from broker.beacons import BeaconReceiver
from broker.server import keepalive
from common.certs import issue, make_ca
from node_daemon.broker_link import BeaconSender
from protos.offload.v1 import broker_pb2 as bpb

METHOD = "/bench.PingCost/Stream"
CLIENT_PROCESSES = 2
SETTLE_S = 3.0
"""After the last stream opened, before the CPU is counted (the handshakes' work done)."""


PING_TIMEOUT_MS = 1000
DEFAULT_INTERVAL_S = 2.0


async def serve(port: int, interval_ms: int, tls_dir: Path) -> None:
    """Serve idle streams; with a ping every `interval_ms` on each connection (0: none)."""
    pings = keepalive(interval_ms, PING_TIMEOUT_MS) if interval_ms else ()
    options = [*pings, ("grpc.http2.bdp_probe", 0)]
    server = grpc.aio.server(options=options)

    async def stream(requests: AsyncIterator[bytes], _: object) -> AsyncIterator[bytes]:
        async for _request in requests:
            yield b"ok"

    handler = grpc.method_handlers_generic_handler(
        "bench.PingCost", {"Stream": grpc.stream_stream_rpc_method_handler(stream)}
    )
    server.add_generic_rpc_handlers((handler,))
    key, cert = (tls_dir / "server-key.pem").read_bytes(), (tls_dir / "server.pem").read_bytes()
    server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials([(key, cert)]))
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


async def connect(port: int, count: int, tls_dir: Path) -> None:
    """`count` connections, one stream each, answered once; then idle until killed."""
    credentials = grpc.ssl_channel_credentials((tls_dir / "ca.pem").read_bytes())
    held = []
    for i in range(count):
        # A connection of its own each (no shared subchannel), as nodes are.
        channel = grpc.aio.secure_channel(
            f"127.0.0.1:{port}",
            credentials,
            options=[("grpc.use_local_subchannel_pool", 1), ("bench.connection", i)],
        )
        call = channel.stream_stream(METHOD)()
        await call.write(b"hello")
        await call.read()
        held.append((channel, call))
    print(f"open {len(held)}", flush=True)
    await asyncio.sleep(86400)


BEACON_INTERVAL_MS = 1000
"""How often each node beacons (the broker's default heartbeat interval)."""


async def receive(count: int, keys_file: Path) -> None:
    """Issue `count` beacon keys, write them to `keys_file` (port, id and key in hex, a node a
    line), read beacons until stdin closes, then print what was taken and dropped."""
    heard: dict[str, int] = {}

    def on_beacon(node_id: str, _beacon_id: bytes) -> None:
        heard[node_id] = heard.get(node_id, 0) + 1

    receiver = BeaconReceiver.bind("127.0.0.1", 0, on_beacon)
    lines = []
    for n in range(count):
        beacon_id, key = receiver.issue(f"node-{n}")
        lines.append(f"{receiver.port} {beacon_id.hex()} {key.hex()}\n")
    await asyncio.to_thread(keys_file.write_text, "".join(lines))
    receiver.start()
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the parent closes it
    await receiver.close()
    print(f"taken {receiver.taken} dropped {sum(receiver.refused.values())}", flush=True)


async def send(keys_file: Path, first: int, count: int) -> None:
    """Beacons of the nodes of lines `first`..`first + count` of `keys_file`, as node daemons
    send them, their starts spread over an interval; then idle until killed."""
    keys = (await asyncio.to_thread(keys_file.read_text)).splitlines()[first : first + count]
    senders = []
    for line in keys:
        port, beacon_id, key = line.split()
        senders.append(
            BeaconSender.start(
                "127.0.0.1",
                bpb.Beacon(
                    port=int(port),
                    id=bytes.fromhex(beacon_id),
                    key=bytes.fromhex(key),
                    interval_ms=BEACON_INTERVAL_MS,
                ),
            )
        )
        await asyncio.sleep(BEACON_INTERVAL_MS / 1000 / max(len(keys), 1))
    print(f"sending {sum(s is not None for s in senders)}", flush=True)
    await asyncio.sleep(86400)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(*args: str, stdin: int = subprocess.DEVNULL) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.ping_cost", *args],
        stdout=subprocess.PIPE,
        stdin=stdin,
        text=True,
    )


def shares(count: int) -> list[int]:
    """`count` split over the client processes, the first taking the remainder."""
    split = [count // CLIENT_PROCESSES] * CLIENT_PROCESSES
    split[0] += count - sum(split)
    return split


def settled_cores(pid: int, seconds: float) -> float:
    """After `SETTLE_S`, the cores process `pid` used over `seconds`."""
    time.sleep(SETTLE_S)
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return round((cpu_seconds(pid) - before) / (time.monotonic() - started), 4)


def first_line(process: subprocess.Popen[str], what: str) -> str:
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"the {what} exited ({process.wait()}) before it was ready")
    return line


def measure(
    pings: bool, interval_s: float, connections: int, seconds: float, tls_dir: Path
) -> dict[str, Any]:
    """One arm: the server's cores over `seconds` with `connections` idle streams, pinged
    every `interval_s` or not at all."""
    port = 20000 + (os.getpid() * 7 + int(pings)) % 30000
    interval_ms = round(interval_s * 1000) if pings else 0
    server = child("--serve", str(port), str(interval_ms), str(tls_dir))
    processes = [server]
    try:
        first_line(server, "server")
        clients = [
            child("--connect", str(port), str(n), str(tls_dir)) for n in shares(connections) if n
        ]
        processes += clients
        opened = sum(int(first_line(c, "client").split()[1]) for c in clients)
        cores = settled_cores(server.pid, seconds)
        return {"pings": pings, "connections": opened, "server_cores": cores}
    finally:
        for process in processes:
            process.kill()
            process.wait()


def measure_beacons(beacons: bool, connections: int, seconds: float, tmp: Path) -> dict[str, Any]:
    """One beacon arm: the reader's cores over `seconds` holding keys for `connections`
    nodes, which beacon (`beacons`) or not; with what it took and dropped in all."""
    keys_file = tmp / "beacon-keys"
    reader = child("--receive", str(connections), str(keys_file), stdin=subprocess.PIPE)
    processes = [reader]
    try:
        first_line(reader, "beacon reader")
        senders = []
        if beacons:
            counts = shares(connections)
            starts = [sum(counts[:k]) for k in range(len(counts))]
            senders = [
                child("--send", str(keys_file), str(start), str(n))
                for start, n in zip(starts, counts, strict=True)
                if n
            ]
            processes += senders
        sending = sum(int(first_line(c, "beacon sender").split()[1]) for c in senders)
        cores = settled_cores(reader.pid, seconds)
        for sender in senders:  # no more beacons, then the reader's count
            sender.kill()
            sender.wait()
        assert reader.stdin is not None and reader.stdout is not None
        reader.stdin.close()
        said = reader.stdout.readline().split()
        return {
            "beacons": beacons,
            "senders": sending,
            "reader_cores": cores,
            "taken": int(said[1]) if said else 0,
            "dropped": int(said[3]) if said else -1,
        }
    finally:
        for process in processes:
            process.kill()
            process.wait()


def make_certificates(tls_dir: Path) -> None:
    ca, ca_key = make_ca("bench.ping_cost CA")
    cert, key = issue(ca, ca_key, "127.0.0.1", ["localhost"], ["127.0.0.1"])
    (tls_dir / "ca.pem").write_bytes(ca)
    (tls_dir / "server.pem").write_bytes(cert)
    (tls_dir / "server-key.pem").write_bytes(key)
    (tls_dir / "server-key.pem").chmod(0o600)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ping_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="200 connections (and beaconing nodes) over 3 s"
    )
    parser.add_argument(
        "--connections",
        type=int,
        help="idle connections, and beaconing nodes (2000; 200 quick)",
    )
    parser.add_argument("--seconds", type=float, help="CPU counted over (20; 3 quick)")
    parser.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between pings on a connection (2: the node port's before beacons; "
        "it pings every 20 s now)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument(
        "--serve", nargs=3, metavar=("PORT", "INTERVAL_MS", "TLS_DIR"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--connect", nargs=3, metavar=("PORT", "N", "TLS_DIR"), help=argparse.SUPPRESS
    )
    parser.add_argument("--receive", nargs=2, metavar=("N", "KEYS"), help=argparse.SUPPRESS)
    parser.add_argument("--send", nargs=3, metavar=("KEYS", "FIRST", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        port, interval_ms, tls_dir = args.serve
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(int(port), int(interval_ms), Path(tls_dir)))
        return 0
    if args.connect:
        port, count, tls_dir = args.connect
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(connect(int(port), int(count), Path(tls_dir)))
        return 0
    if args.receive:
        count, keys_file = args.receive
        asyncio.run(receive(int(count), Path(keys_file)))
        return 0
    if args.send:
        keys_file, first, count = args.send
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(send(Path(keys_file), int(first), int(count)))
        return 0
    connections = args.connections or (200 if args.quick else 2000)
    seconds = args.seconds or (3.0 if args.quick else 20.0)
    interval = args.interval
    if not (1 <= connections <= 20_000 and 0 < seconds <= 600 and 0.1 <= interval <= 600):
        parser.error(
            f"--connections 1..20000, --seconds 0..600, --interval 0.1..600: got "
            f"{connections}, {seconds:g}, {interval:g}"
        )
    with tempfile.TemporaryDirectory(prefix="bench-ping-cost-") as tmp:
        make_certificates(Path(tmp))
        runs = [
            measure(pings, interval, connections, seconds, Path(tmp))
            for _ in range(2)
            for pings in (False, True)
        ]
        beacon_runs = [
            measure_beacons(beacons, connections, seconds, Path(tmp))
            for _ in range(2)
            for beacons in (False, True)
        ]
    none = [r["server_cores"] for r in runs if not r["pings"]]
    pinged = [r["server_cores"] for r in runs if r["pings"]]
    pings_per_s = connections / interval
    per_ping_us = [
        round((p - n) / pings_per_s * 1e6, 1) for n, p in zip(none, pinged, strict=True)
    ]
    silent = [r["reader_cores"] for r in beacon_runs if not r["beacons"]]
    beaconed = [r["reader_cores"] for r in beacon_runs if r["beacons"]]
    beacons_per_s = connections / (BEACON_INTERVAL_MS / 1000)
    per_beacon_us = [
        round((b - n) / beacons_per_s * 1e6, 1) for n, b in zip(silent, beaconed, strict=True)
    ]
    result = {
        "connections": connections,
        "seconds": seconds,
        "ping_interval_s": interval,
        "pings_per_s": pings_per_s,
        "runs": runs,
        "per_ping_us": per_ping_us,
        "beacons_per_s": beacons_per_s,
        "beacon_runs": beacon_runs,
        "per_beacon_us": per_beacon_us,
    }
    print(
        f"{connections} idle TLS connections, one open stream each, a grpc.aio server "
        f"(keepalive as the node port has it): its CPU over {seconds:g} s without pings "
        f"{', '.join(f'{c:.3f}' for c in none)} cores; with a ping every {interval:g} s on "
        f"each ({pings_per_s:.0f} pings/s) {', '.join(f'{c:.3f}' for c in pinged)} cores: "
        f"{', '.join(f'{u:g}' for u in per_ping_us)} µs of gRPC core's CPU per ping"
    )
    print(
        f"the broker's beacon reader holding {connections} nodes' keys: its CPU over "
        f"{seconds:g} s with no beacons {', '.join(f'{c:.3f}' for c in silent)} cores; with "
        f"a beacon a second from each ({beacons_per_s:.0f}/s) "
        f"{', '.join(f'{c:.3f}' for c in beaconed)} cores: "
        f"{', '.join(f'{u:g}' for u in per_beacon_us)} µs per beacon; taken "
        f"{', '.join(str(r['taken']) for r in beacon_runs if r['beacons'])}, dropped "
        f"{sum(r['dropped'] for r in beacon_runs)}"
    )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    short = [r for r in runs if r["connections"] != connections]
    # Every node beaconed through the window (settle included), and nothing was dropped.
    lost = [
        r
        for r in beacon_runs
        if r["beacons"] and (r["senders"] != connections or r["taken"] < connections * seconds)
    ]
    dropped = [r for r in beacon_runs if r["dropped"] != 0]
    return 1 if short or lost or dropped else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
