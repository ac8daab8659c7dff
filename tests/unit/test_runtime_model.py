"""Execution provider choice and start-up checks of `runtime.model`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

import runtime.model
from runtime.errors import ModelLoadError
from runtime.model import CPU, CUDA, TENSORRT, OnnxModel, choose_providers, time_in_turn
from runtime.server import keeps_pool, settings_from_args

HAS_CUDA_BUILD = CUDA in ort.get_available_providers()
HAS_TENSORRT_BUILD = TENSORRT in ort.get_available_providers()


def test_cpu_is_cpu() -> None:
    assert choose_providers("cpu") == [CPU]


@pytest.mark.skipif(HAS_CUDA_BUILD, reason="this onnxruntime has a CUDA provider")
def test_auto_without_cuda_build_is_cpu_and_cuda_is_refused() -> None:
    assert choose_providers("auto") == [CPU]
    with pytest.raises(ModelLoadError, match="no CUDA execution provider"):
        choose_providers("cuda")


@pytest.mark.skipif(HAS_TENSORRT_BUILD, reason="this onnxruntime has a TensorRT provider")
def test_tensorrt_without_its_provider_is_refused_naming_what_there_is(
    probe_model: Path, tmp_path: Path
) -> None:
    """`--device tensorrt` is a flag the runtime takes; on an onnxruntime without TensorRT's
    provider (this machine's) the load is refused, saying so and naming the providers it
    has, never quietly served on another."""
    token = tmp_path / "token"
    token.write_text("t")
    flags = ["--model", str(probe_model), "--token-file", str(token), "--host", "127.0.0.1"]
    assert settings_from_args([*flags, "--device", "tensorrt"]).device == "tensorrt"
    with pytest.raises(ModelLoadError) as refused:
        OnnxModel.load(probe_model, "probe", device="tensorrt")
    message = str(refused.value)
    assert "device 'tensorrt' asked for, but this onnxruntime has no TensorRT" in message
    assert f"it has {', '.join(ort.get_available_providers())}" in message
    assert "--device cuda" in message


def test_unknown_device_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="unknown device 'tpu'"):
        choose_providers("tpu")


# Each thread's CPUs, printed by a fresh interpreter that loads `path` (ONNX Runtime's thread
# pool is per process, so this runs in one of its own).
_THREAD_CPUS = """
import os, sys
from pathlib import Path
from runtime.model import OnnxModel
model = OnnxModel.load(Path(sys.argv[1]), "probe", device="cpu")
print(sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_onnx_runtime_threads_stay_on_the_cpus_the_process_was_given(probe_model: Path) -> None:
    # Started on the first CPU, as a node's `--cpuset` starts its process replicas: left to
    # size its own pool, ONNX Runtime pinned a thread to the machine's second core.
    cpu = min(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", _THREAD_CPUS, str(probe_model)],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"[({cpu},)]"


def test_the_thread_count_is_one_per_allowed_cpu_unless_given(probe_model: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    assert OnnxModel.load(probe_model, "probe", device="cpu").intra_op_threads == cpus
    assert OnnxModel.load(probe_model, "probe", "cpu", intra_op_threads=3).intra_op_threads == 3


def test_sessions_are_timed_in_turn_one_run_each_a_round(
    probe_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = OnnxModel.load(probe_model, "probe", device="cpu", intra_op_threads=2)
    single = OnnxModel.load(probe_model, "probe", device="cpu", intra_op_threads=1)
    pool.warm_up()
    single.warm_up()
    runs: list[object] = []
    timed = runtime.model._timed

    def recorded(session: ort.InferenceSession, feeds: dict[str, object]) -> float:
        runs.append(session)
        return timed(session, feeds)  # type: ignore[arg-type]

    monkeypatch.setattr(runtime.model, "_timed", recorded)
    figures = time_in_turn([pool, single], budget_s=10.0, most_rounds=7)
    assert len(figures) == 2 and all(ms > 0 for ms in figures)
    assert runs == [pool._session, single._session] * 7
    runs.clear()
    time_in_turn([pool, single], budget_s=0.0)  # past its budget: one round still
    assert runs == [pool._session, single._session]
    with pytest.raises(ValueError, match="no models"):
        time_in_turn([])


@pytest.mark.parametrize(
    ("pool_ms", "single_ms", "kept"),
    [(0.030, 0.030, False), (0.029, 0.030, False), (0.027, 0.030, True), (0.5, 1.0, True),
     (0.040, 0.030, False)],
    ids=["tie", "3-percent-quicker", "10-percent-quicker", "twice-as-fast", "slower"],
)  # fmt: skip
def test_a_tiny_model_keeps_its_thread_pool_only_when_clearly_quicker(
    pool_ms: float, single_ms: float, kept: bool
) -> None:
    assert keeps_pool(pool_ms, single_ms) is kept


def test_load_logs_the_provider(probe_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="runtime.model"):
        model = OnnxModel.load(probe_model, "probe", device="cpu")
    assert model.provider == CPU
    assert f"model=probe loaded from {probe_model} provider={CPU}" in caplog.text


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "does not exist"), (b"not a model", "cannot load")],
    ids=["missing", "garbage"],
)
def test_unloadable_model_is_a_load_error(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "model.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        OnnxModel.load(path, "m", device="cpu")
