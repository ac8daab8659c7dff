"""One namespace over built and pretrained models: look-up, paths, descriptions, sample inputs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from modelzoo import builders, pretrained
from modelzoo.inputs import random_inputs

BUILT: tuple[str, ...] = tuple(builders.SPECS)
PRETRAINED: tuple[str, ...] = tuple(pretrained.SPECS)
ALL: tuple[str, ...] = BUILT + PRETRAINED

_CACHED_NAME = re.compile(r"(?P<name>[a-z0-9_]+)-[0-9a-f]{16}\.onnx")


def _spec(name: str) -> builders.BuiltSpec | pretrained.PretrainedSpec:
    spec = builders.SPECS.get(name) or pretrained.SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(ALL)}")
    return spec


def model_path(name: str) -> Path:
    """Return the path of model ``name`` in the cache, building or downloading it if absent.

    Raises ``ValueError`` (listing the valid names) for an unknown name, and
    :class:`modelzoo.pretrained.ModelFetchError` if a pretrained model cannot be fetched.
    """
    spec = _spec(name)
    if isinstance(spec, builders.BuiltSpec):
        return builders.ensure_built(spec)
    return pretrained.ensure_fetched(spec)


def describe(name: str) -> dict[str, Any]:
    """Return what is known about model ``name`` without building or downloading anything.

    Keys: ``name``, ``kind`` ("built" or "pretrained"), ``description``, ``source``,
    ``license``, ``path`` (where it is or will be cached), ``cached`` (bool), ``size_bytes``
    (None unless cached); pretrained models add ``package``, ``version``, ``member``,
    ``homepage``, ``sha256``.
    """
    spec = _spec(name)
    path = spec.path
    cached = path.exists()
    info: dict[str, Any] = {
        "name": name,
        "kind": "built" if isinstance(spec, builders.BuiltSpec) else "pretrained",
        "description": spec.description,
        "source": spec.source,
        "license": builders.LICENSE if isinstance(spec, builders.BuiltSpec) else spec.license,
        "path": path,
        "cached": cached,
        "size_bytes": path.stat().st_size if cached else None,
    }
    if isinstance(spec, pretrained.PretrainedSpec):
        info |= {
            "package": spec.package,
            "version": spec.version,
            "member": spec.member,
            "homepage": spec.homepage,
            "sha256": spec.sha256,
        }
    return info


def sample_inputs(path: Path, seed: int = 0, batch: int = 1) -> dict[str, np.ndarray]:
    """Return deterministic random inputs for the model at ``path``, keyed by input name.

    Shapes and dtypes come from the model's input metadata. A model cached by this package
    (file name ``<name>-<16 hex>.onnx``) also gets its per-model hints: fixed image sizes for
    the OCR models, token ids below the vocabulary size, silero's ``sr`` = 16000, and so on.
    Any other model gets the defaults of :func:`modelzoo.inputs.random_inputs` (first dynamic
    dimension = ``batch``, other dynamic dimensions = 1).
    """
    path = Path(path)
    match = _CACHED_NAME.fullmatch(path.name)
    name = match["name"] if match else ""
    spec = builders.SPECS.get(name) or pretrained.SPECS.get(name)
    hints = spec.input_hints if spec is not None else ()
    return random_inputs(path, hints, seed=seed, batch=batch)
