"""The runtime server over real gRPC sockets on loopback, in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from edge_client.rpc.tensors import infer_request, response_arrays
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from runtime.errors import ModelLoadError
from runtime.server import RunningServer, RuntimeSettings, load_model, start_server

TOKEN = "s3cret-token-for-tests"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def settings_for(model: Path, **overrides: object) -> RuntimeSettings:
    base = RuntimeSettings(model=model, name="probe", token=TOKEN, host="127.0.0.1", port=0)
    return replace(base, **overrides)


@pytest.fixture
async def served(
    probe_model: Path,
) -> AsyncIterator[tuple[RunningServer, pb_grpc.GRPCInferenceServiceStub]]:
    settings = settings_for(probe_model)
    running = await start_server(settings)
    await load_model(running, settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield running, pb_grpc.GRPCInferenceServiceStub(channel)
    finally:
        await channel.close()
        await running.drain(1.0)


def raw_request(inputs: dict[str, np.ndarray], **fields: object) -> pb.ModelInferRequest:
    request = infer_request("probe", inputs)
    for key, value in fields.items():
        setattr(request, key, value)
    return request


async def test_raw_inference_returns_every_output(served, probe_inputs) -> None:
    _, stub = served
    response = await stub.ModelInfer(raw_request(probe_inputs, id="req-1"), metadata=AUTH)
    got = response_arrays(response)
    assert response.id == "req-1"
    assert [o.name for o in response.outputs] == ["y", "z", "h"]
    np.testing.assert_array_equal(got["y"], probe_inputs["x"] * 2)
    np.testing.assert_array_equal(got["z"], probe_inputs["k"] + 1)
    np.testing.assert_array_equal(got["h"], probe_inputs["m"])


async def test_requested_outputs_come_in_the_order_asked(served, probe_inputs) -> None:
    _, stub = served
    request = raw_request(probe_inputs)
    request.outputs.add(name="z")
    request.outputs.add(name="y")
    response = await stub.ModelInfer(request, metadata=AUTH)
    assert [o.name for o in response.outputs] == ["z", "y"]
    np.testing.assert_array_equal(response_arrays(response)["z"], [6, 8])


async def test_typed_contents_only(probe_model: Path) -> None:
    # The same inference with typed contents for every input of a model without FP16.
    from onnx import TensorProto, helper, save

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["y"])],
        "square",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = probe_model.with_name("square.onnx")
    save(model, path)
    settings = settings_for(path, name="square")
    running = await start_server(settings)
    await load_model(running, settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = pb.ModelInferRequest(model_name="square")
            x = request.inputs.add(name="x", datatype="FP32", shape=[1, 3])
            x.contents.fp32_contents.extend([1.0, 2.0, 3.0])
            response = await stub.ModelInfer(request, metadata=AUTH)
            y = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
            np.testing.assert_array_equal(y, [1.0, 4.0, 9.0])
    finally:
        await running.drain(1.0)


async def test_metadata_describes_dynamic_dims(served) -> None:
    _, stub = served
    meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="probe"), metadata=AUTH)
    assert meta.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("x", "FP32", [-1, 4]),
        ("k", "INT64", [-1]),
        ("m", "FP16", [2, 2]),
    ]
    ready = await stub.ModelReady(pb.ModelReadyRequest(name="probe"), metadata=AUTH)
    assert ready.ready
    other = await stub.ModelReady(pb.ModelReadyRequest(name="other"), metadata=AUTH)
    assert not other.ready


def _mutate(fn: Callable[[pb.ModelInferRequest], None]) -> Callable[[dict], pb.ModelInferRequest]:
    def build(inputs: dict[str, np.ndarray]) -> pb.ModelInferRequest:
        request = raw_request(inputs)
        fn(request)
        return request

    return build


def _with(**changes: object) -> Callable[[dict], pb.ModelInferRequest]:
    def build(inputs: dict[str, np.ndarray]) -> pb.ModelInferRequest:
        return raw_request({**inputs, **changes})

    return build


def _without(name: str) -> Callable[[dict], pb.ModelInferRequest]:
    return lambda inputs: raw_request({k: v for k, v in inputs.items() if k != name})


def _set_input(index: int, **fields: object) -> Callable[[pb.ModelInferRequest], None]:
    def change(request: pb.ModelInferRequest) -> None:
        for key, value in fields.items():
            if key == "shape":
                del request.inputs[index].shape[:]
                request.inputs[index].shape.extend(value)
            else:
                setattr(request.inputs[index], key, value)

    return change


def _typed_fp16(request: pb.ModelInferRequest) -> None:
    del request.raw_input_contents[:]
    request.inputs[0].contents.fp32_contents.extend([0.0] * 8)
    request.inputs[1].contents.int64_contents.extend([1, 2])


def _typed_short(request: pb.ModelInferRequest) -> None:
    del request.raw_input_contents[:]
    del request.inputs[2]
    request.inputs[0].contents.fp32_contents.extend([0.0] * 7)
    request.inputs[1].contents.int64_contents.extend([1, 2])


def _both(request: pb.ModelInferRequest) -> None:
    request.inputs[1].contents.int64_contents.extend([1, 2])


BAD_REQUESTS = {
    "unknown input": (_with(q=np.zeros(1, np.float32)), "INVALID_ARGUMENT", "unknown input 'q'"),
    "missing input": (_without("k"), "INVALID_ARGUMENT", "missing input(s): k (INT64 [-1])"),
    "duplicate input": (
        _mutate(
            lambda r: (
                r.inputs.add(name="k", datatype="INT64", shape=[2]),
                r.raw_input_contents.append(bytes(16)),
            )
        ),
        "INVALID_ARGUMENT",
        "'k' is given more than once",
    ),
    "wrong datatype": (
        _with(x=np.zeros((2, 4), np.float64)),
        "INVALID_ARGUMENT",
        "input 'x' has datatype 'FP64'; the model expects FP32",
    ),
    "unknown datatype": (
        _mutate(_set_input(0, datatype="FLOAT")),
        "INVALID_ARGUMENT",
        "input 'x' has datatype 'FLOAT'; the model expects FP32",
    ),
    "wrong rank": (
        _with(x=np.zeros((2, 4, 1), np.float32)),
        "INVALID_ARGUMENT",
        "input 'x' has shape [2, 4, 1] of rank 3; the model expects [-1, 4]",
    ),
    "wrong fixed dim": (
        _with(x=np.zeros((2, 5), np.float32)),
        "INVALID_ARGUMENT",
        "input 'x' has size 5 in dimension 1",
    ),
    "negative dim": (
        _mutate(_set_input(1, shape=[-2])),
        "INVALID_ARGUMENT",
        "negative size",
    ),
    "raw length": (
        _mutate(_set_input(0, shape=[1, 4])),
        "INVALID_ARGUMENT",
        "input 'x' has 32 bytes of raw contents; shape [1, 4] of FP32 needs 16",
    ),
    "raw count": (
        _mutate(lambda r: r.raw_input_contents.pop()),
        "INVALID_ARGUMENT",
        "2 raw_input_contents for 3 inputs",
    ),
    "raw bytes short": (
        _mutate(lambda r: r.raw_input_contents.__setitem__(0, bytes(31))),
        "INVALID_ARGUMENT",
        "input 'x' has 31 bytes of raw contents; shape [2, 4] of FP32 needs 32",
    ),
    "raw and typed": (_mutate(_both), "INVALID_ARGUMENT", "use one or the other"),
    "typed count": (
        _mutate(_typed_short),
        "INVALID_ARGUMENT",
        "input 'x' has 7 values in its typed contents; shape [2, 4] needs 8",
    ),
    "typed fp16": (_mutate(_typed_fp16), "INVALID_ARGUMENT", "send it as raw_input_contents"),
    "shared dim": (
        _with(k=np.zeros(3, np.int64)),
        "INVALID_ARGUMENT",
        "inputs 'x' and 'k' disagree on dimension 'N': 2 and 3",
    ),
    "unknown output": (
        _mutate(lambda r: r.outputs.add(name="nope")),
        "INVALID_ARGUMENT",
        "unknown output 'nope'",
    ),
    "unknown model": (
        _mutate(lambda r: setattr(r, "model_name", "other")),
        "NOT_FOUND",
        "model 'other' version '(any)' is not served here",
    ),
    "unknown version": (
        _mutate(lambda r: setattr(r, "model_version", "7")),
        "NOT_FOUND",
        "version '7'",
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
@pytest.mark.parametrize("planned", [False, True], ids=["first", "after-a-good-one"])
async def test_bad_request_is_refused_and_server_keeps_serving(
    served, probe_inputs, case, planned: bool
) -> None:
    """`planned`: a good request went first, so the server has a plan for its header (the
    fast path, `runtime.rpc.plans`); a bad request is refused alike either way."""
    build, code, message = case
    _, stub = served
    if planned:
        await stub.ModelInfer(raw_request(probe_inputs), metadata=AUTH)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(build(probe_inputs), metadata=AUTH)
    assert caught.value.code().name == code
    assert message in caught.value.details()
    response = await stub.ModelInfer(raw_request(probe_inputs), metadata=AUTH)
    assert len(response.outputs) == 3


async def test_a_repeated_request_shape_is_answered_alike_without_parsing(
    served, probe_inputs
) -> None:
    """The first request of a shape takes the full path and makes a plan; the next ones,
    other values and ids with the same header or not, take the plan (or the full path) and
    are answered with what the full path would send, byte for byte."""
    running, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        rng = np.random.default_rng(7)
        for step in range(6):
            inputs = {
                "x": rng.standard_normal((2, 4)).astype(np.float32),
                "k": rng.integers(-9, 9, 2),
                "m": rng.standard_normal((2, 2)).astype(np.float16),
            }
            # An odd-length name shifts every raw entry off its alignment.
            request = infer_request("probe", inputs, request_id="odd" if step % 2 else "ev")
            raw = await infer(request.SerializeToString(), metadata=AUTH)
            response = pb.ModelInferResponse.FromString(raw)
            got = response_arrays(response)
            assert response.id == request.id and response.model_name == "probe"
            np.testing.assert_array_equal(got["y"], inputs["x"] * 2)
            np.testing.assert_array_equal(got["z"], inputs["k"] + 1)
            np.testing.assert_array_equal(got["h"], inputs["m"])
            assert raw == response.SerializeToString()


@pytest.mark.parametrize(
    ("metadata", "message"),
    [((), "missing authorization"), ((("authorization", "Bearer wrong"),), "invalid token")],
    ids=["missing", "wrong"],
)
async def test_token_is_required_except_for_liveness(
    served, probe_inputs, metadata, message
) -> None:
    _, stub = served
    for call in (
        stub.ModelInfer(raw_request(probe_inputs), metadata=metadata),
        stub.ServerReady(pb.ServerReadyRequest(), metadata=metadata),
        stub.ModelMetadata(pb.ModelMetadataRequest(name="probe"), metadata=metadata),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert message in caught.value.details()
    live = await stub.ServerLive(pb.ServerLiveRequest(), metadata=metadata)
    assert live.live


async def test_request_over_size_limit_is_resource_exhausted(probe_model: Path) -> None:
    settings = settings_for(probe_model, max_message_bytes=64 * 1024)
    running = await start_server(settings)
    await load_model(running, settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            big = {
                "x": np.zeros((4096, 4), np.float32),
                "k": np.zeros(4096, np.int64),
                "m": np.zeros((2, 2), np.float16),
            }
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfer(raw_request(big), metadata=AUTH)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            small = {k: v[:2] if k != "m" else v for k, v in big.items()}
            assert len((await stub.ModelInfer(raw_request(small), metadata=AUTH)).outputs) == 3
    finally:
        await running.drain(1.0)


async def test_not_ready_until_loaded_and_warm(probe_model: Path, probe_inputs) -> None:
    settings = settings_for(probe_model)
    running = await start_server(settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert (await stub.ServerLive(pb.ServerLiveRequest())).live
            assert not (await stub.ServerReady(pb.ServerReadyRequest(), metadata=AUTH)).ready
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfer(raw_request(probe_inputs), metadata=AUTH)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in caught.value.details()
            await load_model(running, settings)
            assert (await stub.ServerReady(pb.ServerReadyRequest(), metadata=AUTH)).ready
    finally:
        await running.drain(1.0)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((2, 5), np.float32)}, "input 'x' has size 5 in dimension 1"),
        (None, "not a readable .npz file"),
    ],
    ids=["wrong shape", "not npz"],
)
async def test_bad_warmup_inputs_keep_the_server_unready(
    probe_model: Path, probe_inputs, tmp_path: Path, arrays, message
) -> None:
    path = tmp_path / "warmup.npz"
    if arrays is None:
        path.write_text("not an archive")
    else:
        np.savez(path, **{**probe_inputs, **arrays})
    settings = settings_for(probe_model, warmup_inputs=path)
    running = await start_server(settings)
    try:
        with pytest.raises(ModelLoadError, match=message):
            await load_model(running, settings)
        assert not running.state.ready
    finally:
        await running.drain(1.0)


async def test_warmup_inputs_make_a_picky_model_ready(tmp_path: Path) -> None:
    # Silero VAD takes its 8 kHz branch on a zero sample rate and fails: zeros cannot warm
    # it up, its real inputs can.
    import modelzoo

    model = modelzoo.model_path("silero_vad")
    settings = settings_for(model, name="silero_vad")
    running = await start_server(settings)
    try:
        with pytest.raises(ModelLoadError, match="--warmup-inputs"):
            await load_model(running, settings)
    finally:
        await running.drain(1.0)
    path = tmp_path / "warmup.npz"
    np.savez(path, **modelzoo.sample_inputs(model))
    settings = settings_for(model, name="silero_vad", warmup_inputs=path)
    running = await start_server(settings)
    try:
        await load_model(running, settings)
        assert running.state.ready
    finally:
        await running.drain(1.0)


@pytest.mark.parametrize(
    ("metadata", "code"),
    [((), grpc.StatusCode.UNAUTHENTICATED), (AUTH, grpc.StatusCode.INVALID_ARGUMENT)],
    ids=["no-token", "token"],
)
async def test_garbage_bytes_are_refused_token_first(served, metadata, code) -> None:
    running, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await infer(b"\xff\xff\xff\x0f garbage", metadata=metadata)
        assert caught.value.code() == code
        unknown = channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await unknown(b"", metadata=AUTH)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize(("inline_below_ms", "inline"), [(0.0, False), (1e6, True)])
async def test_inline_or_threads_by_measured_compute_time(
    probe_model: Path, probe_inputs, caplog, inline_below_ms: float, inline: bool
) -> None:
    settings = settings_for(probe_model, inline_below_ms=inline_below_ms)
    running = await start_server(settings)
    with caplog.at_level("INFO", logger="runtime.server"):
        await load_model(running, settings)
    try:
        assert running.state.inline is inline
        assert running.state.compute_s > 0
        said = "runs inline on the event loop" if inline else "runs in 2 worker thread(s)"
        assert said in caplog.text
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            replies = await asyncio.gather(
                *(stub.ModelInfer(raw_request(probe_inputs), metadata=AUTH) for _ in range(8))
            )
        for reply in replies:
            np.testing.assert_array_equal(response_arrays(reply)["y"], probe_inputs["x"] * 2)
    finally:
        await running.drain(1.0)
