"""The device role installs small and works: `pip install edge-offload` (no extra) of this
checkout in a fresh virtual environment gives the SDK with grpcio, protobuf and numpy only;
from that environment the SDK uploads, deploys, infers and deletes on a real cluster (a broker
and a node daemon on the process runtime, started with this test run's full install), a local
model asks for the 'local' extra, and `offload` names the extra a server command needs.

The install takes its packages from the index pip is configured with (PyPI), through pip's
cache; without a reachable index the test is skipped, and fails under CI=true.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tomllib
import venv
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import onnxruntime as ort
import pytest

import modelzoo
from tests.cluster_support import THREE_NODES, Cluster

ROOT = Path(__file__).resolve().parents[2]

ALLOWED_DISTRIBUTIONS = {
    "edge-offload",
    "grpcio",
    "protobuf",
    "numpy",
    "typing-extensions",  # grpcio's
    "pip",
    "setuptools",  # what `python -m venv` itself puts there
}
ABSENT = (
    "docker", "psycopg", "sumo", "traci", "sumolib", "pynvml", "cryptography", "aiohttp",
    "yaml", "rich", "networkx", "onnx", "onnxruntime", "prometheus_client", "uvloop",
)  # fmt: skip

DEVICE_SCRIPT = """
import json, sys
from pathlib import Path

import numpy as np

import edge_client.adaptive, edge_client.local, edge_client.observer, edge_client.rpc.tensors
from edge_client.client import SyncOffloadClient
from edge_client.errors import InvalidInput

broker, key_file, model, inputs_file, outputs_file = sys.argv[1:]
key = Path(key_file).read_text().strip()
inputs = dict(np.load(inputs_file))
with SyncOffloadClient(broker, key) as client:
    sha = client.upload_model(Path(model))
    deployment = client.deploy(sha, "mlp", site="site-a")
    outputs = client.infer(inputs)
    deleted = client.delete(deployment.deployment_id)
np.savez(outputs_file, **outputs)
try:
    SyncOffloadClient(broker, key, local_model=model).close()
    local = "loaded"
except InvalidInput as err:
    local = str(err)
print(json.dumps({
    "node": deployment.node_id,
    "deleted": deleted,
    "local": local,
    "modules": sorted({name.partition(".")[0] for name in sys.modules}),
    "edge_client": edge_client.adaptive.__file__,
}))
"""


def _index_reachable() -> str | None:
    """Why no package index can be reached from here, or None when one can."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    parts = urlsplit(index)
    host, port = parts.hostname or "pypi.org", parts.port or 443
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as err:
        return f"no package index reachable ({host}:{port}: {err})"
    return None


def _run(
    argv: list[str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`argv` in a clean environment: nothing of this checkout or its .venv on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def device_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with `pip install <a copy of this checkout>`, no extra.
    A copy: the build writes build/ and *.egg-info where it runs, and the checkout is shared."""
    reason = _index_reachable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the device install needs a package index under CI=true: {reason}")
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("device-role")
    source = root / "source"
    source.mkdir()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        shutil.copytree(
            ROOT / package,
            source / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=True, symlinks=True)
    python = env_dir / "bin" / "python"
    done = _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(source),
        ],
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return python


def test_the_device_role_installs_the_sdk_and_nothing_of_the_servers(device_venv: Path) -> None:
    listed = _run([str(device_venv), "-m", "pip", "list", "--format", "json"], timeout=120)
    assert listed.returncode == 0, listed.stderr
    installed = {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}
    assert {"edge-offload", "grpcio", "protobuf", "numpy"} <= installed
    assert installed <= ALLOWED_DISTRIBUTIONS, installed - ALLOWED_DISTRIBUTIONS
    probe = (
        "import importlib.util, json, sys; import edge_client.client; "
        f"print(json.dumps([m for m in {list(ABSENT)!r} if importlib.util.find_spec(m)]))"
    )
    found = _run([str(device_venv), "-c", probe], timeout=120, cwd=device_venv.parent)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout) == []


def test_offload_names_the_extra_a_server_command_needs(device_venv: Path) -> None:
    offload = str(device_venv.parent / "offload")
    done = _run([offload, "broker", "--listen", "127.0.0.1:0"], timeout=120)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("offload broker needs the 'server' extra"), done.stderr
    assert done.stderr.endswith("pip install 'edge-offload[server]'\n")
    listing = _run([offload, "--help"], timeout=120)
    assert listing.returncode == 0, listing.stderr
    assert "(needs pip install 'edge-offload[server]')" in listing.stdout


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_broker()
        await cluster.start_node(THREE_NODES[0])
        yield cluster
    finally:
        await cluster.stop()


async def test_the_sdk_from_the_device_role_infers_on_a_real_cluster(
    device_venv: Path, cluster: Cluster, tmp_path: Path
) -> None:
    model = modelzoo.model_path("mlp")
    inputs = modelzoo.sample_inputs(model, batch=2)
    np.savez(tmp_path / "inputs.npz", **inputs)
    key_file = tmp_path / "alice.key"
    key_file.write_text(cluster.api_keys["alice"] + "\n")
    script = tmp_path / "device.py"
    script.write_text(DEVICE_SCRIPT)
    argv = [
        str(device_venv), str(script), cluster.broker_address, str(key_file), str(model),
        str(tmp_path / "inputs.npz"), str(tmp_path / "outputs.npz"),
    ]  # fmt: skip
    done = await asyncio.to_thread(_run, argv, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["node"] == "node-a"
    assert report["deleted"] is True
    assert "pip install 'edge-offload[local]'" in report["local"], report["local"]
    # The SDK ran from the device's environment, not from this checkout.
    assert Path(report["edge_client"]).is_relative_to(device_venv.parent.parent)
    assert not set(ABSENT) & set(report["modules"])
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    expected = dict(zip(names, session.run(names, inputs), strict=True))
    outputs = dict(np.load(tmp_path / "outputs.npz"))
    assert outputs.keys() == expected.keys()
    for name, array in expected.items():
        np.testing.assert_allclose(outputs[name], array, rtol=1e-5, atol=1e-6)
