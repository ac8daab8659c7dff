"""The node's content-addressed model cache: nothing half-written, nothing unchecked."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from common.content import InvalidDigest
from node_daemon.errors import InvalidRequest, ModelNotCached, ModelTooLarge
from node_daemon.model_cache import ModelCache

CONTENT = b"onnx bytes " * 1000
SHA = hashlib.sha256(CONTENT).hexdigest()


def leftovers(cache: ModelCache) -> list[str]:
    return sorted(p.name for p in cache.root.iterdir() if p.name != SHA)


def upload(cache: ModelCache, sha: str, chunks: list[bytes]) -> object:
    pending = cache.upload(sha)
    for chunk in chunks:
        pending.write(chunk)
    return pending.commit()


def test_upload_in_chunks_then_dedup(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "models")
    first = upload(cache, SHA, [CONTENT[:5000], CONTENT[5000:]])
    assert (first.sha256, first.size_bytes, first.deduplicated) == (SHA, len(CONTENT), False)
    assert cache.path(SHA).read_bytes() == CONTENT
    again = upload(cache, SHA, [CONTENT])
    assert again.deduplicated
    assert leftovers(cache) == []


def test_wrong_declared_hash_stores_nothing(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "models")
    wrong = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(InvalidRequest, match=f"declared sha256 {wrong} but the 11000 bytes"):
        upload(cache, wrong, [CONTENT])
    assert list(cache.root.iterdir()) == []


@pytest.mark.parametrize(
    "sha", ["abc", SHA.upper(), SHA[:-1] + "g"], ids=["short", "upper", "hex"]
)
def test_malformed_hash_is_refused(tmp_path: Path, sha: str) -> None:
    cache = ModelCache(tmp_path / "models")
    with pytest.raises(InvalidDigest, match="not 64 lowercase hex digits"):
        cache.upload(sha)
    with pytest.raises(InvalidDigest, match="not 64 lowercase hex digits"):
        cache.path(sha)


def test_upload_over_the_limit_stores_nothing(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "models", max_bytes=4096)
    with pytest.raises(ModelTooLarge, match="limit of 4096 bytes"):
        upload(cache, SHA, [CONTENT[:3000], CONTENT[3000:6000]])
    assert list(cache.root.iterdir()) == []


def test_empty_upload_is_refused(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "models")
    with pytest.raises(InvalidRequest, match="empty"):
        upload(cache, hashlib.sha256(b"").hexdigest(), [])


def test_missing_and_damaged_models_are_not_served(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "models")
    with pytest.raises(ModelNotCached, match="upload it with PutModel first"):
        cache.path(SHA)
    upload(cache, SHA, [CONTENT])
    cache.path(SHA)
    (cache.root / SHA).write_bytes(CONTENT[:-1] + b"!")
    with pytest.raises(ModelNotCached, match="damaged and has been removed"):
        cache.path(SHA)
    assert not cache.has(SHA)


def test_a_crashed_upload_leaves_nothing_after_restart(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "models")
    pending = cache.upload(SHA)
    pending.write(CONTENT[:100])  # the process dies here: the temporary file stays
    assert leftovers(cache)
    ModelCache(tmp_path / "models")
    assert leftovers(cache) == []
    pending.abort()  # (only closes this test's file handle: the file is gone already)


def counting_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file the cache hashes from disk from now on."""
    import node_daemon.model_cache as model_cache

    hashed: list[Path] = []
    real = model_cache.file_sha256

    def counted(path: Path, *args: int) -> str:
        hashed.append(path)
        return real(path, *args)

    monkeypatch.setattr(model_cache, "file_sha256", counted)
    return hashed


def test_an_upload_is_not_read_again_before_its_first_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ModelCache(tmp_path / "models")
    hashed = counting_hashes(monkeypatch)
    upload(cache, SHA, [CONTENT])
    assert cache.path(SHA).read_bytes() == CONTENT
    assert hashed == []  # hashed as it was written
    (cache.root / SHA).write_bytes(CONTENT[:-1] + b"!")
    with pytest.raises(ModelNotCached, match="damaged and has been removed"):
        cache.path(SHA)
    assert hashed == [cache.root / SHA]


def test_a_deduplicated_upload_does_not_vouch_for_the_file_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restarted node's cache has files it has not checked: the same bytes uploaded again
    # (deduplicated, not written) say nothing about the file already there.
    upload(ModelCache(tmp_path / "models"), SHA, [CONTENT])
    (tmp_path / "models" / SHA).write_bytes(CONTENT[:-1] + b"!")
    cache = ModelCache(tmp_path / "models")
    hashed = counting_hashes(monkeypatch)
    assert upload(cache, SHA, [CONTENT]).deduplicated
    with pytest.raises(ModelNotCached, match="damaged and has been removed"):
        cache.path(SHA)
    assert len(hashed) == 1


def test_cached_models_are_the_owners_only_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        root = tmp_path / "models"
        root.mkdir(mode=0o755)  # as an older daemon left it
        cache = ModelCache(root)
        upload(cache, SHA, [CONTENT])
        assert (root.stat().st_mode & 0o777, (root / SHA).stat().st_mode & 0o777) == (
            0o700,
            0o600,
        )
        # Docker's replicas run as the image's user and read their model through a bind
        # mount: they need the read bit for others; the folder keeps other users out.
        ModelCache(root, file_mode=0o644)
        assert (root / SHA).stat().st_mode & 0o777 == 0o644
        ModelCache(root)
        assert (root / SHA).stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(previous)
