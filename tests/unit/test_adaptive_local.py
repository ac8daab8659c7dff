"""The device's own model (`edge_client.local`): loading, running, standing in for a replica."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import modelzoo
from edge_client.errors import InvalidInput
from edge_client.local import LocalModel, usable_cpus
from runtime.tensors import TensorSpec


def test_a_missing_or_unloadable_file_is_invalid_input(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="no such file"):
        LocalModel.load(tmp_path / "absent.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model" * 100)
    with pytest.raises(InvalidInput, match=r"garbage\.onnx cannot be loaded"):
        LocalModel.load(garbage)


def test_runs_like_onnxruntime_and_refuses_inputs_as_the_replica_does() -> None:
    path = modelzoo.model_path("mlp")
    model = LocalModel.load(path, threads=1)
    inputs = modelzoo.sample_inputs(path, batch=2)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    expected = dict(zip(names, session.run(names, inputs), strict=True))
    outputs = model.run(inputs)
    assert outputs.keys() == expected.keys()
    for name, array in expected.items():
        np.testing.assert_allclose(outputs[name], array, rtol=1e-5, atol=1e-6)
    name = next(iter(inputs))
    with pytest.raises(InvalidInput, match="unknown input 'nope'"):
        model.run({"nope": inputs[name]})
    with pytest.raises(InvalidInput, match="missing input"):
        model.run({})
    with pytest.raises(InvalidInput, match="unknown output 'nope'"):
        model.run(inputs, ["nope"])


def test_stands_in_only_for_a_model_with_the_same_inputs_and_outputs() -> None:
    model = LocalModel.load(modelzoo.model_path("mlp"))
    model.check_stands_in_for(model.inputs, model.outputs, "itself")
    (first,) = model.inputs
    dynamic = TensorSpec(first.name, first.datatype, (-1,) * len(first.shape), ())
    model.check_stands_in_for([dynamic], model.outputs, "a dynamic twin")
    resnet = LocalModel.load(modelzoo.model_path("resnet18"))
    with pytest.raises(
        InvalidInput, match="cannot stand in for resnet18: input 'input' has shape"
    ):
        model.check_stands_in_for(resnet.inputs, resnet.outputs, "resnet18")
    other = TensorSpec("pixels", "FP32", first.shape, ())
    with pytest.raises(InvalidInput, match=r"no input pixels .*input 'input' is not the deploy"):
        model.check_stands_in_for([other], model.outputs, "a renamed twin")
    ints = TensorSpec(first.name, "INT64", first.shape, ())
    with pytest.raises(InvalidInput, match="is FP32, not INT64"):
        model.check_stands_in_for([ints], model.outputs, "an integer twin")


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("25000 100000\n", 1), ("200000 100000\n", 2), ("max 100000\n", None), ("garbage", None)],
    ids=["quarter", "two", "unlimited", "unreadable"],
)
def test_local_threads_follow_the_containers_cpu_limit(
    tmp_path: Path, cpu_max: str, expected: int | None
) -> None:
    cores = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text(cpu_max)
    want = cores if expected is None else min(cores, expected)
    assert usable_cpus(tmp_path) == want
    assert usable_cpus(tmp_path / "missing") == cores


def test_a_model_zeros_do_not_suit_loads_unwarmed_and_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Silero VAD fails on zeros (its sample rate input): warming it up as a replica does
    fails, which is logged; the model loads and serves real inputs all the same."""
    caplog.set_level(logging.INFO, logger="edge_client.local")
    LocalModel.load(modelzoo.model_path("mlp"))
    assert "not warmed up" not in caplog.text
    path = modelzoo.model_path("silero_vad")
    model = LocalModel.load(path, threads=1)
    assert f"local model {path.name} not warmed up on zeros" in caplog.text
    outputs = model.run(modelzoo.sample_inputs(path))
    assert outputs and all(a.size for a in outputs.values())
