"""`--precision fp16`: the FP16 copy of a model is checked against the FP32 model at load.

The copy is made outside the runtime (`python -m modelzoo.fp16`: onnxconverter-common's
float16 converter, which needs onnx; the runtime image carries onnxruntime alone). At load
both run on the same deterministic input: `--warmup-inputs` when given (real data is the
better judge), else the warm-up shapes filled with a seeded normal sample for floating-point
inputs and zeros for the others. The FP32 reference runs on the CPU, whatever the device:
it is the model's own arithmetic, it takes no GPU memory from the replica's share, and it is
released once compared. For each output the largest absolute difference is measured against
the output's scale, its largest FP32 magnitude; past `FP16_MAX_DEVIATION` of it the copy is
refused (ModelLoadError: the replica does not start). Outputs that are not floating point
(indices, labels) must be equal.

Why 1 %: FP16 carries 11 significant bits (a relative step of 4.9e-4 at worst); the copies of
the model zoo's MLP, MobileNetV2, ResNet-18 and Transformer deviated by 3.2e-4, 6.5e-4,
4.0e-4 and 6.4e-4 of their scales on onnxruntime 1.32's CPU provider, so 1 % leaves a 15x
margin for a GPU's own rounding (ResNet-18's FP32 answers on an H200's CUDA differed from
the CPU's by up to 1.1e-3 already: issue 48), while a copy that overflows FP16 (65,504) or
cancels large terms is far past it.

Plain Python over onnxruntime and numpy, like `runtime.model`; blocking.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.errors import ModelLoadError
from runtime.model import CPU, OnnxModel

logger = logging.getLogger(__name__)

FP16_MAX_DEVIATION = 0.01
"""The most an FP16 output may differ from FP32, as a fraction of the FP32 output's largest
magnitude (see the module docstring)."""
PROBE_SEED = 0


class Precision(enum.StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"


@dataclass(frozen=True, slots=True)
class Deviation:
    """How far one output of the FP16 copy is from the FP32 model's on the probe input."""

    output: str
    max_abs: float
    """Largest |fp16 - fp32| over the output's elements (nan or inf when the copy gave a
    non-finite value where FP32 gave a finite one)."""
    scale: float
    """Largest |fp32| of the output: what `max_abs` is measured against."""
    exact: bool
    """The output is not floating point: it must be equal."""

    @property
    def relative(self) -> float:
        if self.max_abs == 0:
            return 0.0
        return self.max_abs / self.scale if self.scale > 0 else math.inf

    def within(self, bound: float) -> bool:
        if self.exact:
            return self.max_abs == 0
        return self.relative <= bound  # False for nan

    def describe(self) -> str:
        if self.exact:
            verdict = "equal" if self.max_abs == 0 else "differs"
            return f"output {self.output!r}: {verdict} (not floating point: must be equal)"
        return (
            f"output {self.output!r}: max |fp16 - fp32| {self.max_abs:.3g}, "
            f"{self.relative:.2g} of its scale {self.scale:.3g}"
        )


def probe_feeds(
    model: OnnxModel, inputs: Mapping[str, np.ndarray] | None
) -> dict[str, np.ndarray]:
    """The input both models run on: `inputs` (checked like a request's) when given, else
    the warm-up shapes, floating-point inputs drawn from a normal sample seeded
    `PROBE_SEED`, the others zeros (an index or token id of 0 is valid for most models)."""
    feeds = model.warmup_feeds(inputs)
    if inputs is not None:
        return feeds
    rng = np.random.default_rng(PROBE_SEED)
    return {
        name: rng.standard_normal(a.shape).astype(a.dtype) if a.dtype.kind == "f" else a
        for name, a in feeds.items()
    }


def measure_deviation(
    reference: OnnxModel, converted: OnnxModel, feeds: Mapping[str, np.ndarray]
) -> list[Deviation]:
    """Each output's deviation of `converted` from `reference` on `feeds`. ModelLoadError
    when their inputs or outputs differ in name, datatype or shape (a copy converted without
    keeping FP32 inputs and outputs)."""
    for kind, ours, theirs in (
        ("inputs", reference.inputs, converted.inputs),
        ("outputs", reference.outputs, converted.outputs),
    ):
        if [(s.name, s.datatype, s.shape) for s in ours] != [
            (s.name, s.datatype, s.shape) for s in theirs
        ]:
            raise ModelLoadError(
                f"--fp16-model: its {kind} ({', '.join(s.describe() for s in theirs)}) are not "
                f"the FP32 model's ({', '.join(s.describe() for s in ours)}); convert with "
                "FP32 inputs and outputs kept (python -m modelzoo.fp16)"
            )
    names = [s.name for s in reference.outputs]
    expected = reference.run(feeds, names)
    got = converted.run(feeds, names)
    deviations = []
    for name, want, have in zip(names, expected, got, strict=True):
        exact = want.dtype.kind not in "fc"
        if want.dtype.kind in "OSU":
            differ = want.shape != have.shape or not np.array_equal(want, have)
            deviations.append(Deviation(name, float(differ), 1.0, exact=True))
            continue
        want64 = want.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(have.astype(np.float64) - want64)
        max_abs = float(np.max(diff)) if diff.size else 0.0
        scale = float(np.max(np.abs(want64))) if want.size else 0.0
        deviations.append(Deviation(name, max_abs, scale, exact))
    return deviations


def check_fp16(
    converted: OnnxModel,
    fp32_model: Path,
    inputs: Mapping[str, np.ndarray] | None,
    bound: float = FP16_MAX_DEVIATION,
) -> list[Deviation]:
    """Load `fp32_model` on the CPU, run it and `converted` (the FP16 copy, loaded) on the
    probe input, log each output's deviation, and return them. ModelLoadError when one is
    past `bound` of its scale (or a non-floating output differs), naming it. Blocking."""
    reference = OnnxModel.load(fp32_model, f"{converted.name} (FP32 reference)", device="cpu")
    deviations = measure_deviation(reference, converted, probe_feeds(converted, inputs))
    del reference  # its session's memory goes now, not at the next collection
    logger.info(
        "model=%s fp16 on %s against fp32 on %s: %s (bound %.2g of each output's scale)",
        converted.name,
        converted.provider,
        CPU,
        "; ".join(d.describe() for d in deviations),
        bound,
    )
    refused = [d for d in deviations if not d.within(bound)]
    if refused:
        raise ModelLoadError(
            f"--precision fp16 refused: the FP16 copy deviates from the FP32 model past "
            f"{bound:g} of the output's scale ({'; '.join(d.describe() for d in refused)}); "
            "serve FP32 (--precision fp32), or judge it on real inputs (--warmup-inputs)"
        )
    if converted.provider == CPU:
        logger.warning(
            "model=%s fp16 on the CPU: ONNX Runtime runs it, but it computed no faster than "
            "FP32 on the model zoo's models (docs/OPERATIONS.md); fp16 is for the GPU",
            converted.name,
        )
    return deviations
