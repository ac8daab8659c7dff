"""`bench.loopback.loopback_server`: the benches' helper servers (`bench.echo_server`,
`bench.null_registry`) started as processes on a free loopback port, and stopped."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from bench import echo_server, null_registry
from bench.loopback import loopback_server
from bench.timing import channel_to
from protos.offload.v1 import broker_pb2 as pb
from protos.offload.v1 import broker_pb2_grpc as pb_grpc


async def test_the_echo_answers_as_many_bytes_as_asked_and_stops_on_the_way_out() -> None:
    async with loopback_server(echo_server.__name__) as (address, process):
        async with channel_to(address) as channel:
            answer = await channel.unary_unary(echo_server.METHOD)((100).to_bytes(8, "little"))
        assert len(answer) == 100
    assert process.returncode is not None


async def test_echo_after_answers_as_many_bytes_as_asked_after_the_wait_it_is_told() -> None:
    """`bench.loopback_stall`'s call: 8 bytes of answer size, 8 of microseconds to wait, then
    the payload. A wait of 0 answers as the plain echo does."""
    async with (
        loopback_server(echo_server.__name__) as (address, _),
        channel_to(address) as channel,
    ):
        after = channel.unary_unary(echo_server.AFTER_METHOD)
        waited = (4000).to_bytes(8, "little") + (20_000).to_bytes(8, "little") + bytes(1000)
        assert len(await after(waited)) == 4000
        assert len(await after((9).to_bytes(8, "little") + bytes(8))) == 9


async def test_with_a_response_file_the_echo_answers_model_infer_with_it(tmp_path: Path) -> None:
    """The floor of `bench.peers`: any ModelInfer request gets the file's bytes back, and the
    echo still answers beside it."""
    response = tmp_path / "response.bin"
    response.write_bytes(b"\x0a\x03mlp" + bytes(range(40)))
    async with (
        loopback_server(echo_server.__name__, str(response)) as (address, _),
        channel_to(address) as channel,
    ):
        infer = channel.unary_unary(echo_server.FLOOR_METHOD)
        assert await infer(b"any request") == response.read_bytes()
        assert await infer(b"") == response.read_bytes()
        assert len(await channel.unary_unary(echo_server.METHOD)((7).to_bytes(8, "little"))) == 7


async def test_the_null_registry_registers_any_node_and_answers_each_heartbeat() -> None:
    async with (
        loopback_server(null_registry.__name__, "1000", "5000") as (address, _),
        grpc.aio.insecure_channel(address) as channel,
    ):
        stub = pb_grpc.NodeRegistryStub(channel)
        registered = await stub.Register(pb.RegisterRequest(node_id="n1"), timeout=10)
        assert (registered.heartbeat_interval_ms, registered.lost_after_ms) == (1000, 5000)
        call = stub.Heartbeats()
        for _ in range(3):
            await call.write(pb.HeartbeatRequest(node_id="n1"))
            assert await call.read() == pb.HeartbeatResponse()
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.FetchModel(pb.FetchModelRequest(sha256="0" * 64), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_server_that_exits_without_a_port_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="exited with status"):
        async with loopback_server(null_registry.__name__, "not-a-number", "5000"):
            pass
