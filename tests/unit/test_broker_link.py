"""The node's link to the broker (`node_daemon.broker_link`): heartbeats on one stream (a
call each from a broker without it), registering again when the broker forgets the node, a
new stream when one stalls, and a fetch on a closed link."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from node_daemon.agent import NodeAgent
from node_daemon.broker_link import BrokerLink, HeartbeatStream
from node_daemon.errors import ModelNotCached
from node_daemon.inventory import GpuSpec, inventory_from_capture
from node_daemon.model_cache import ModelCache
from node_daemon.runtimes.null_runtime import NullRuntime
from protos.offload.v1 import broker_pb2 as bpb
from protos.offload.v1 import broker_pb2_grpc as bpb_grpc
from tests.cluster_support import until
from tests.data import TOPOLOGIES


async def test_a_fetch_on_a_closed_link_is_a_model_not_cached_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A start that needs a model while the daemon closes its link (it is stopping) gets
    the node's own error (NOT_FOUND to the broker, which places the deployment again), not
    gRPC's UsageError (which reached the broker as INTERNAL), and no partial upload."""
    cache = ModelCache(tmp_path / "models")
    link = BrokerLink("127.0.0.1:1", "join-token", null_node(cache), "127.0.0.1:2")
    await link.close()
    with pytest.raises(ModelNotCached, match="this node is leaving the broker"):
        await link.fetch_model("ab" * 32)
    with pytest.raises(ModelNotCached):
        cache.path("ab" * 32)
    assert not [p for p in (tmp_path / "models").rglob("*") if p.is_file()]


class Registry(bpb_grpc.NodeRegistryServicer):
    """A broker's NodeRegistry on a real gRPC server, recording what nodes send. `streams`:
    whether it serves the heartbeat stream (an older broker does not: UNIMPLEMENTED);
    `forget_first`: the first stream ends NOT_FOUND (the broker does not know the node);
    `stall_first`: the first stream never answers; `answer_after_s`: each heartbeat is counted
    when it arrives and answered that long after (a broker slow to answer);
    `interval_ms`: the heartbeat interval it asks for."""

    def __init__(
        self,
        *,
        streams: bool,
        forget_first: bool = False,
        stall_first: bool = False,
        answer_after_s: float = 0.0,
        interval_ms: int = 50,
    ):
        self.streams = streams
        self.forget_first = forget_first
        self.stall_first = stall_first
        self.answer_after_s = answer_after_s
        self.interval_ms = interval_ms
        self.registers = 0
        self.unary_beats = 0
        self.stream_beats = 0
        self.opened = 0

    async def Register(self, request: bpb.RegisterRequest, context: object) -> object:
        self.registers += 1
        return bpb.RegisterResponse(heartbeat_interval_ms=self.interval_ms, lost_after_ms=5000)

    async def Heartbeat(self, request: bpb.HeartbeatRequest, context: object) -> object:
        self.unary_beats += 1
        return bpb.HeartbeatResponse()

    async def Heartbeats(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        if not self.streams:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no such method")
        self.opened += 1
        first = self.opened == 1
        if self.answer_after_s:
            async for answer in self._answer_late(requests):
                yield answer
            return
        async for request in requests:
            assert request.node_id == "n1"
            if first and self.forget_first:
                await context.abort(grpc.StatusCode.NOT_FOUND, "node n1 is not registered")
            if first and self.stall_first:
                await asyncio.sleep(3600)
            self.stream_beats += 1
            yield bpb.HeartbeatResponse()

    async def _answer_late(self, requests: Any) -> Any:
        """Count each heartbeat as it arrives; answer it `answer_after_s` later, in order."""
        loop = asyncio.get_running_loop()
        due: asyncio.Queue[float | None] = asyncio.Queue()

        async def receive() -> None:
            async for _ in requests:
                self.stream_beats += 1
                due.put_nowait(loop.time() + self.answer_after_s)
            due.put_nowait(None)

        receiving = asyncio.create_task(receive())
        try:
            while (at := await due.get()) is not None:
                await asyncio.sleep(at - loop.time())
                yield bpb.HeartbeatResponse()
        finally:
            receiving.cancel()


async def serve(
    registry: bpb_grpc.NodeRegistryServicer, port: int = 0
) -> tuple[grpc.aio.Server, int]:
    """`registry` on a started gRPC server on loopback (on `port`; 0: any), and its port."""
    server = grpc.aio.server()
    bpb_grpc.add_NodeRegistryServicer_to_server(registry, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def null_node(cache: ModelCache) -> NodeAgent:
    """Node n1 at site-a: a DGX A100's GPUs, the null runtime, `cache`."""
    inventory = inventory_from_capture(
        next(TOPOLOGIES.glob("12_*.txt")), GpuSpec("A100-SXM4-40GB", 40960)
    )
    return NodeAgent("n1", "site-a", inventory, NullRuntime(), cache)


async def run_link(
    tmp_path: Path, registry: Registry, done: Callable[[], bool]
) -> list[float | None]:
    """A node's link against `registry` until `done()`; the round trips it reported."""
    server, port = await serve(registry)
    agent = null_node(ModelCache(tmp_path / "m"))
    beats: list[float | None] = []
    link = BrokerLink(
        f"127.0.0.1:{port}", "join-token", agent, "127.0.0.1:2", on_heartbeat=beats.append
    )
    running = asyncio.create_task(link.run())
    try:
        await until(done, "the link's heartbeats", timeout_s=30)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await link.close()
        await server.stop(None)
        # gRPC's own tasks of a cancelled stream end a few loop turns after the stop.
        await until(lambda: not _serving(), "the server's RPC tasks to end", timeout_s=10)
    return beats


def _serving() -> list[asyncio.Task[Any]]:
    """The gRPC server's tasks still running (one per call, named after its method)."""
    return [
        t
        for t in asyncio.all_tasks()
        if not t.done()
        and (t.get_name().startswith("HandleExceptions[") or t.get_name() == "rpc_task")
    ]


async def test_heartbeats_go_on_one_stream(tmp_path: Path) -> None:
    registry = Registry(streams=True)
    beats = await run_link(tmp_path, registry, lambda: registry.stream_beats >= 5)
    assert registry.opened == 1 and registry.unary_beats == 0
    assert len(beats) >= 5 and all(b is not None and b > 0 for b in beats)


async def test_a_broker_without_the_stream_gets_a_call_per_heartbeat(tmp_path: Path) -> None:
    registry = Registry(streams=False)
    beats = await run_link(tmp_path, registry, lambda: registry.unary_beats >= 3)
    assert registry.stream_beats == 0
    # The one refused stream is a failed heartbeat; every later one is a call, answered.
    assert beats[0] is None and all(b is not None for b in beats[1:])


async def test_a_stream_that_forgets_the_node_has_it_register_again(tmp_path: Path) -> None:
    registry = Registry(streams=True, forget_first=True)
    await run_link(tmp_path, registry, lambda: registry.stream_beats >= 2)
    assert registry.registers == 2 and registry.opened == 2


async def test_an_unanswered_heartbeat_drops_its_stream_for_a_new_one(tmp_path: Path) -> None:
    registry = Registry(streams=True, stall_first=True)
    beats = await run_link(tmp_path, registry, lambda: registry.stream_beats >= 2)
    assert registry.opened == 2 and registry.registers == 1
    assert beats[0] is None and all(b is not None for b in beats[1:])


async def test_a_broker_slow_to_answer_keeps_the_stream_and_every_heartbeat(
    tmp_path: Path,
) -> None:
    # Each answer comes 2.4 s late: past the 2 s a call would wait, within the ten heartbeats
    # (3 s at 300 ms) a node with one broker waits on its stream. The node keeps writing
    # meanwhile: the broker counts every heartbeat as it arrives, on the one stream.
    registry = Registry(streams=True, answer_after_s=2.4, interval_ms=300)
    beats = await run_link(tmp_path, registry, lambda: registry.stream_beats >= 12)
    assert registry.opened == 1 and registry.registers == 1
    assert beats and all(b is not None and b >= 2400 for b in beats)


class AnsweringWhileWriting:
    """A `Heartbeats` call whose answer to each message arrives before the write returns
    (as it may on a busy node: the reader task runs first)."""

    def __init__(self) -> None:
        self._answers: asyncio.Queue[object] = asyncio.Queue()

    async def write(self, request: bpb.HeartbeatRequest) -> None:
        self._answers.put_nowait(bpb.HeartbeatResponse())
        await asyncio.sleep(0.01)

    async def read(self) -> object:
        return await self._answers.get()

    def cancel(self) -> bool:
        return True


async def test_an_answer_read_before_its_write_returns_is_matched_to_that_heartbeat() -> None:
    answered: list[float | None] = []
    stream = HeartbeatStream(AnsweringWhileWriting(), answered.append)
    try:
        for sent in range(1, 4):
            await stream.beat(bpb.HeartbeatRequest(node_id="n1"), deadline_s=5.0)
            # Each answer is that heartbeat's: none skipped, none timed from the one before.
            assert len(answered) == sent
    finally:
        stream.cancel()


class BrokenUnderTheWrite(AnsweringWhileWriting):
    """A `Heartbeats` call whose connection died (the broker killed): gRPC's core fails the
    write INTERNAL."""

    async def write(self, request: bpb.HeartbeatRequest) -> None:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            "Internal error from Core",
        )


async def test_a_stream_broken_under_its_write_is_unavailable_not_fatal() -> None:
    stream = HeartbeatStream(BrokenUnderTheWrite(), None)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.beat(bpb.HeartbeatRequest(node_id="n1"), deadline_s=5.0)
    finally:
        stream.cancel()
    # UNAVAILABLE is retried (the node calls the broker again); INTERNAL stopped the daemon.
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Internal error from Core" in (caught.value.details() or "")
