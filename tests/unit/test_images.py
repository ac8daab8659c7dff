"""The runtime image's build inputs: tags, pins, wheel cache, build context and its hash.

Tests that resolve the requirements against the package index need the network; they are
marked `needs_network` and skipped with EDGE_OFFLOAD_OFFLINE=1. Everything else runs offline and
without a Docker engine.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from images import build
from images.build import (
    VARIANTS,
    ImageBuildError,
    assemble_context,
    canonical_name,
    context_hash,
    download_wheels,
    image_tag,
    read_pins,
    register_cli,
    requirements_file,
    runtime_image_tag,
)

needs_network = pytest.mark.skipif(
    os.environ.get("EDGE_OFFLOAD_OFFLINE") == "1",
    reason="needs the package index (EDGE_OFFLOAD_OFFLINE=1)",
)

ARCH = platform.machine()


def write_wheel(directory: Path, name: str, version: str, platform_tag: str = "any") -> Path:
    """A minimal wheel file (a valid zip) named as pip would name it."""
    python_tag = "py3-none" if platform_tag == "any" else "cp311-cp311"
    path = directory / f"{name.replace('-', '_')}-{version}-{python_tag}-{platform_tag}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\n")
    return path


def write_pinned_wheels(directory: Path, variant: str) -> set[str]:
    directory.mkdir(parents=True, exist_ok=True)
    pins = read_pins(requirements_file(variant))
    return {write_wheel(directory, name, version).name for name, version in pins.items()}


# --- tags and pins ---------------------------------------------------------------------------


def test_image_tags_carry_the_package_version() -> None:
    version = importlib.metadata.version("edge-offload")
    assert runtime_image_tag("cpu") == image_tag("cpu") == f"edge-offload/runtime:{version}"
    assert runtime_image_tag("cuda") == f"edge-offload/runtime:{version}-cuda"
    assert image_tag("broker") == f"edge-offload/broker:{version}"
    for variant in ("rocm", "broker"):  # the broker image is no runtime image
        with pytest.raises(ImageBuildError, match=f"unknown image variant '{variant}'"):
            runtime_image_tag(variant)
    with pytest.raises(ImageBuildError, match="unknown image variant 'rocm'"):
        image_tag("rocm")


def test_variants_share_their_common_pins() -> None:
    cpu = read_pins(requirements_file("cpu"))
    cuda = read_pins(requirements_file("cuda"))
    broker = read_pins(requirements_file("broker"))
    assert cuda["onnxruntime-gpu"] == cpu["onnxruntime"]
    assert "onnxruntime" not in cuda
    assert not any(name.startswith("onnxruntime") for name in broker)
    for other in (cuda, broker):
        for name in set(cpu) & set(other):
            assert cpu[name] == other[name], name
    for name in ("grpcio", "protobuf", "numpy"):
        assert cpu[name] == cuda[name] == broker[name]


def test_read_pins_rejects_unpinned_requirements(tmp_path: Path) -> None:
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# comment\nOnnxRuntime_GPU[cuda,cudnn]==1.0  # ok\n\nnumpy>=2\n")
    with pytest.raises(ImageBuildError, match=r"requirements.txt:4: expected `name==version`"):
        read_pins(requirements)
    requirements.write_text("OnnxRuntime_GPU[cuda,cudnn]==1.0  # ok\n")
    assert read_pins(requirements) == {"onnxruntime-gpu": "1.0"}


def test_wheel_platforms_stop_at_the_base_image_glibc() -> None:
    platforms = build.wheel_platforms("x86_64")
    assert "manylinux_2_36_x86_64" in platforms
    assert "manylinux_2_37_x86_64" not in platforms
    assert {"manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64"} <= set(
        platforms
    )


# --- wheel cache ------------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_complete_wheel_cache_needs_no_pip_and_drops_stale_wheels(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = cache / "wheels" / "cpu"
    expected = write_pinned_wheels(directory, "cpu")
    write_wheel(directory, "numpy", "1.26.0")  # an older pin
    write_wheel(directory, "grpcio", read_pins(requirements_file("cpu"))["grpcio"], "linux_armv7l")
    (directory / "onnxruntime-0.0.1-py3-none-any.whl").write_bytes(b"truncated download")

    def no_pip(command: list[str], **_: object) -> None:
        raise AssertionError(f"ran {command}")

    monkeypatch.setattr(build, "_run", no_pip)
    messages: list[str] = []
    assert download_wheels("cpu", progress=messages.append) == directory
    assert {path.name for path in directory.iterdir()} == expected
    pins = len(read_pins(requirements_file("cpu")))
    assert any(f"all {pins} pinned wheels are cached" in message for message in messages)


def test_missing_wheels_are_downloaded_for_the_image_interpreter(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []

    def fake_pip(command: list[str], **_: object) -> None:
        commands.append(command)
        write_pinned_wheels(cache / "wheels" / "cuda", "cuda")

    monkeypatch.setattr(build, "_run", fake_pip)
    directory = download_wheels("cuda", progress=lambda _: None)
    (command,) = commands
    text = shlex.join(command)
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    for option in (
        "--no-deps",
        "--only-binary=:all:",
        "--implementation cp",
        "--python-version 3.11",
        "--abi cp311",
        f"--platform manylinux_2_28_{ARCH}",
        f"--platform manylinux2014_{ARCH}",
        f"--dest {directory}",
        f"--requirement {requirements_file('cuda')}",
    ):
        assert option in text


def test_wheels_pip_did_not_provide_are_reported(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "_run", lambda command, **_: None)
    with pytest.raises(ImageBuildError, match=r"no usable .* wheel for: .*onnxruntime"):
        download_wheels("cpu", progress=lambda _: None)


# --- build context and content hash -----------------------------------------------------------


def build_context(tmp_path: Path, variant: str) -> Path:
    """The build context of `variant`, with stand-in wheels."""
    wheels = tmp_path / "wheels"
    write_pinned_wheels(wheels, variant)
    context = tmp_path / "context"
    context.mkdir()
    assemble_context(variant, wheels, context)
    return context


@pytest.fixture
def context(tmp_path: Path) -> Path:
    """The cpu build context."""
    return build_context(tmp_path, "cpu")


def test_context_holds_the_application_sources_only(context: Path) -> None:
    app_files = sorted(path for path in (context / "app").rglob("*") if path.is_file())
    relative = {path.relative_to(context / "app").as_posix() for path in app_files}
    assert {"runtime/__init__.py", "protos/__init__.py"} <= relative
    assert all(path.suffix in (".py", ".pyi") for path in app_files)
    assert not any("__pycache__" in name for name in relative)
    assert (context / "requirements.txt").read_bytes() == requirements_file("cpu").read_bytes()
    for path in context.rglob("*"):
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path


def test_the_broker_context_holds_its_packages_and_ops_page(tmp_path: Path) -> None:
    context = build_context(tmp_path, "broker")
    relative = {
        path.relative_to(context / "app").as_posix()
        for path in (context / "app").rglob("*")
        if path.is_file()
    }
    packages = {name.split("/")[0] for name in relative}
    assert packages == {"broker", "common", "migration", "protos", "runtime"}
    assert {"broker/__main__.py", "broker/ops/static/index.html"} <= relative
    static = {n for n in relative if n.startswith("broker/ops/static/")}
    expected = {
        path.relative_to(build.REPO_ROOT).as_posix()
        for path in (build.REPO_ROOT / "broker/ops/static").rglob("*")
        if path.is_file()
    }
    assert static == expected
    assert all(n.endswith((".py", ".pyi")) for n in relative - static)
    assert (context / "requirements.txt").read_bytes() == requirements_file("broker").read_bytes()


def _dockerfile_instructions(dockerfile: Path) -> list[list[str]]:
    """The instructions of a Dockerfile as word lists, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = (line.strip() for line in text.splitlines())
    return [line.split() for line in lines if line and not line.startswith("#")]


def test_dockerfile_copies_only_what_the_context_holds(context: Path) -> None:
    instructions = _dockerfile_instructions(context / "Dockerfile")
    copies = [words[1:] for words in instructions if words[0] == "COPY"]
    assert copies
    for arguments in copies:
        if any(argument.startswith("--from=") for argument in arguments):
            continue
        sources = [argument for argument in arguments if not argument.startswith("--")][:-1]
        for source in sources:
            assert (context / source).exists(), f"COPY {source}: not in the build context"
    stages = {words[3] for words in instructions if words[0] == "FROM" and len(words) == 4}
    assert {f"variant-{variant}" for variant in VARIANTS} <= stages


def test_dockerfile_contract(context: Path) -> None:
    instructions = [" ".join(words) for words in _dockerfile_instructions(context / "Dockerfile")]
    assert instructions[0] == "ARG BASE=edge-offload/base:bookworm"
    assert "FROM ${BASE} AS venv" in instructions
    assert instructions[-2:] == ["USER 10001:10001", "WORKDIR /app"]
    # Each image's entry point and ports are set in its own stage.
    stages: dict[str, list[str]] = {}
    for line in instructions:
        if line.startswith("FROM "):
            stages[line.split()[-1]] = []
        elif stages:
            stages[list(stages)[-1]].append(line)
    assert stages["runtime"] == [
        "EXPOSE 8001 8002",  # inference, and the runtime's metrics
        'ENTRYPOINT ["/opt/venv/bin/python", "-m", "runtime.server"]',
    ]
    broker = stages["variant-broker"]
    assert broker[-3:] == [
        "VOLUME /var/lib/edge-offload",
        "EXPOSE 7000 8080",
        'ENTRYPOINT ["/opt/venv/bin/python", "-m", "broker"]',
    ]
    assert any("useradd --uid 10001" in line and line.endswith("offload") for line in instructions)


def _mutations() -> dict[str, Callable[[Path], object]]:
    def rewrite(relative: str, text: str) -> Callable[[Path], object]:
        return lambda context: (context / relative).write_text(text)

    def rename_wheel(context: Path) -> None:
        wheel = next((context / "wheels").glob("numpy-*.whl"))
        wheel.rename(wheel.with_name(wheel.name.replace("numpy-", "numpy-9")))

    def replace_wheel(context: Path) -> None:
        wheel = next((context / "wheels").glob("numpy-*.whl"))
        wheel.unlink()  # a hard link into the wheel cache: replace it, do not write through it
        wheel.write_bytes(b"other content")

    def add_source(context: Path) -> None:
        (context / "app" / "runtime" / "extra.py").write_text("")

    return {
        "Dockerfile": rewrite("Dockerfile", "FROM scratch\n"),
        "requirements": rewrite("requirements.txt", "numpy==1\n"),
        "wheel content": replace_wheel,
        "wheel name": rename_wheel,
        "app source": rewrite("app/runtime/__init__.py", "changed = True\n"),
        "new app file": add_source,
    }


@pytest.mark.parametrize("change", list(_mutations()))
def test_context_hash_follows_every_input(context: Path, change: str) -> None:
    before = context_hash(context, "sha256:base", "cpu")
    _mutations()[change](context)
    assert context_hash(context, "sha256:base", "cpu") != before


def test_context_hash_follows_base_and_variant(context: Path) -> None:
    digest = context_hash(context, "sha256:base", "cpu")
    assert context_hash(context, "sha256:other", "cpu") != digest
    assert context_hash(context, "sha256:base", "cuda") != digest


def test_context_hash_ignores_location_and_times(context: Path, tmp_path: Path) -> None:
    digest = context_hash(context, "sha256:base", "cpu")
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    copy = tmp_path / "elsewhere"
    shutil.copytree(context, copy)
    for path in copy.rglob("*"):
        os.utime(path, (0, 0))
    assert context_hash(copy, "sha256:base", "cpu") == digest

    rebuilt = tmp_path / "rebuilt"
    rebuilt.mkdir()
    assemble_context("cpu", tmp_path / "wheels", rebuilt)
    assert context_hash(rebuilt, "sha256:base", "cpu") == digest


# --- errors and the command line --------------------------------------------------------------


def test_base_image_needs_debootstrap_and_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda *_, **__: None)
    with pytest.raises(ImageBuildError, match="apt-get install debootstrap"):
        build._check_can_debootstrap()
    monkeypatch.setattr(shutil, "which", lambda *_, **__: "/usr/sbin/debootstrap")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ImageBuildError, match="needs root"):
        build._check_can_debootstrap()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload")
    register_cli(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_options() -> None:
    args = _parser().parse_args(["image", "build"])
    assert (args.variant, args.base, args.force) == ("cpu", None, False)
    args = _parser().parse_args(
        ["image", "build", "--variant", "cuda", "--base", "python:3.11-slim", "--force"]
    )
    assert (args.variant, args.base, args.force) == ("cuda", "python:3.11-slim", True)
    with pytest.raises(SystemExit):
        _parser().parse_args(["image", "build", "--variant", "rocm"])


def test_unreachable_engine_is_a_clear_error() -> None:
    # Through the real CLI in its own process, against a socket where no engine listens.
    done = subprocess.run(
        [sys.executable, "-m", "edge_client.cli", "image", "build"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"},
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert "offload image build: no Docker engine is reachable" in done.stderr
    assert "make docker-engine" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_base_build_dir_is_unmounted_before_deletion(tmp_path: Path) -> None:
    """What debootstrap leaves mounted in its target must not be deleted through."""
    workdir = tmp_path / "work"
    mount_point = workdir / "rootfs" / "dev pts"
    mount_point.mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount_point)], check=False)
    if mount.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    (mount_point / "file").write_text("")
    assert build._mount_points_under(workdir) == [mount_point]
    build._remove_build_dir(workdir)
    assert not workdir.exists()
    assert build._mount_points_under(workdir) == []


# --- resolution against the package index -----------------------------------------------------


@needs_network
@pytest.mark.parametrize("variant", VARIANTS)
def test_requirements_are_a_complete_lock(variant: str, tmp_path: Path) -> None:
    """pip resolves the requirements, dependencies included, to exactly the pinned set.

    `--dry-run --report` with fast-deps reads wheel metadata only (PEP 658 files or HTTP range
    requests) instead of downloading the wheels, several GB for cuda.
    """
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
    command += ["--use-feature=fast-deps", "--no-cache-dir", "--progress-bar", "off"]
    command += build.pip_target_options(ARCH)
    command += ["--target", str(tmp_path / "target"), "--report", str(report)]
    command += ["--requirement", str(requirements_file(variant))]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr

    resolved = {
        canonical_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert resolved == read_pins(requirements_file(variant))
    if variant == "cuda":
        assert "onnxruntime-gpu" in resolved
        assert "nvidia-cuda-runtime" in resolved
        assert any(name.startswith("nvidia-cudnn") for name in resolved)
    assert not (tmp_path / "target").exists()
    full_downloads = re.findall(r"Downloading \S+\.whl \(", result.stdout)
    assert not full_downloads, "the dry run downloaded whole wheels"
