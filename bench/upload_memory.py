"""Stalled uploads against a real broker process: the memory they make it hold.

`--clients` clients (default 20), each with its own API key and connection, start `--uploads`
uploads each (default 2) of `--mib` MiB (default 40), in 1 MiB chunks as the edge client sends
them, and then stall: the stream stays open and sends nothing more. Once every upload has sent
what the broker would take (or was refused), the clients hang up, as devices that lost their
link, and the broker must drop what they staged.

    baseline    the broker's RSS once it listens, before any upload (its idle size)
    peak        its peak RSS over the run (VmHWM of /proc/<pid>/status)
    after       its RSS once every staging file is gone (and 2 s more)
    staged      the staging files' bytes on disk at the stall, summed
    refused     uploads refused RESOURCE_EXHAUSTED (past a staging cap), and one message

It holds when the peak stays within the broker-wide staging cap (`--cap-mib`, passed to the
broker as `--max-staged-upload-bytes`) plus 100 MB over the baseline, and `after` falls back
below the peak and within 150 MB of the baseline (`KEPT_BYTES`).

    python -m bench.upload_memory [--quick] [--clients N] [--uploads N] [--mib N]
                                  [--cap-mib N] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from broker.state.api_keys import new_api_key
from edge_client.demo.cluster import CLUSTER_FILE
from protos.offload.v1 import broker_pb2_grpc as pb_grpc
from protos.offload.v1 import node_pb2 as npb

CHUNK_BYTES = 1 << 20
MB = 1_000_000
MIB = 1 << 20
MARGIN_BYTES = 100 * MB
"""What the broker may hold at its peak over its idle size and the staging cap."""
KEPT_BYTES = 150 * MB
"""What it may keep over its idle size once every upload is gone: the allocators' (gRPC's,
Python's) own caches; 95-143 MB in runs on a 2-core VM, where 2.68 GB were kept before the
uploads were capped and their chunks' memory handed back."""
REPO_ROOT = Path(__file__).resolve().parent.parent


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """`field` of /proc/<pid>/status (VmRSS: now; VmHWM: the peak), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no {field} in /proc/{pid}/status")


async def _wait_for(pattern: str, log: Path, process: asyncio.subprocess.Process) -> re.Match[str]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = await asyncio.to_thread(log.read_text)
        if match := re.search(pattern, text):
            return match
        if process.returncode is not None:
            raise RuntimeError(f"the broker exited ({process.returncode}):\n{text}")
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no {pattern!r} in the broker's log after 60 s:\n{text}")


@contextlib.asynccontextmanager
async def broker_process(
    root: Path, keys: Sequence[str], flags: Sequence[str]
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int, Path]]:
    """`offload broker` on loopback with `keys`; (the process, its port, its models dir)."""
    (root / "join-token").write_text("bench-join-token\n")
    keys_file = root / "api-keys"
    keys_file.write_text("\n".join(keys) + "\n")
    keys_file.chmod(0o600)
    log = root / "broker.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "edge_client.cli", "broker",
            "--listen", "127.0.0.1:0", "--ops-listen", "127.0.0.1:0",
            "--state-dir", str(root / "state"), "--cluster", str(CLUSTER_FILE),
            "--join-token-file", str(root / "join-token"),
            "--api-keys-file", str(keys_file), *flags,
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        )  # fmt: skip
    try:
        match = await _wait_for(r"broker listening on \S+:(\d+)", log, process)
        yield process, int(match.group(1)), root / "state" / "models"
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()


def staging_bytes(models: Path) -> int:
    """Bytes in the broker's staging files now."""
    total = 0
    for staging in models.glob(".upload-*"):
        for path in (staging, *staging.glob("*")):
            with contextlib.suppress(OSError):
                total += path.stat().st_size if path.is_file() else 0
    return total


async def stalled_upload(
    stub: pb_grpc.EdgeBrokerStub, key: str, data: bytes, sent: asyncio.Event
) -> str:
    """Send `data`, then stall until cancelled; "refused: ..." when the broker ends it first."""

    async def chunks() -> AsyncIterator[npb.ModelChunk]:
        sha = hashlib.sha256(data).hexdigest()
        for offset in range(0, len(data), CHUNK_BYTES):
            yield npb.ModelChunk(
                sha256=sha if offset == 0 else "", data=data[offset : offset + CHUNK_BYTES]
            )
        sent.set()
        await asyncio.Event().wait()  # stalled: never another chunk

    call = stub.UploadModel(chunks(), metadata=(("authorization", f"Bearer {key}"),))
    try:
        await call
    except grpc.aio.AioRpcError as err:
        sent.set()
        return f"{err.code().name}: {err.details()}"
    return "finished"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    keys = [new_api_key(f"client{n:02}") for n in range(args.clients)]
    cap = args.cap_mib * MIB
    flags = [
        "--upload-idle-timeout", "600",
        "--max-staged-upload-bytes", str(cap),
        # Each upload is within the size limit (the caps must be at least that).
        "--max-model-bytes", str(min(cap, 2 * args.mib * MIB)),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-upload-") as tmp:
        async with broker_process(Path(tmp), keys, flags) as (process, port, models):
            await asyncio.sleep(1.0)  # let start-up settle before the idle figure
            baseline = rss_bytes(process.pid)
            data = [os.urandom(args.mib * MIB) for _ in range(args.uploads)]
            channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in keys]
            try:
                sent = [asyncio.Event() for _ in range(len(keys) * args.uploads)]
                tasks = [
                    asyncio.create_task(
                        stalled_upload(
                            pb_grpc.EdgeBrokerStub(channels[c]),
                            keys[c],
                            data[u],
                            sent[c * args.uploads + u],
                        )
                    )
                    for c in range(len(keys))
                    for u in range(args.uploads)
                ]
                started = time.monotonic()
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in sent)), 600)
                # Chunks the broker took may still be on their way to the disk.
                staged = staging_bytes(models)
                while time.monotonic() - started < 600:
                    await asyncio.sleep(0.5)
                    if (now := staging_bytes(models)) == staged:
                        break
                    staged = now
                stalled_rss = rss_bytes(process.pid)
                for task in tasks:
                    task.cancel()
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                for channel in channels:
                    await channel.close()
            deadline = time.monotonic() + 60
            while staging_bytes(models) or any(models.glob(".upload-*")):
                if time.monotonic() > deadline:
                    raise RuntimeError("staging files left 60 s after the clients hung up")
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.0)
            after = rss_bytes(process.pid)
            peak = rss_bytes(process.pid, "VmHWM")
    refused = [o for o in outcomes if isinstance(o, str) and o.startswith("RESOURCE_EXHAUSTED")]
    holds = peak <= baseline + cap + MARGIN_BYTES and after <= min(peak, baseline + KEPT_BYTES)
    return {
        "clients": args.clients,
        "uploads_per_client": args.uploads,
        "upload_mib": args.mib,
        "cap_bytes": cap,
        "baseline_rss_mb": round(baseline / MB),
        "stalled_rss_mb": round(stalled_rss / MB),
        "peak_rss_mb": round(peak / MB),
        "after_rss_mb": round(after / MB),
        "staged_mb": round(staged / MB),
        "refused": len(refused),
        "refusal": refused[0] if refused else "",
        "holds": holds,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.upload_memory", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="5 clients x 2 x 8 MiB, a cap of 48 MiB"
    )
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--uploads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=40)
    parser.add_argument(
        "--cap-mib",
        type=int,
        default=1024,
        help="the broker's --max-staged-upload-bytes, in MiB (default 1024: under what the "
        "uploads would stage, so some are refused)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if min(args.clients, args.uploads, args.mib, args.cap_mib) < 1:
        parser.error("--clients, --uploads, --mib and --cap-mib must be at least 1")
    if args.quick:
        args.clients, args.mib, args.cap_mib = min(args.clients, 5), min(args.mib, 8), 48
    result = asyncio.run(run(args))
    print(
        f"{args.clients} clients x {args.uploads} stalled uploads of {args.mib} MiB: broker RSS "
        f"peak {result['peak_rss_mb']} MB, at the stall {result['stalled_rss_mb']} MB, "
        f"after {result['after_rss_mb']} MB (baseline: idle {result['baseline_rss_mb']} MB); "
        f"staged {result['staged_mb']} MB on disk, {result['refused']} refused"
        + (f" ({result['refusal']})" if result["refusal"] else "")
        + f"; {'holds' if result['holds'] else 'DOES NOT HOLD'}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
