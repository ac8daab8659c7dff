"""tritonclient.grpc against the runtime in a real container, on every test model."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

import modelzoo
from edge_client.rpc.tensors import infer_request, response_arrays
from images.build import build_image
from node_daemon.runtimes import DockerRuntime, ReplicaSpec
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.batching_support import BAD_KINDS, MIXER_OUTPUTS, MixedRequest, build_mixer, send_mixed
from tests.docker_support import require_docker

pytestmark = pytest.mark.docker

PROBE = Path(__file__).resolve().parents[1] / "triton_probe.py"
TOKEN = "container-test-token"
# Zeros cannot warm these up (Silero VAD's sample rate selects a branch): give real inputs.
NEEDS_WARMUP_INPUTS = {"silero_vad"}


@pytest.fixture(scope="module")
def runtime_image() -> str:
    require_docker().close()
    return build_image("cpu", progress=lambda _line: None)


@pytest.fixture
async def docker_runtime(runtime_image: str) -> AsyncIterator[DockerRuntime]:
    runtime = DockerRuntime.connect(runtime_image)
    try:
        yield runtime
    finally:
        await runtime.close()


@pytest.mark.parametrize("name", modelzoo.ALL)
async def test_tritonclient_gets_onnxruntime_outputs(
    docker_runtime: DockerRuntime, tmp_path: Path, name: str
) -> None:
    model = modelzoo.model_path(name)
    inputs = modelzoo.sample_inputs(model, seed=7)
    inputs_file = tmp_path / "inputs.npz"
    np.savez(inputs_file, **inputs)
    spec = ReplicaSpec(
        replica_id=f"test-{name}",
        model_path=model,
        model_name=name,
        token=TOKEN,
        labels={"node": "test"},
        warmup_inputs=inputs_file if name in NEEDS_WARMUP_INPUTS else None,
    )
    replica = await docker_runtime.start(spec)
    outputs_file = tmp_path / "outputs.npz"
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(PROBE), "--url", replica.endpoint, "--model", name,
         "--inputs", str(inputs_file), "--outputs", str(outputs_file)],
        env={**os.environ, "TRITON_PROBE_TOKEN": TOKEN},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["live"] and report["server_ready"] and report["model_ready"]
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert [i["name"] for i in report["metadata"]["inputs"]] == [
        i.name for i in session.get_inputs()
    ]
    expected = dict(
        zip((o.name for o in session.get_outputs()), session.run(None, inputs), strict=True)
    )
    with np.load(outputs_file) as got:
        assert sorted(got.files) == sorted(expected)
        for output, value in expected.items():
            assert got[output].shape == value.shape, output
            assert np.allclose(got[output], value, rtol=1e-4, atol=1e-5), output
    assert await docker_runtime.stop(replica.replica_id, grace_s=5) == 0


async def test_batches_in_the_image_answer_each_request_with_its_own_outputs(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    """The image's runtime batches by default (`--max-batch-size auto`): good requests of
    several shapes and output selections, sent at once with bad ones among them, each get
    their own outputs and the bad ones INVALID_ARGUMENT, through the batcher. (Requests
    merged into one run are shown by tests/integration/test_runtime_batching.py, where a
    queue delay lets them meet.)"""
    model = build_mixer(tmp_path / "mixer.onnx")
    spec = ReplicaSpec(
        replica_id="test-batching", model_path=model, model_name=model.stem, token=TOKEN,
        labels={"node": "test"},
    )  # fmt: skip
    replica = await docker_runtime.start(spec)
    try:
        good = [
            MixedRequest(
                rows=1 + i % 3, width=2 + i % 2, outputs=MIXER_OUTPUTS[: 1 + i % 3], seed=i
            )
            for i in range(24)
        ]
        bad = [MixedRequest(rows=1, width=2, outputs=(), bad=kind, seed=99) for kind in BAD_KINDS]
        requests = [r for pair in zip(good, bad * 4, strict=False) for r in pair] + good[6:]
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        async with grpc.aio.insecure_channel(replica.endpoint) as channel:
            outcome = await send_mixed(
                pb_grpc.GRPCInferenceServiceStub(channel), model, requests, metadata
            )
        assert outcome.mismatches == []
        assert outcome.answered == sum(not r.bad for r in requests)
        # Every good request went through the batcher (one run each at most: this model
        # computes in microseconds, so a lone request runs at once on the loop, and reaches
        # the batching series a few milliseconds later).
        deadline = time.monotonic() + 30
        while True:
            page = await asyncio.to_thread(_metrics_page, replica.metrics_endpoint)
            runs = re.search(r"^offload_runtime_batch_size_count\{.*\} (\S+)$", page, re.M)
            assert runs, page
            assert float(runs.group(1)) <= outcome.answered + len(BAD_KINDS)
            if float(runs.group(1)) > 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert float(runs.group(1)) > 0, page
        client = require_docker()
        try:
            logs = client.containers.get(replica.ref).logs().decode()
        finally:
            client.close()
        assert "batches: up to" in logs, logs
    finally:
        assert await docker_runtime.stop(replica.replica_id, grace_s=5) == 0


def _metrics_page(endpoint: str) -> str:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
        return response.read().decode()


async def test_host_network_replica_listens_where_it_logs(runtime_image: str) -> None:
    runtime = DockerRuntime.connect(runtime_image, network="host")
    model = modelzoo.model_path("mlp")
    try:
        replica = await runtime.start(ReplicaSpec("test-host-net", model, "mlp", TOKEN))
        host, port = replica.endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) != 8001
        async with grpc.aio.insecure_channel(replica.endpoint) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = infer_request("mlp", modelzoo.sample_inputs(model))
            response = await stub.ModelInfer(
                request, metadata=(("authorization", f"Bearer {TOKEN}"),)
            )
        assert response_arrays(response)["logits"].shape == (1, 10)
    finally:
        await runtime.close()


def test_unknown_network_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown network 'overlay'"):
        DockerRuntime("image", client=None, network="overlay")  # type: ignore[arg-type]
