"""tritonclient.grpc against the runtime in a real container, on every test model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import modelzoo
from images.build import build_image
from node_daemon.runtimes import DockerRuntime, ReplicaSpec
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
         "--token", TOKEN, "--inputs", str(inputs_file), "--outputs", str(outputs_file)],
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
