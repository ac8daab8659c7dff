"""The broker's model store: only whole, hash-checked, loadable ONNX files ever become visible."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from broker.model_store import InvalidModel, ModelNotFound, ModelStore, ModelTooLarge
from common.content import PutResult

LIMIT = 1 << 20


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def store_at(tmp_path: Path, max_bytes: int = LIMIT) -> ModelStore:
    return ModelStore(tmp_path / "models", max_bytes)


def contents(store: ModelStore) -> list[str]:
    """Everything under the store's root: models and any staging leftovers."""
    return sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*"))


def put(
    store: ModelStore, data: bytes, declared: str | None = None, chunk: int = 1000
) -> PutResult:
    with store.upload(declared or sha(data)) as upload:
        for start in range(0, len(data), chunk):
            upload.write(data[start : start + chunk])
        return upload.commit()


@pytest.fixture(scope="module")
def model_bytes(probe_model: Path) -> bytes:
    return probe_model.read_bytes()


def test_an_upload_is_stored_under_its_hash_and_deduplicated(
    tmp_path: Path, model_bytes: bytes
) -> None:
    store = store_at(tmp_path)
    digest = sha(model_bytes)
    assert not store.has(digest)
    first = put(store, model_bytes)
    assert (first.sha256, first.size_bytes, first.deduplicated) == (
        digest,
        len(model_bytes),
        False,
    )
    assert store.has(digest)
    assert store.path(digest).read_bytes() == model_bytes
    again = put(store, model_bytes, chunk=len(model_bytes))
    assert again.deduplicated
    assert contents(store) == [digest]


def test_two_uploads_of_one_model_at_once_store_it_once(
    tmp_path: Path, model_bytes: bytes
) -> None:
    store = store_at(tmp_path)
    first, second = store.upload(sha(model_bytes)), store.upload(sha(model_bytes))
    first.write(model_bytes)
    second.write(model_bytes)
    assert not first.commit().deduplicated
    assert second.commit().deduplicated
    assert contents(store) == [sha(model_bytes)]


def test_a_hash_mismatch_stores_nothing(tmp_path: Path, model_bytes: bytes) -> None:
    store = store_at(tmp_path)
    wrong = sha(b"something else")
    with pytest.raises(InvalidModel, match=f"declared sha256 {wrong} but the .* hash to"):
        put(store, model_bytes, declared=wrong)
    assert contents(store) == []


@pytest.mark.parametrize("declared", ["abc", "A" * 64, "../" + "a" * 61, ""])
def test_a_malformed_hash_is_refused_everywhere(tmp_path: Path, declared: str) -> None:
    store = store_at(tmp_path)
    with pytest.raises(InvalidModel, match="not 64 lowercase hex digits"):
        store.upload(declared)
    with pytest.raises(InvalidModel, match="not 64 lowercase hex digits"):
        store.path(declared)
    with pytest.raises(InvalidModel, match="not 64 lowercase hex digits"):
        store.has(declared)
    assert contents(store) == []


def test_an_empty_upload_is_refused(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    with pytest.raises(InvalidModel, match="is empty"):
        put(store, b"")
    assert contents(store) == []


def test_a_file_that_is_not_onnx_is_refused_without_naming_our_paths(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    with pytest.raises(InvalidModel, match="is not a loadable ONNX model") as caught:
        put(store, b"PK\x03\x04 this is a zip, not a model" * 50)
    assert str(store.root) not in str(caught.value)
    assert contents(store) == []


@pytest.mark.parametrize("keep", [1, 0.5, -1], ids=["one-byte", "half", "all-but-one"])
def test_a_truncated_model_is_refused(tmp_path: Path, model_bytes: bytes, keep: float) -> None:
    store = store_at(tmp_path)
    cut = (
        model_bytes[:keep]
        if isinstance(keep, int)
        else model_bytes[: int(len(model_bytes) * keep)]
    )
    with pytest.raises(InvalidModel, match="is not a loadable ONNX model"):
        put(store, cut)
    assert contents(store) == []


def test_a_parseable_but_invalid_model_is_refused(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["undefined"], ["y"])],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    store = store_at(tmp_path)
    with pytest.raises(InvalidModel, match="undefined"):
        put(store, data.SerializeToString())
    assert contents(store) == []


def test_a_model_with_external_data_is_refused(tmp_path: Path) -> None:
    weights = numpy_helper.from_array(np.ones((64, 64), dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "split",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])],
        initializer=[weights],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
        tmp_path / "split.onnx",
        save_as_external_data=True,
        location="weights.bin",
        size_threshold=0,
    )
    store = store_at(tmp_path)
    # A file of that name beside the models must not satisfy the reference either.
    (store.root / "weights.bin").write_bytes((tmp_path / "weights.bin").read_bytes())
    with pytest.raises(InvalidModel, match=r"weights\.bin"):
        put(store, (tmp_path / "split.onnx").read_bytes())
    assert contents(store) == ["weights.bin"]


def test_the_size_limit_stops_the_upload_at_once(tmp_path: Path) -> None:
    store = store_at(tmp_path, max_bytes=2500)
    upload = store.upload(sha(b"x" * 3000))
    upload.write(b"x" * 1000)
    upload.write(b"x" * 1000)
    with pytest.raises(ModelTooLarge, match="limit of 2500 bytes"):
        upload.write(b"x" * 1000)
    assert contents(store) == []


def test_an_interrupted_upload_leaves_nothing(tmp_path: Path, model_bytes: bytes) -> None:
    store = store_at(tmp_path)
    with pytest.raises(ConnectionResetError), store.upload(sha(model_bytes)) as upload:
        upload.write(model_bytes[:100])
        raise ConnectionResetError("client went away")
    assert contents(store) == []


def test_opening_removes_what_a_crash_left_mid_upload(tmp_path: Path, model_bytes: bytes) -> None:
    store = store_at(tmp_path)
    put(store, model_bytes)
    staging = store.upload(sha(model_bytes))
    staging.write(model_bytes[:100])  # the broker "dies" here: no commit, no abort
    reopened = store_at(tmp_path)
    staging.abort()  # only closes the file now: the folder is gone already
    assert contents(reopened) == [sha(model_bytes)]


def test_streaming_back_gives_the_stored_bytes(tmp_path: Path, model_bytes: bytes) -> None:
    store = store_at(tmp_path)
    put(store, model_bytes)
    chunks = list(store.open_chunks(sha(model_bytes), chunk_bytes=100))
    assert b"".join(chunks) == model_bytes
    assert {len(c) for c in chunks[:-1]} == {100}
    assert 0 < len(chunks[-1]) <= 100
    assert b"".join(store.open_chunks(sha(model_bytes))) == model_bytes
    partial = store.open_chunks(sha(model_bytes), chunk_bytes=10)
    assert next(partial) == model_bytes[:10]
    del partial  # dropping it part-way closes the file (a ResourceWarning would fail the test)


def test_streaming_an_unknown_model_fails_before_the_first_chunk(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    with pytest.raises(ModelNotFound, match="not in the broker's store"):
        store.open_chunks(sha(b"never uploaded"))
    with pytest.raises(ModelNotFound):
        store.path(sha(b"never uploaded"))
    with pytest.raises(ValueError, match="chunk_bytes"):
        store.open_chunks(sha(b"never uploaded"), chunk_bytes=0)
    with pytest.raises(ValueError, match="max_bytes"):
        ModelStore(tmp_path / "other", 0)


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(min_size=1, max_size=2000))
def test_arbitrary_bytes_are_refused_as_invalid_models(tmp_path: Path, data: bytes) -> None:
    store = store_at(tmp_path)
    with pytest.raises(InvalidModel):
        put(store, data)
    assert contents(store) == []


def test_the_store_and_its_files_are_private(
    tmp_path: Path, model_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_at(tmp_path)
    stored = store.root / put(store, model_bytes).sha256
    assert (store.root.stat().st_mode & 0o777, stored.stat().st_mode & 0o777) == (0o700, 0o600)
    with store.upload(sha(model_bytes)) as upload:
        upload.write(model_bytes[:10])
        (staged,) = store.root.glob(".upload-*/*")
        assert (staged.parent.stat().st_mode & 0o777, staged.stat().st_mode & 0o777) == (
            0o700,
            0o600,
        )
    store.root.chmod(0o755)
    stored.chmod(0o644)
    store_at(tmp_path)
    assert (store.root.stat().st_mode & 0o777, stored.stat().st_mode & 0o777) == (0o700, 0o600)
    assert f"{store.root} was readable by others" in caplog.text
    assert f"{stored} was readable by others" in caplog.text
