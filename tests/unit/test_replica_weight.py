"""The Docker runtime's replicas' cgroup and its CPU weight (`weigh_replicas`) on fake cgroup
file systems laid out as v1 and v2 hosts mount them, the node's flag for it, and the demo's
probes of the engine. The real engine's use of it is in
tests/integration/test_runtime_priority.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import docker.errors
import pytest

from edge_client.cli import build_parser
from edge_client.demo import run as demo_run
from node_daemon.runtimes.base import RuntimeUnavailable
from node_daemon.runtimes.cgroup_limits import (
    REPLICAS_PARENT,
    CgroupUnavailable,
    shares_to_weight,
    weigh_replicas,
)
from node_daemon.runtimes.docker_runtime import weighed_parent
from node_daemon.server import settings_from_args


def test_v1_writes_the_shares_of_a_cgroup_beside_dockers(tmp_path: Path) -> None:
    (tmp_path / "cpu" / "docker").mkdir(parents=True)
    (tmp_path / "cpu" / "cpu.shares").write_text("1024\n")
    group = weigh_replicas(4096, tmp_path)
    assert group == tmp_path / "cpu" / REPLICAS_PARENT
    assert (group / "cpu.shares").read_text() == "4096"
    # Again, with another weight: the same cgroup, the new weight.
    assert weigh_replicas(2048, tmp_path) == group
    assert (group / "cpu.shares").read_text() == "2048"


def test_v2_enables_cpu_below_the_root_and_writes_the_weight(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    group = weigh_replicas(4096, tmp_path)
    assert group == tmp_path / REPLICAS_PARENT
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"
    assert (group / "cpu.weight").read_text() == "400"


@pytest.mark.parametrize(
    ("shares", "weight"), [(2, 1), (1024, 100), (4096, 400), (2598, 254), (262_144, 10_000)]
)
def test_shares_weigh_against_the_v2_default_as_against_1024(shares: int, weight: int) -> None:
    assert shares_to_weight(shares) == weight


def test_a_host_without_a_cpu_controller_or_writable_root_says_why(tmp_path: Path) -> None:
    with pytest.raises(CgroupUnavailable, match="no cgroup CPU controller"):
        weigh_replicas(4096, tmp_path)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.shares").write_text("1024\n")
    (tmp_path / "cpu" / REPLICAS_PARENT).write_text("a file where the cgroup goes\n")
    with pytest.raises(CgroupUnavailable, match="cannot weigh the replicas' cgroup"):
        weigh_replicas(4096, tmp_path)


@pytest.mark.parametrize("shares", [0, 1, 262_145, -5])
def test_shares_out_of_the_kernels_range_are_refused(tmp_path: Path, shares: int) -> None:
    with pytest.raises(ValueError, match=f"got {shares}"):
        weigh_replicas(shares, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("value", "runtime", "refused"),
    [
        ("4096", "docker", None),
        ("0", "process", None),
        ("1", "docker", "give 2 to 262144, or 0"),
        ("300000", "auto", "give 2 to 262144, or 0"),
        ("4096", "process", "not --runtime process"),
    ],
)
def test_the_replica_cpu_shares_flag(
    tmp_path: Path, value: str, runtime: str, refused: str | None
) -> None:
    flags = [
        "node", "--listen", "127.0.0.1:0", "--site", "site-a", "--state-dir", str(tmp_path),
        "--runtime", runtime, "--replica-cpu-shares", value,
    ]  # fmt: skip
    args = build_parser().parse_args(flags)
    if refused is not None:
        with pytest.raises(ValueError, match=f"--replica-cpu-shares.*{refused}"):
            settings_from_args(args)
    else:
        assert settings_from_args(args).replica_shares == int(value)


class Engine:
    """What `weighed_parent` asks of the engine: its info."""

    def __init__(self, info: dict[str, Any] | Exception) -> None:
        self._info = info

    def info(self) -> dict[str, Any]:
        if isinstance(self._info, Exception):
            raise self._info
        return self._info

    def close(self) -> None:
        self.closed = True


class Images:
    """An engine's images: `have` only."""

    def __init__(self, *have: str) -> None:
        self._have = have

    def get(self, tag: str) -> str:
        if tag not in self._have:
            raise docker.errors.ImageNotFound(f"No such image: {tag}")
        return tag


@pytest.mark.parametrize(
    ("engine", "why"),
    [
        (Engine({"CgroupDriver": "systemd"}), "needs the engine's cgroupfs cgroup driver; this "
         "engine uses 'systemd'"),
        (Engine(docker.errors.APIError("500 Server Error")), "cannot read the engine's cgroup "
         "driver: 500 Server Error"),
    ],
)  # fmt: skip
def test_an_engine_that_cannot_weigh_is_refused_with_the_reason(engine: Engine, why: str) -> None:
    with pytest.raises(RuntimeUnavailable, match=why):
        weighed_parent(engine, 4096)  # type: ignore[arg-type]


def test_the_demo_runs_unweighed_where_the_engine_cannot_weigh_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine({"CgroupDriver": "systemd"})
    monkeypatch.setattr(demo_run, "connect_docker", lambda: engine)
    said: list[str] = []
    assert demo_run.weigh_flags("docker", 4096, said.append) == []
    assert said == [
        "replicas at the engine's default CPU weight: a CPU weight for the replicas needs the "
        "engine's cgroupfs cgroup driver; this engine uses 'systemd'"
    ]
    assert engine.closed
    assert demo_run.weigh_flags("process", 4096, said.append) == []
    assert demo_run.weigh_flags("docker", 0, said.append) == []
    assert len(said) == 1


@pytest.mark.parametrize("choice", ["auto", "docker"])
def test_the_demos_engine_probe_closes_its_client_and_names_a_missing_image(
    monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    engines: list[Engine] = []

    def engine_with(*have: str) -> Engine:
        engine = Engine({})
        engine.images = Images(*have)  # type: ignore[attr-defined]
        engines.append(engine)
        return engine

    monkeypatch.setattr(demo_run, "build_image", lambda flavour, progress: "offload/rt:1")
    monkeypatch.setattr(demo_run, "connect_docker", lambda: engine_with("offload/rt:1"))
    said: list[str] = []
    assert demo_run.pick_runtime(choice, said.append) == ("docker", "offload/rt:1")
    monkeypatch.setattr(demo_run, "connect_docker", lambda: engine_with())
    if choice == "docker":
        with pytest.raises(demo_run.DemoFailed, match="--runtime docker: image offload/rt:1 is"):
            demo_run.pick_runtime(choice, said.append)
    else:
        assert demo_run.pick_runtime(choice, said.append) == ("process", "")
        assert said[0].startswith("Docker is not usable here (image offload/rt:1 is not built")
    assert [engine.closed for engine in engines] == [True, True]
