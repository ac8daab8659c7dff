"""Build the images without an image registry: the runtime image of the inference containers
(variants ``cpu`` and ``cuda``) and the broker's image (variant ``broker``).

An image is assembled from three locally produced inputs:

1. a Debian bookworm base image made with ``debootstrap`` and imported into Docker
   (:func:`ensure_base_image`), unless the caller names another base such as ``python:3.11-slim``;
2. wheels for CPython 3.11 on manylinux, downloaded on the host with ``pip download``
   (:func:`download_wheels`) and cached under ``$EDGE_OFFLOAD_CACHE`` (``~/.cache/edge-offload``);
3. the variant's application packages of this repository (:data:`APP_PACKAGES`): ``runtime/``
   and ``protos/`` for a runtime image; the broker's packages and its ops page for the broker.

:func:`build_image` copies them into a build context, hashes it, and runs ``docker build`` with
``images/Dockerfile`` only when the tag does not already carry that content hash. Every function
here blocks until its work is done (minutes for a first build) and reports failures as
:class:`ImageBuildError`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors

from images.engine import EngineUnavailable, connect_engine
from runtime.version import __version__

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

RUNTIME_VARIANTS = ("cpu", "cuda")
VARIANTS = (*RUNTIME_VARIANTS, "broker")
IMAGES_DIR = Path(__file__).resolve().parent
# The directory holding the `images` package also holds the application packages.
REPO_ROOT = Path(__file__).resolve().parents[1]
_RUNTIME_APP = ("runtime", "protos")
APP_PACKAGES: dict[str, tuple[str, ...]] = {
    "cpu": _RUNTIME_APP,
    "cuda": _RUNTIME_APP,
    # The broker imports runtime.errors and runtime.rpc.status (its error messages and status
    # mapping); nothing of it loads onnxruntime, which the broker image does not have.
    "broker": ("broker", "common", "migration", "protos", "runtime"),
}
"""Per variant, the repository's packages copied into the image under /app."""
APP_SUFFIXES = (".py", ".pyi")
APP_DATA_DIRS = ("broker/ops/static",)
"""Directories whose every file is copied too (the ops page), where a variant has them."""

BASE_IMAGE = "edge-offload/base:bookworm"
RUNTIME_REPOSITORY = "edge-offload/runtime"
BROKER_REPOSITORY = "edge-offload/broker"
BASE_HASH_LABEL = "offload.base.hash"
HASH_LABEL = "offload.image.hash"
VARIANT_LABEL = "offload.image.variant"

# The wheels target the base image's interpreter: CPython 3.11 on glibc 2.36 (Debian bookworm).
PYTHON_VERSION = "3.11"
BASE_GLIBC_MINOR = 36

# Everything that determines the base image; its hash is the image's BASE_HASH_LABEL.
_BASE_RECIPE: dict[str, Any] = {
    "suite": "bookworm",
    "mirror": "http://deb.debian.org/debian",
    "variant": "minbase",
    "include": ["python3", "python3-venv"],
    "arch": platform.machine(),
    # Docker provides /dev at run time; package caches, indexes and documentation (but for the
    # copyright files) only add size.
    "tar_exclude": [
        "./dev/*",
        "./var/cache/apt/archives/*.deb",
        "./var/lib/apt/lists/*",
        "./usr/share/doc/*/changelog*",
        "./usr/share/info/*",
        "./usr/share/locale/*",
        "./usr/share/man/*",
    ],
    "changes": [
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "ENV LANG=C.UTF-8",
        'CMD ["/bin/bash"]',
    ],
}

_OUTPUT_TAIL_LINES = 40


class ImageBuildError(Exception):
    """A build step failed; the message says which and, where possible, how to fix it."""


def _print_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Stage:
    """Reports the messages of one build stage with the seconds elapsed since it began."""

    def __init__(self, name: str, progress: Progress) -> None:
        self._name = name
        self._progress = progress
        self._start = time.monotonic()

    def say(self, message: str) -> None:
        self._progress(f"[{self._name} {time.monotonic() - self._start:7.1f}s] {message}")


@contextlib.contextmanager
def _stage(name: str, progress: Progress) -> Iterator[_Stage]:
    stage = _Stage(name, progress)
    try:
        yield stage
    except BaseException:
        stage.say("failed")
        raise
    stage.say("done")


@contextlib.contextmanager
def _docker_errors(action: str) -> Iterator[None]:
    """Turn errors of the Docker SDK (and of its HTTP transport) into ImageBuildError."""
    try:
        yield
    except (docker.errors.DockerException, OSError) as exc:
        raise ImageBuildError(f"{action} failed: {exc}") from exc


def cache_dir() -> Path:
    """The cache root: $EDGE_OFFLOAD_CACHE, or ~/.cache/edge-offload."""
    return Path(os.environ.get("EDGE_OFFLOAD_CACHE") or Path.home() / ".cache" / "edge-offload")


def _check_variant(variant: str, variants: tuple[str, ...] = VARIANTS) -> None:
    if variant not in variants:
        raise ImageBuildError(f"unknown image variant {variant!r}; expected one of {variants}")


def runtime_image_tag(variant: str) -> str:
    """The tag of the runtime image: edge-offload/runtime:<version>[-cuda].

    <version> is the project's version (runtime/version.py, which pyproject reads too).
    """
    _check_variant(variant, RUNTIME_VARIANTS)
    suffix = "" if variant == "cpu" else f"-{variant}"
    return f"{RUNTIME_REPOSITORY}:{__version__}{suffix}"


def image_tag(variant: str) -> str:
    """The tag `variant` builds: the runtime image's (:func:`runtime_image_tag`), or
    edge-offload/broker:<version> for the broker."""
    _check_variant(variant)
    if variant == "broker":
        return f"{BROKER_REPOSITORY}:{__version__}"
    return runtime_image_tag(variant)


def requirements_file(variant: str) -> Path:
    """images/requirements-<variant>.txt: the pinned dependency closure of the variant."""
    _check_variant(variant)
    return IMAGES_DIR / f"requirements-{variant}.txt"


def canonical_name(name: str) -> str:
    """The normalized form of a distribution name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


_PIN = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[A-Za-z0-9,._ -]+\])?==(?P<version>\S+)$"
)


def read_pins(requirements: Path) -> dict[str, str]:
    """Canonical distribution name -> version for a requirements file of `name[extras]==version`
    lines (comments and blank lines allowed). Anything else raises ImageBuildError: the images
    install exactly these pins.
    """
    pins: dict[str, str] = {}
    for number, raw in enumerate(requirements.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN.match(line)
        if match is None:
            raise ImageBuildError(
                f"{requirements}:{number}: expected `name==version`, got {raw.strip()!r}"
            )
        pins[canonical_name(match["name"])] = match["version"]
    return pins


def wheel_platforms(arch: str) -> list[str]:
    """Platform tags of the wheels that run on the base image (glibc 2.36) on `arch`."""
    modern = [f"manylinux_2_{minor}_{arch}" for minor in range(BASE_GLIBC_MINOR, 4, -1)]
    return [*modern, *(f"manylinux{legacy}_{arch}" for legacy in ("2014", "2010", "1"))]


def pip_target_options(arch: str) -> list[str]:
    """pip options selecting binary wheels for the image's interpreter on `arch`."""
    abi = "cp" + PYTHON_VERSION.replace(".", "")
    options = ["--only-binary=:all:", "--implementation", "cp"]
    options += ["--python-version", PYTHON_VERSION, "--abi", abi]
    for tag in wheel_platforms(arch):
        options += ["--platform", tag]
    return options


def _run(command: list[str], *, what: str, stage: _Stage, show: Callable[[str], bool]) -> None:
    """Run `command`, log its output at DEBUG, pass the lines `show` selects to the stage,
    and raise ImageBuildError with the output's tail if it fails."""
    logger.debug("running %s", command)
    tail: deque[str] = deque(maxlen=_OUTPUT_TAIL_LINES)
    try:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
    except OSError as exc:
        raise ImageBuildError(f"cannot run {what}: {exc}") from exc
    with process:
        assert process.stdout is not None
        for raw in process.stdout:
            line = raw.rstrip()
            logger.debug("%s: %s", what, line)
            tail.append(line)
            if show(line):
                stage.say(line.strip())
    if process.returncode != 0:
        output = "\n".join(tail)
        raise ImageBuildError(
            f"{what} failed (exit {process.returncode}); its output ends:\n{output}"
        )


def _parse_wheel(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, platform tags) from a wheel file name (PEP 427)."""
    parts = path.name.removesuffix(".whl").split("-")
    return canonical_name(parts[0]), parts[1], parts[-1].split(".")


def _prune_wheels(directory: Path, pins: dict[str, str], arch: str) -> list[str]:
    """Delete wheels that are not pinned, not for `arch` or not readable; return the pinned
    names that have no wheel left."""
    platforms = {*wheel_platforms(arch), "any"}
    present = set()
    for wheel in sorted(directory.glob("*.whl")):
        name, version, tags = _parse_wheel(wheel)
        if (
            pins.get(name) == version
            and platforms.intersection(tags)
            and zipfile.is_zipfile(wheel)
        ):
            present.add(name)
        else:
            logger.info("removing stale wheel %s", wheel)
            wheel.unlink()
    return sorted(set(pins) - present)


def download_wheels(variant: str = "cpu", *, progress: Progress = _print_progress) -> Path:
    """Download the pinned wheels of `variant` for the image's interpreter on this machine's
    architecture into <cache>/wheels/<variant>, and return that directory.

    Idempotent: pip runs only when a pinned wheel is missing (so a complete cache needs no
    network), and wheels of other versions or architectures are removed, so that the directory
    holds exactly the pinned set. Blocks for the download (the cuda variant is several GB).
    """
    requirements = requirements_file(variant)
    pins = read_pins(requirements)
    arch = platform.machine()
    directory = cache_dir() / "wheels" / variant
    directory.mkdir(parents=True, exist_ok=True)
    with _stage("wheels", progress) as stage:
        missing = _prune_wheels(directory, pins, arch)
        if not missing:
            stage.say(f"all {len(pins)} pinned wheels are cached in {directory}")
            return directory
        stage.say(f"downloading {len(missing)} of {len(pins)} pinned wheels into {directory}")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off"]
        command += pip_target_options(arch)
        command += ["--dest", str(directory), "--requirement", str(requirements)]
        _run(
            command,
            what="pip download",
            stage=stage,
            show=lambda line: line.lstrip().startswith(("Downloading ", "Saved ")),
        )
        missing = _prune_wheels(directory, pins, arch)
        if missing:
            raise ImageBuildError(
                f"pip download left no usable {arch} wheel for: {', '.join(missing)}"
            )
    return directory


def _connect() -> docker.DockerClient:
    try:
        return connect_engine()
    except EngineUnavailable as err:
        raise ImageBuildError(str(err)) from err


def _inspect(client: docker.DockerClient, reference: str) -> dict[str, Any] | None:
    """The engine's description of an image, or None if it has none by that reference."""
    with _docker_errors(f"inspecting image {reference}"):
        try:
            return client.api.inspect_image(reference)
        except docker.errors.ImageNotFound:
            return None


def _labels(image: dict[str, Any] | None) -> dict[str, str]:
    if image is None:
        return {}
    return (image.get("Config") or {}).get("Labels") or {}


def _base_recipe_hash() -> str:
    return hashlib.sha256(json.dumps(_BASE_RECIPE, sort_keys=True).encode()).hexdigest()


def _check_can_debootstrap() -> None:
    search_path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    if shutil.which("debootstrap", path=search_path) is None:
        raise ImageBuildError(
            f"debootstrap is not installed; it builds the base image {BASE_IMAGE}: "
            "install it with `apt-get install debootstrap`, or pass --base IMAGE "
            "to build on an existing Python 3.11 image"
        )
    if os.geteuid() != 0:
        raise ImageBuildError(
            f"building the base image {BASE_IMAGE} runs debootstrap, which needs root: "
            "run this as root (e.g. with sudo), or pass --base IMAGE "
            "to build on an existing Python 3.11 image"
        )


def _mount_points_under(directory: Path) -> list[Path]:
    """Mount points at or below `directory`, deepest first."""
    mounts = []
    for entry in Path("/proc/self/mounts").read_text().splitlines():
        # The mount point is the second field, with blanks escaped as octal (\040).
        field = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match[1], 8)), entry.split()[1])
        point = Path(field)
        if point == directory or directory in point.parents:
            mounts.append(point)
    return sorted(mounts, key=lambda point: len(point.parts), reverse=True)


def _remove_build_dir(directory: Path) -> None:
    """Delete a debootstrap working directory, unmounting what debootstrap may have left
    mounted in it (/proc, /sys, a bind-mounted /dev) so that the deletion stays inside it."""
    for point in _mount_points_under(directory):
        subprocess.run(["umount", "--lazy", str(point)], check=False, capture_output=True)
    remaining = _mount_points_under(directory)
    if remaining:
        logger.error("not deleting %s: still mounted there: %s", directory, remaining)
        return
    shutil.rmtree(directory)


def ensure_base_image(
    *, client: docker.DockerClient | None = None, progress: Progress = _print_progress
) -> str:
    """Make sure the Docker engine has BASE_IMAGE for the current recipe; return its image id.

    Idempotent: if the image exists with the recipe's hash in its BASE_HASH_LABEL, nothing is
    done. Otherwise it blocks for a few minutes: debootstraps Debian bookworm (minbase, python3,
    python3-venv) into a temporary directory (needs root, debootstrap and the Debian mirror),
    imports it, and deletes the directory, also on failure. To refresh the Debian packages,
    remove the image (`docker rmi edge-offload/base:bookworm`) and build again.
    """
    if client is None:
        with contextlib.closing(_connect()) as own_client:
            return ensure_base_image(client=own_client, progress=progress)
    recipe_hash = _base_recipe_hash()
    with _stage("base", progress) as stage:
        existing = _inspect(client, BASE_IMAGE)
        if _labels(existing).get(BASE_HASH_LABEL) == recipe_hash:
            assert existing is not None
            stage.say(f"{BASE_IMAGE} is up to date")
            return existing["Id"]
        _check_can_debootstrap()
        workdir = Path(tempfile.mkdtemp(prefix="edge-offload-base-"))
        try:
            rootfs = workdir / "rootfs"
            stage.say(f"debootstrap {_BASE_RECIPE['suite']} into {rootfs} (takes a few minutes)")
            _run(
                [
                    "debootstrap",
                    f"--variant={_BASE_RECIPE['variant']}",
                    f"--include={','.join(_BASE_RECIPE['include'])}",
                    _BASE_RECIPE["suite"],
                    str(rootfs),
                    _BASE_RECIPE["mirror"],
                ],
                what="debootstrap",
                stage=stage,
                # Phase headers ("I: Installing core packages..."), not the per-package lines
                # ("I: Extracting libc6...").
                show=lambda line: (
                    line.startswith("I: ")
                    and len(line.split()) > 3
                    and line.endswith(("...", "successfully."))
                ),
            )
            tarball = workdir / "rootfs.tar"
            command = ["tar", "--create", "--file", str(tarball), "--numeric-owner"]
            command += [f"--exclude={pattern}" for pattern in _BASE_RECIPE["tar_exclude"]]
            _run([*command, "-C", str(rootfs), "."], what="tar", stage=stage, show=bool)
            stage.say(f"importing the root file system as {BASE_IMAGE}")
            repository, tag = BASE_IMAGE.split(":")
            with _docker_errors(f"importing {BASE_IMAGE}"):
                client.api.import_image(
                    src=str(tarball),
                    repository=repository,
                    tag=tag,
                    changes=[*_BASE_RECIPE["changes"], f"LABEL {BASE_HASH_LABEL}={recipe_hash}"],
                )
        finally:
            _remove_build_dir(workdir)
        imported = _inspect(client, BASE_IMAGE)
        if _labels(imported).get(BASE_HASH_LABEL) != recipe_hash:
            raise ImageBuildError(f"docker import did not produce {BASE_IMAGE}")
        assert imported is not None
        stage.say(f"built {BASE_IMAGE}: {_describe(imported)}")
        return imported["Id"]


def _describe(image: dict[str, Any]) -> str:
    return f"{image['Id'].removeprefix('sha256:')[:12]}, {image['Size'] / 1e6:.0f} MB"


def _external_base(client: docker.DockerClient, reference: str, progress: Progress) -> str:
    """The image id of a caller-named base image, pulled first if the engine lacks it."""
    with _stage("base", progress) as stage:
        image = _inspect(client, reference)
        if image is None:
            stage.say(f"pulling {reference}")
            with _docker_errors(f"pulling base image {reference} (not present locally)"):
                client.images.pull(reference)
            image = _inspect(client, reference)
        if image is None:
            raise ImageBuildError(f"base image {reference} is not available after pulling it")
        stage.say(f"using {reference}: {_describe(image)}")
        return image["Id"]


def _app_sources(package: Path) -> list[Path]:
    data_dirs = [REPO_ROOT / directory for directory in APP_DATA_DIRS]
    return sorted(
        path
        for path in package.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and (path.suffix in APP_SUFFIXES or any(d in path.parents for d in data_dirs))
    )


def _place(destination: Path) -> Path:
    """Create the parent directories of a context file, world-readable."""
    for directory in reversed(destination.parents):
        if not directory.exists():
            directory.mkdir()
            directory.chmod(0o755)
    return destination


def assemble_context(variant: str, wheels: Path, context: Path) -> None:
    """Fill the empty directory `context` with the build context of `variant`: Dockerfile,
    requirements.txt, wheels/ (hard links to the wheels in `wheels`, so `context` must be on the
    same file system) and app/<package>/ with the .py/.pyi files of the variant's application
    packages (and the files of APP_DATA_DIRS within them).
    Files are made mode 0644 so that the image's non-root user can read them whatever the umask.
    """
    shutil.copyfile(IMAGES_DIR / "Dockerfile", context / "Dockerfile")
    shutil.copyfile(requirements_file(variant), context / "requirements.txt")
    for wheel in sorted(wheels.glob("*.whl")):
        os.link(wheel, _place(context / "wheels" / wheel.name))
    for package in APP_PACKAGES[variant]:
        source_root = REPO_ROOT / package
        if not (source_root / "__init__.py").is_file():
            raise ImageBuildError(f"application package {source_root} is missing")
        for source in _app_sources(source_root):
            shutil.copyfile(source, _place(context / "app" / source.relative_to(REPO_ROOT)))
    for path in context.rglob("*"):
        if path.is_file():
            path.chmod(0o644)


def context_hash(context: Path, base_image_id: str, variant: str) -> str:
    """sha256 over every file of the build context (relative path and content hash: the
    Dockerfile, requirements, wheels and application sources), the base image id and the
    variant. Modification times and the context's location do not enter it."""
    digest = hashlib.sha256(f"variant={variant}\nbase={base_image_id}\n".encode())
    files = {path.relative_to(context).as_posix(): path for path in context.rglob("*")}
    for relative in sorted(name for name, path in files.items() if path.is_file()):
        with files[relative].open("rb") as handle:
            content = hashlib.file_digest(handle, "sha256").hexdigest()
        digest.update(f"{relative}\0{content}\n".encode())
    return digest.hexdigest()


def _docker_build(
    client: docker.DockerClient,
    context: Path,
    tag: str,
    buildargs: dict[str, str],
    labels: dict[str, str],
    stage: _Stage,
) -> None:
    """Run docker build on `context`, passing its "Step N/M" lines to the stage."""
    tail: deque[str] = deque(maxlen=_OUTPUT_TAIL_LINES)
    error = None
    size = sum(path.stat().st_size for path in context.rglob("*") if path.is_file())
    stage.say(f"sending the build context ({size / 1e6:.0f} MB) to the Docker engine")
    with _docker_errors(f"docker build of {tag}"):
        stream = client.api.build(
            path=str(context),
            tag=tag,
            buildargs=buildargs,
            labels=labels,
            rm=True,
            forcerm=True,
            pull=False,
            decode=True,
        )
        # Read the stream to its end (it ends right after an error), so that the connection is
        # released in order.
        for chunk in stream:
            if "error" in chunk or "errorDetail" in chunk:
                error = (chunk.get("errorDetail") or {}).get("message") or chunk.get("error")
            for line in chunk.get("stream", "").splitlines():
                if line.strip():
                    logger.debug("docker build: %s", line)
                    tail.append(line)
                if line.startswith("Step "):
                    stage.say(line)
    if error is not None:
        output = "\n".join(tail)
        raise ImageBuildError(f"docker build of {tag} failed: {error}\nits output ends:\n{output}")


def build_image(
    variant: str = "cpu",
    base: str | None = None,
    force: bool = False,
    progress: Progress = _print_progress,
) -> str:
    """Build the image of `variant` ("cpu" or "cuda": the runtime; "broker") and return its tag
    (:func:`image_tag`).

    `base` names the base image (it must have python3 3.11 with venv on PATH, e.g.
    python:3.11-slim, pulled if missing); by default it is BASE_IMAGE, built with
    :func:`ensure_base_image`. Idempotent: when the tag already carries the content hash of this
    build's inputs (see :func:`context_hash`), nothing is built unless `force` is set. Blocks for
    the whole build: minutes for a first cpu build, longer for cuda. `progress` receives one line
    per stage event and per Dockerfile step.
    """
    tag = image_tag(variant)
    with contextlib.closing(_connect()) as client:
        if base is None:
            base_id = ensure_base_image(client=client, progress=progress)
        else:
            base_id = _external_base(client, base, progress)
        wheels = download_wheels(variant, progress=progress)
        # Beside the wheel cache, so that the wheels can be hard-linked into the context.
        with tempfile.TemporaryDirectory(prefix="context-", dir=wheels.parent) as temporary:
            context = Path(temporary)
            with _stage("context", progress) as stage:
                assemble_context(variant, wheels, context)
                digest = context_hash(context, base_id, variant)
                stage.say(f"content hash {digest[:12]}")
            if not force and _labels(_inspect(client, tag)).get(HASH_LABEL) == digest:
                progress(f"{tag} is up to date ({HASH_LABEL}={digest[:12]}); --force rebuilds it")
                return tag
            with _stage("build", progress) as stage:
                _docker_build(
                    client,
                    context,
                    tag,
                    buildargs={"BASE": base or BASE_IMAGE, "VARIANT": variant},
                    labels={HASH_LABEL: digest, VARIANT_LABEL: variant},
                    stage=stage,
                )
                built = _inspect(client, tag)
                if _labels(built).get(HASH_LABEL) != digest:
                    raise ImageBuildError(f"docker build finished but {tag} lacks its hash label")
                assert built is not None
                stage.say(f"built {tag}: {_describe(built)}")
    return tag


def _build_command(args: argparse.Namespace) -> int:
    try:
        tag = build_image(args.variant, base=args.base, force=args.force)
    except ImageBuildError as exc:
        print(f"offload image build: {exc}", file=sys.stderr)
        return 1
    print(tag)
    return 0


def register_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `image build` to the `offload` command line."""
    image = subparsers.add_parser(
        "image",
        help="build the runtime image of the inference containers, or the broker's",
        description="Build the runtime image of the inference containers, or the broker's "
        "image, with no registry.",
    )
    commands = image.add_subparsers(dest="image_command", metavar="SUBCOMMAND", required=True)
    build = commands.add_parser(
        "build",
        help="build edge-offload/runtime:<version>[-cuda] or edge-offload/broker:<version> "
        "(skipped when up to date)",
        description=(
            "Build an image: a Debian base made with debootstrap (needs root), wheels "
            "downloaded with pip and cached under $EDGE_OFFLOAD_CACHE, and this repository's "
            "packages (runtime/ and protos/ for the runtime; the broker's for the broker). "
            "Progress goes to stderr, the image tag to stdout."
        ),
    )
    build.add_argument(
        "--variant",
        choices=VARIANTS,
        default="cpu",
        help="cpu (the runtime), cuda (the runtime with onnxruntime-gpu), or broker",
    )
    build.add_argument(
        "--base",
        metavar="IMAGE",
        help=f"base image with python3 3.11 (default: {BASE_IMAGE}, made with debootstrap)",
    )
    build.add_argument(
        "--force", action="store_true", help="rebuild even if the image is up to date"
    )
    build.set_defaults(func=_build_command)
