"""`--precision fp16`: copies made by the real converter (`modelzoo.fp16`, onnxconverter-
common) checked against their FP32 model at load (`runtime.precision`), on ONNX Runtime's CPU
provider (this machine has no GPU): a faithful copy passes with its deviation logged, one
that loses the answers is refused, naming the output and the bound."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnxconverter_common import float16

import modelzoo
from modelzoo.fp16 import convert_to_fp16
from runtime.errors import ModelLoadError
from runtime.model import OnnxModel
from runtime.precision import (
    FP16_MAX_DEVIATION,
    Deviation,
    Precision,
    check_fp16,
    measure_deviation,
    probe_feeds,
)
from runtime.server import settings_from_args
from tests.precision_support import build_scaler


def load(path: Path) -> OnnxModel:
    return OnnxModel.load(path, path.stem, device="cpu", intra_op_threads=1)


def test_the_converter_writes_fp16_weights_behind_fp32_inputs_and_outputs(
    tmp_path: Path,
) -> None:
    source = modelzoo.model_path("mlp")
    copy = onnx.load(convert_to_fp16(source, tmp_path / "mlp.fp16.onnx"))
    weights = {t.data_type for t in copy.graph.initializer}
    assert weights == {TensorProto.FLOAT16}, weights
    original = onnx.load(source)
    assert [i.type for i in copy.graph.input] == [i.type for i in original.graph.input]
    assert [o.type for o in copy.graph.output] == [o.type for o in original.graph.output]


def test_a_faithful_copy_passes_with_its_deviation_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = modelzoo.model_path("mlp")
    converted = load(convert_to_fp16(source, tmp_path / "mlp.fp16.onnx"))
    with caplog.at_level(logging.INFO, logger="runtime.precision"):
        (deviation,) = check_fp16(converted, source, None)
    assert 0 < deviation.relative <= FP16_MAX_DEVIATION
    assert "mlp.fp16 fp16 on CPUExecutionProvider against fp32" in caplog.text
    assert f"output {deviation.output!r}: max |fp16 - fp32|" in caplog.text
    # On a CPU it runs, and says it is for the GPU (measured no faster here).
    assert "fp16 is for the GPU" in caplog.text


def test_a_copy_that_loses_the_answers_is_refused(tmp_path: Path) -> None:
    source = build_scaler(tmp_path / "scaler.onnx")
    converted = load(convert_to_fp16(source, tmp_path / "scaler.fp16.onnx"))
    with pytest.raises(ModelLoadError) as refused:
        check_fp16(converted, source, None)
    message = str(refused.value)
    assert message.startswith("--precision fp16 refused: the FP16 copy deviates")
    assert f"past {FP16_MAX_DEVIATION:g} of the output's scale" in message
    assert "output 'y': max |fp16 - fp32|" in message
    assert "serve FP32 (--precision fp32)" in message
    # Given inputs are the probe too: values of about 1 lose as much.
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    with pytest.raises(ModelLoadError, match="deviates"):
        check_fp16(converted, source, {"x": x})


def test_a_copy_with_fp16_inputs_is_refused_as_not_the_same_model(tmp_path: Path) -> None:
    source = modelzoo.model_path("mlp")
    plain = float16.convert_float_to_float16(onnx.load(source), keep_io_types=False)
    onnx.save(plain, tmp_path / "mlp.fp16io.onnx")
    converted = load(tmp_path / "mlp.fp16io.onnx")
    reference = load(source)
    with pytest.raises(ModelLoadError, match=r"are not the FP32 model's .*modelzoo\.fp16"):
        measure_deviation(reference, converted, probe_feeds(reference, None))


def test_outputs_that_are_not_floating_point_must_be_equal(probe_model: Path) -> None:
    """The probe's `z` (INT64) must match exactly; its FP32 `y` and FP16 `h` are measured."""
    model = load(probe_model)
    deviations = {d.output: d for d in measure_deviation(model, model, probe_feeds(model, None))}
    assert deviations["z"].exact and deviations["z"].within(FP16_MAX_DEVIATION)
    assert not deviations["y"].exact and deviations["y"].max_abs == 0
    assert not Deviation("z", 1.0, 7.0, exact=True).within(FP16_MAX_DEVIATION)
    assert not Deviation("y", float("nan"), 1.0, exact=False).within(FP16_MAX_DEVIATION)
    assert not Deviation("y", float("inf"), 1.0, exact=False).within(FP16_MAX_DEVIATION)


def test_the_probe_input_is_seeded_and_not_zeros(probe_model: Path) -> None:
    model = load(probe_model)
    first, second = probe_feeds(model, None), probe_feeds(model, None)
    assert np.array_equal(first["x"], second["x"]) and np.any(first["x"] != 0)
    assert np.all(first["k"] == 0)


@pytest.fixture
def base(tmp_path: Path, probe_model: Path) -> list[str]:
    token = tmp_path / "token"
    token.write_text("t")
    return ["--model", str(probe_model), "--token-file", str(token), "--host", "127.0.0.1"]


def test_the_flags_reach_the_settings(base: list[str], tmp_path: Path) -> None:
    copy = tmp_path / "probe.fp16.onnx"
    copy.write_bytes(b"checked at load")
    settings = settings_from_args([*base, "--precision", "fp16", "--fp16-model", str(copy)])
    assert settings.precision is Precision.FP16 and settings.served_file() == copy
    assert settings_from_args(base).served_file() == settings.model


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--precision", "fp16"], "--precision fp16 needs --fp16-model PATH"),
        (["--fp16-model", "{copy}"], "--fp16-model goes with --precision fp16"),
        (["--precision", "fp16", "--fp16-model", "/nonexistent.onnx"], "no such file"),
        (["--precision", "fp8"], "argument --precision: invalid choice"),
    ],
)
def test_inconsistent_flags_are_refused_at_start(
    base: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    copy = tmp_path / "copy.onnx"
    copy.write_bytes(b"x")
    with pytest.raises(SystemExit) as exited:
        settings_from_args([*base, *(f.format(copy=copy) for f in flags)])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
