"""`python -m runtime.server` as a process of its own, for tests that need one (a signal to
it, its threads' CPUs)."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import grpc

from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc

TOKEN = "runtime-process-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
REPO_ROOT = Path(__file__).resolve().parents[1]


async def spawn_runtime(
    tmp_path: Path, model: Path, *flags: str, cpus: set[int] | None = None
) -> tuple[asyncio.subprocess.Process, str]:
    """`python -m runtime.server` on a free port, its log in `tmp_path / "runtime.log"`, on
    `cpus` (default: this process's); returns (the process, its endpoint) once its model is
    ready."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    log = tmp_path / "runtime.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime.server", "--model", str(model), "--name", model.stem,
            "--host", "127.0.0.1", "--port", "0", "--token-file", str(token), *flags,
            stdout=out, stderr=out, cwd=REPO_ROOT,
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )  # fmt: skip
    for _ in range(600):
        if match := re.search(r"listening on (\S+:\d+)", log.read_text()):
            endpoint = match.group(1)
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"the runtime did not listen:\n{log.read_text()}")
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(600):
            if (await stub.ServerReady(pb.ServerReadyRequest(), metadata=AUTH)).ready:
                return process, endpoint
            await asyncio.sleep(0.05)
    raise AssertionError(f"the runtime did not turn ready:\n{log.read_text()}")
