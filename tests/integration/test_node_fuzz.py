"""Every RPC of the node daemon (NodeAgent) and of the runtime (GRPCInferenceService), fuzzed
over real gRPC sockets: random field values built from the message descriptors (NaN, inf,
huge numbers, huge, odd and non-UTF-8 strings) and random bytes as the raw request. No call
is answered UNKNOWN or INTERNAL, every message is bounded and free of escape codes, the
server survives, and a refused call changes nothing."""

from __future__ import annotations

import random
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message

import modelzoo
from common.content import file_sha256
from node_daemon.agent import NodeAgent
from node_daemon.inventory import GpuSpec
from node_daemon.server import NodeSettings, start_node
from protos.inference import grpc_service_pb2 as ipb
from protos.offload.v1 import node_pb2 as pb
from protos.offload.v1 import node_pb2_grpc as pb_grpc
from runtime.server import RuntimeSettings, load_model, start_server
from tests.data import TOPOLOGIES

DGX1 = TOPOLOGIES / "21_8xV100-sxm2-hybridcube-nv1nv2-1nic-driver440.txt"
TOKEN = "replica-token-for-fuzz-tests"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
CALLS_PER_RPC = 30
RAW_CALLS_PER_RPC = 10
NEVER = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)

_DOUBLES = (
    float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -1.0, 0.0, 0.5, 2.0,
)  # fmt: skip
_INTS = (0, 1, 2, 4, -1, 2**31 - 1, -(2**31), 2**53 + 1, 2**63 - 1, -(2**63))


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _delimited(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _varint(len(payload)) + payload


class Fuzzer:
    """Random requests on the wire, field by field from a message's descriptor: every value
    a field's type can carry, including those no well-behaved client sends."""

    def __init__(self, seed: int, words: Sequence[str]) -> None:
        self.rng = random.Random(seed)
        self.words = list(words)
        """Strings worth trying beside random ones: names, ids, hashes the server knows."""

    def string(self) -> bytes:
        rng = self.rng
        kind = rng.randrange(9)
        if kind < 3 and self.words:
            return rng.choice(self.words).encode()
        if kind == 3:
            return b""
        if kind == 4:
            return ("x" * rng.choice((41, 1000, 300_000))).encode()
        if kind == 5:
            return "\x1b[31m/etc/passwd\x00\n é€ 😀".encode()
        if kind == 6:
            return bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randrange(1, 8)))
        return "".join(
            rng.choice("abcdef0123456789-_.A ") for _ in range(rng.randrange(1, 70))
        ).encode()

    def value(self, field: FieldDescriptor, depth: int) -> bytes:
        rng, number, kind = self.rng, field.number, field.type
        if kind == FieldDescriptor.TYPE_DOUBLE:
            return _key(number, 1) + struct.pack("<d", rng.choice(_DOUBLES))
        if kind == FieldDescriptor.TYPE_FLOAT:
            return _key(number, 5) + struct.pack("<f", rng.choice((*_DOUBLES[:3], 0.0, 1.5)))
        if kind == FieldDescriptor.TYPE_STRING:
            return _delimited(number, self.string())
        if kind == FieldDescriptor.TYPE_BYTES:
            return _delimited(number, rng.randbytes(rng.choice((0, 4, 16, 100_000))))
        if kind == FieldDescriptor.TYPE_MESSAGE:
            return _delimited(number, self.message(field.message_type, depth + 1))
        if kind == FieldDescriptor.TYPE_BOOL:
            return _key(number, 0) + _varint(rng.choice((0, 1, 2)))
        if kind in (FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32):
            return _key(number, 5) + rng.randbytes(4)
        if kind in (FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64):
            return _key(number, 1) + rng.randbytes(8)
        # int32/64, uint32/64, sint32/64 (zigzag or not, any varint), enums
        return _key(number, 0) + _varint(rng.choice((*_INTS, rng.randrange(-1000, 1000))))

    def message(self, descriptor: Descriptor, depth: int = 0) -> bytes:
        out = bytearray()
        if depth > 3:
            return bytes(out)
        for field in descriptor.fields:
            if self.rng.random() < 0.3:
                continue
            repeated = field.label == FieldDescriptor.LABEL_REPEATED
            for _ in range(self.rng.randrange(0, 4) if repeated else 1):
                out += self.value(field, depth)
        return bytes(out)

    def raw(self) -> bytes:
        return self.rng.randbytes(self.rng.randrange(0, 200))


async def _call(
    channel: grpc.aio.Channel, service: ServiceDescriptor, method: str, requests: list[bytes]
) -> grpc.StatusCode:
    """One call with raw request bytes; its status, checked against what no input may get."""
    path = f"/{service.full_name}/{method}"
    rpc = service.methods_by_name[method]
    try:
        if rpc.client_streaming:
            await channel.stream_unary(path)(iter(requests), metadata=AUTH, timeout=60)
        else:
            await channel.unary_unary(path)(requests[0], metadata=AUTH, timeout=60)
    except grpc.aio.AioRpcError as err:
        details = err.details() or ""
        assert err.code() not in NEVER, f"{method}: {err.code().name} {details}"
        assert len(details) <= 2100 and "\x1b" not in details, f"{method}: {details[:200]}"
        return err.code()
    return grpc.StatusCode.OK


async def _fuzz(
    channel: grpc.aio.Channel,
    service: ServiceDescriptor,
    fuzzer: Fuzzer,
    state: Callable[[], Awaitable[object]],
    valid: Mapping[str, Message] = {},
) -> dict[str, dict[str, int]]:
    """Fuzz every method of `service`; after each refused call, `state()` must be unchanged.
    Half the fuzzed requests of a method in `valid` are that valid request with random
    fields merged in (protobuf merges a field given twice), to get past the first check.
    Returns how often each method answered each status."""
    seen: dict[str, dict[str, int]] = {}
    for rpc in service.methods:
        counts = seen.setdefault(rpc.name, {})
        for n in range(CALLS_PER_RPC + RAW_CALLS_PER_RPC):
            size = fuzzer.rng.randrange(1, 4) if rpc.client_streaming else 1
            if n < CALLS_PER_RPC:
                base = valid[rpc.name].SerializeToString() if rpc.name in valid else b""
                prefix = base if fuzzer.rng.random() < 0.5 else b""
                requests = [prefix + fuzzer.message(rpc.input_type) for _ in range(size)]
            else:
                requests = [fuzzer.raw() for _ in range(size)]
            before = await state()
            code = await _call(channel, service, rpc.name, requests)
            counts[code.name] = counts.get(code.name, 0) + 1
            if code is not grpc.StatusCode.OK:
                assert await state() == before, f"a refused {rpc.name} changed the state"
    return seen


def replace_spec(spec: pb.ReplicaSpec, deployment_id: str) -> pb.ReplicaSpec:
    other = pb.ReplicaSpec()
    other.CopyFrom(spec)
    other.deployment_id = deployment_id
    return other


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[grpc.aio.Channel, NodeAgent, str]]:
    settings = NodeSettings(
        listen="127.0.0.1:0",
        site="site-a",
        node_id="fuzz-node",
        state_dir=tmp_path / "state",
        topology_file=DGX1,
        gpu_spec=GpuSpec.parse("Tesla V100-SXM2-16GB:16384"),
        runtime="process",
    )
    server, port, agent = await start_node(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, agent, settings.state_dir
    finally:
        await channel.close()
        await server.stop(0)
        await agent.close(stop_replicas=True)


async def test_no_input_makes_the_node_agent_answer_unknown_or_internal(node) -> None:
    channel, agent, state_dir = node
    stub = pb_grpc.NodeAgentStub(channel)
    model = modelzoo.model_path("mlp")
    sha = file_sha256(model)
    agent.cache.put_file(model)
    spec = pb.ReplicaSpec(
        deployment_id="dep-fuzz", epoch=1, model_sha256=sha, model_name="mlp", token=TOKEN,
        gpu_count=1,
    )  # fmt: skip
    await stub.StartReplica(pb.StartReplicaRequest(spec=spec))
    gpus = [g.uuid for g in agent.inventory.gpus]
    words = [sha, "mlp", "dep-fuzz", "dep-fuzz-1", TOKEN, *gpus[:2], "dep-1", "a" * 64]

    clients_file = state_dir / "replicas" / "dep-fuzz-1" / "clients"

    async def state() -> tuple[object, ...]:
        listed = await stub.ListReplicas(pb.ListReplicasRequest(), timeout=30)
        models = sorted(p.name for p in (state_dir / "models").iterdir())
        clients = clients_file.read_text() if clients_file.exists() else None
        return tuple(r.SerializeToString() for r in listed.replicas), tuple(models), clients

    service = pb.DESCRIPTOR.services_by_name["NodeAgent"]
    valid = {
        "StartReplica": pb.StartReplicaRequest(spec=replace_spec(spec, "dep-other")),
        "UpdateResources": pb.UpdateResourcesRequest(replica_id="dep-fuzz-1", cpus=1.0),
        "StopReplica": pb.StopReplicaRequest(replica_id="dep-other-1"),
        "SetReplicaClients": pb.SetReplicaClientsRequest(
            replica_id="dep-fuzz-1",
            clients=[
                pb.ReplicaClient(client_id="c1", priority_class="standard", token_sha256=sha)
            ],
        ),
    }
    seen = await _fuzz(channel, service, Fuzzer(1, words), state, valid)
    # The fuzz reached past the first checks: the domain answered too.
    assert {"OK", "ALREADY_EXISTS"} <= set(seen["StartReplica"]), seen
    assert "NOT_FOUND" in seen["StopReplica"], seen
    assert "INVALID_ARGUMENT" in seen["SetReplicaClients"], seen
    described = await stub.Describe(pb.DescribeRequest(), timeout=10)
    assert described.node_id == "fuzz-node"


async def test_no_input_makes_the_runtime_answer_unknown_or_internal(probe_model: Path) -> None:
    settings = RuntimeSettings(model=probe_model, name="probe", token=TOKEN, port=0)
    running = await start_server(replace(settings, host="127.0.0.1"))
    await load_model(running, settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        words = ["probe", "1", "x", "k", "m", "y", "FP32", "INT64", "FP16", "BYTES"]
        service = ipb.DESCRIPTOR.services_by_name["GRPCInferenceService"]

        async def state() -> tuple[bool, int]:
            return running.state.ready, running.state.in_flight

        await _fuzz(channel, service, Fuzzer(2, words), state)
        ready = await channel.unary_unary(
            f"/{service.full_name}/ServerReady",
            request_serializer=ipb.ServerReadyRequest.SerializeToString,
            response_deserializer=ipb.ServerReadyResponse.FromString,
        )(ipb.ServerReadyRequest(), metadata=AUTH, timeout=10)
        assert ready.ready
    finally:
        await channel.close()
        await running.drain(1.0)
