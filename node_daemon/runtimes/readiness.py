"""The readiness probe both runtimes start a replica with: the Open Inference Protocol's
ServerReady and ModelReady over gRPC, until both answer true."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

from node_daemon.runtimes.base import ReplicaFailed
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from runtime.pem import TlsIdentity
from runtime.tls import open_channel


async def wait_ready(
    endpoint: str,
    token: str,
    model_name: str,
    timeout_s: float,
    alive: Callable[[], Awaitable[None]] | None = None,
    interval_s: float = 0.05,
    tls: TlsIdentity | None = None,
) -> float:
    """Poll ServerReady and ModelReady until both are true; returns the seconds it took.

    Each probe uses a fresh channel: a reused one would sit in gRPC's reconnect backoff
    (about a second) after the first refused connection and hide the true ready time.
    `alive` is awaited between probes and raises ReplicaFailed when the replica died.
    `tls`: the replica serves TLS, its certificate chains to `tls.ca`. TimeoutError after
    `timeout_s`.
    """
    started = time.monotonic()
    metadata = (("authorization", f"Bearer {token}"),)
    while True:
        async with open_channel(endpoint, tls) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            try:
                server = await stub.ServerReady(
                    pb.ServerReadyRequest(), metadata=metadata, timeout=1.0
                )
                model = await stub.ModelReady(
                    pb.ModelReadyRequest(name=model_name), metadata=metadata, timeout=1.0
                )
                if server.ready and model.ready:
                    return time.monotonic() - started
            except grpc.aio.AioRpcError as err:
                if err.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise ReplicaFailed(
                        f"readiness probe on {endpoint} failed: {err.code().name} {err.details()}"
                    ) from err
        if alive is not None:
            await alive()
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"replica at {endpoint} not ready after {timeout_s:.0f}s")
        await asyncio.sleep(interval_s)
