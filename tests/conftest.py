"""Fixtures shared by every test: leak checks and small models built for the checks."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import docker
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from node_daemon.runtimes.base import LABEL_PREFIX, RuntimeUnavailable
from node_daemon.runtimes.docker_runtime import connect_docker
from tests import cluster_support
from tests.pg_support import broker_state, postgresql_server, postgresql_url  # noqa: F401

# Every container we start carries offload.replica (and offload.node where a node runs it).
LABEL = f"{LABEL_PREFIX}replica"
# ... and offload.secrets, the folder of its token: under the temp folder of whoever ran it.
SECRETS_LABEL = f"{LABEL_PREFIX}secrets"
_RUN_TEMP = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """Give this run a temp folder of its own (TMPDIR, inherited by every child), so the leak
    checks below see only what this run made: a demo or a second test run on the same
    machine is neither reported nor removed. pytest's own tmp_path stays in the system's."""
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    run_temp = Path(tempfile.mkdtemp(prefix="edge-offload-tests-"))
    config.stash[_RUN_TEMP] = run_temp
    os.environ["TMPDIR"] = tempfile.tempdir = str(run_temp)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(config.stash[_RUN_TEMP], ignore_errors=True)


@pytest.fixture(autouse=True)
def _clusters_on_postgresql(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With OFFLOAD_TEST_STATE=postgresql (`make test-postgresql`), every test cluster whose
    test does not choose a backend keeps its broker's state in a fresh PostgreSQL database."""
    backend = os.environ.get("OFFLOAD_TEST_STATE", "sqlite")
    if backend not in ("sqlite", "postgresql"):
        pytest.fail(f"OFFLOAD_TEST_STATE={backend[:20]!r}: use sqlite or postgresql")
    if backend == "postgresql":
        monkeypatch.setattr(
            cluster_support, "DEFAULT_STATE", str(request.getfixturevalue("postgresql_url"))
        )


@pytest.fixture(autouse=True)
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves asyncio tasks running behind it."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)
    current = asyncio.current_task()
    leaked = [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]
    for task in leaked:
        task.cancel()
    assert not leaked, f"test left asyncio tasks running: {[t.get_name() for t in leaked]}"


@pytest.fixture(scope="session")
def _docker_or_none() -> Iterator[docker.DockerClient | None]:
    try:
        client = connect_docker()
    except RuntimeUnavailable:
        yield None
        return
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _no_leaked_containers(
    _docker_or_none: docker.DockerClient | None,
    tmp_path_factory: pytest.TempPathFactory,
    pytestconfig: pytest.Config,
) -> Iterator[None]:
    """Fail a test that leaves containers with our labels behind (and remove them): those
    of this run, whose token folder lies in its temp folder or under its tmp_path."""
    if _docker_or_none is None:
        yield
        return
    client = _docker_or_none
    roots = tuple(
        f"{root}{os.sep}"
        for root in (pytestconfig.stash[_RUN_TEMP], tmp_path_factory.getbasetemp())
    )

    def ours() -> set[str]:
        return {
            c.id
            for c in client.containers.list(all=True, filters={"label": LABEL})
            if c.labels.get(SECRETS_LABEL, "").startswith(roots)
        }

    before = ours()
    yield
    leaked = ours() - before
    for container_id in leaked:
        client.containers.get(container_id).remove(force=True)
    assert not leaked, f"test left {len(leaked)} container(s) labelled {LABEL} behind"


@pytest.fixture(autouse=True)
def _no_leaked_temp_dirs() -> Iterator[None]:
    """Fail a test that leaves a replica's or the demo's folder (`offload-*`) in the temp dir
    (this run's own, see `pytest_configure`) and remove it."""
    root = Path(tempfile.gettempdir())
    before = set(root.glob("offload-*"))
    yield
    leaked = set(root.glob("offload-*")) - before
    for path in leaked:
        shutil.rmtree(path, ignore_errors=True)
    assert not leaked, f"test left {sorted(map(str, leaked))} behind"


@pytest.fixture(scope="session")
def probe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with the input variety the checks need.

    Inputs: `x` FP32 [N, 4] (N dynamic, named), `k` INT64 [N] (same N), `m` FP16 [2, 2].
    Outputs: `y` = x * 2 (FP32 [N, 4]), `z` = k + 1 (INT64 [N]), `h` = m (FP16 [2, 2]).
    """
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "two"], ["y"]),
            helper.make_node("Add", ["k", "one"], ["z"]),
            helper.make_node("Identity", ["m"], ["h"]),
        ],
        "probe",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("k", TensorProto.INT64, ["N"]),
            helper.make_tensor_value_info("m", TensorProto.FLOAT16, [2, 2]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("z", TensorProto.INT64, ["N"]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT16, [2, 2]),
        ],
        initializer=[
            helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
            helper.make_tensor("one", TensorProto.INT64, [], [1]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = tmp_path_factory.mktemp("models") / "probe.onnx"
    onnx.save(model, path)
    return path


@pytest.fixture
def probe_inputs() -> dict[str, np.ndarray]:
    return {
        "x": np.arange(8, dtype=np.float32).reshape(2, 4),
        "k": np.array([5, 7], dtype=np.int64),
        "m": np.eye(2, dtype=np.float16),
    }
