"""How the broker's servicer methods answer failures (`broker.rpc.status`), over a real grpc.aio
server: domain errors with their status and a cleaned message, a bug with INTERNAL, a generic
message and its traceback in the log, a request that does not parse with INVALID_ARGUMENT."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from broker.errors import NodeUnavailable
from broker.rpc.status import MalformedRequests, mapped_errors
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import node_pb2 as npb

SERVICE = "test.Status"


class Servicer:
    @mapped_errors
    async def NodeFailed(self, request: pb.GetDeploymentRequest, context: Any) -> bytes:
        raise NodeUnavailable(
            f"node-a could not start {request.deployment_id}: \x1b[31mKeyError: "
            "'GPU0'\x1b[0m in /var/lib/offload/node-a/replicas/log.txt"
        )

    @mapped_errors
    async def Bug(self, request: pb.GetDeploymentRequest, context: Any) -> bytes:
        raise ValueError(f"secret internals of {request.deployment_id}")

    @mapped_errors
    async def Echo(self, request: pb.GetDeploymentRequest, context: Any) -> bytes:
        return request.deployment_id.encode()

    @mapped_errors
    async def Count(self, chunks: AsyncIterator[npb.ModelChunk], context: Any) -> bytes:
        return str(len([chunk async for chunk in chunks])).encode()


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    servicer = Servicer()
    unary = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=pb.GetDeploymentRequest.FromString
        )
        for name in ("NodeFailed", "Bug", "Echo")
    }
    count = grpc.stream_unary_rpc_method_handler(
        servicer.Count, request_deserializer=npb.ModelChunk.FromString
    )
    server = grpc.aio.server(interceptors=[MalformedRequests()])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {**unary, "Count": count}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


async def _failure(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def _request(deployment_id: str) -> bytes:
    return pb.GetDeploymentRequest(deployment_id=deployment_id).SerializeToString()


async def test_a_domain_error_answers_its_status_with_a_clean_message(
    channel: grpc.aio.Channel,
) -> None:
    err = await _failure(channel.unary_unary(f"/{SERVICE}/NodeFailed")(_request("d-1")))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == "node-a could not start d-1: 'GPU0' in <path>"


async def test_a_bug_answers_internal_with_a_reference_and_logs_its_traceback(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="broker.rpc.status"):
        err = await _failure(channel.unary_unary(f"/{SERVICE}/Bug")(_request("d-1")))
    assert err.code() == grpc.StatusCode.INTERNAL
    details = err.details() or ""
    assert "secret" not in details and "ValueError" not in details
    reference = details.split("(ref ")[1].split(";")[0]
    [record] = caplog.records
    assert reference in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)


async def test_a_request_that_does_not_parse_is_invalid_argument(
    channel: grpc.aio.Channel,
) -> None:
    assert await channel.unary_unary(f"/{SERVICE}/Echo")(_request("d-1")) == b"d-1"
    not_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (deployment_id), 2 bytes that are not UTF-8
    for raw in (not_utf8, b"\xff\xff\xff"):
        err = await _failure(channel.unary_unary(f"/{SERVICE}/Echo")(raw))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid message" in (err.details() or "")


async def test_a_client_stream_message_that_does_not_parse_is_invalid_argument(
    channel: grpc.aio.Channel,
) -> None:
    good = npb.ModelChunk(sha256="ab", data=b"1").SerializeToString()
    count = channel.stream_unary(f"/{SERVICE}/Count")
    assert await count(iter([good, good, good])) == b"3"
    err = await _failure(count(iter([good, b"\x0a\x01\xff", good])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"/{SERVICE}/Count" in (err.details() or "")
