"""The broker's model store: ONNX files named by their sha256 under `<state_dir>/models/`.

The folder is 0700 and every file in it 0600 (looser ones are tightened when the store opens,
with a warning). A file enters only through `Upload.commit`, which accepts it only if it is
not empty, hashes to the sha256 the client declared, and is a loadable single-file ONNX model
(`onnx.checker.check_model` on the file, full_check off). Until then the bytes live in a
private staging folder `.upload-*` next to the models; the accepted file is fsynced, renamed
into place (atomic on one filesystem) and the folder fsynced, so a crash at any point leaves
either no file under the hash or the whole file. Staging folders a crash left behind are
removed when the store opens. Models are never removed; a hash names one content forever.

The staging folder also means the checker resolves a model's external-data references in an
empty folder, so a model whose weights live in other files is refused: nodes receive one file.
A single-file ONNX model cannot exceed 2 GiB (protobuf's limit); `max_bytes` above that only
moves the refusal from the size check to the ONNX check.

Blocking: every method does file I/O, and `commit` parses the whole model to check it (memory
about the model's size, in onnx's C++ code). Callers on an event loop run them
through `asyncio.to_thread` (for `open_chunks`, each `next()` of the iterator). The store is
safe to use from several threads; one `Upload` belongs to one thread at a time.

Errors::

    ModelStoreError
    ├── InvalidModel     a malformed or wrong declared sha256, an empty upload, not a loadable
    │                    single-file ONNX model (INVALID_ARGUMENT); nothing was stored
    ├── ModelTooLarge    the upload passed the store's size limit (RESOURCE_EXHAUSTED)
    └── ModelNotFound    no model of that sha256 in the store (NOT_FOUND)
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx

from broker.state.permissions import PRIVATE_FILE, private_dir, tighten
from common import replica_memory
from common.content import InvalidDigest, PutResult, check_sha256
from common.private_files import fsync_dir

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
_STAGING_PREFIX = ".upload-"


class ModelStoreError(Exception):
    """Base class of the model store's errors; the message is meant for the caller."""


class InvalidModel(ModelStoreError):
    pass


class ModelTooLarge(ModelStoreError):
    pass


class ModelNotFound(ModelStoreError):
    pass


def _checked(sha256: str, what: str = "sha256") -> str:
    try:
        return check_sha256(sha256, what)
    except InvalidDigest as err:
        raise InvalidModel(str(err)) from None


class Upload:
    """One model being received: `write` each chunk, then `commit`, or `abort`. As a context
    manager it aborts on exit unless committed, so an interrupted stream leaves nothing."""

    def __init__(self, store: ModelStore, sha256: str) -> None:
        self.sha256 = _checked(sha256, "declared sha256")
        self._store = store
        self._digest = hashlib.sha256()
        self._size = 0
        self._dir = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=store.root))
        self._tmp = self._dir / "model.onnx"
        self._file = os.fdopen(
            os.open(self._tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, PRIVATE_FILE), "wb"
        )

    def __enter__(self) -> Upload:
        return self

    @property
    def size(self) -> int:
        """Bytes received so far."""
        return self._size

    def __exit__(self, *exc_info: object) -> None:
        self.abort()

    def write(self, chunk: bytes) -> None:
        """Append a chunk. ModelTooLarge (and the upload aborted) as soon as the total passes
        the store's limit."""
        self._size += len(chunk)
        if self._size > self._store.max_bytes:
            self.abort()
            raise ModelTooLarge(
                f"model {self.sha256[:12]} is over the broker's limit of "
                f"{self._store.max_bytes} bytes; nothing was stored"
            )
        self._digest.update(chunk)
        self._file.write(chunk)

    def commit(self) -> PutResult:
        """Check the content and store it under its sha256. `deduplicated` is True when the
        store had it already (the upload is then dropped). InvalidModel with what was wrong
        otherwise; either way the staging folder is gone afterwards."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if self._size == 0:
                raise InvalidModel(f"the upload of {self.sha256[:12]} is empty")
            actual = self._digest.hexdigest()
            if actual != self.sha256:
                raise InvalidModel(
                    f"declared sha256 {self.sha256} but the {self._size} bytes sent hash to "
                    f"{actual}; nothing was stored"
                )
            target = self._store.root / self.sha256
            if target.exists():
                return PutResult(self.sha256, self._size, deduplicated=True)
            self._check_onnx()
            os.replace(self._tmp, target)
            fsync_dir(self._store.root)
        finally:
            self.abort()
        logger.info("model store: stored %s (%d bytes)", self.sha256[:12], self._size)
        return PutResult(self.sha256, self._size, deduplicated=False)

    def _check_onnx(self) -> None:
        try:
            onnx.checker.check_model(str(self._tmp), full_check=False)
        except onnx.checker.ValidationError as err:
            # The checker names the staging paths: the caller does not need our layout.
            what = str(err).replace(str(self._tmp), "<upload>").replace(f"{self._dir}{os.sep}", "")
            raise InvalidModel(
                f"model {self.sha256[:12]} is not a loadable ONNX model: "
                f"{what.strip().rstrip('.')}; "
                "nothing was stored"
            ) from None

    def abort(self) -> None:
        """Drop what was received; idempotent, and a no-op after `commit`."""
        if not self._file.closed:
            self._file.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class ModelStore:
    """Content-addressed ONNX models under `root` (the broker's `<state_dir>/models`)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        """Open the store at `root`, creating it, and remove staging folders a crash left.
        `max_bytes` is the largest model an upload may send. Blocking."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, not {max_bytes}")
        self.root = root
        self.max_bytes = max_bytes
        private_dir(root)
        for stale in root.glob(f"{_STAGING_PREFIX}*"):
            logger.info("model store: removing %s, left by an interrupted upload", stale.name)
            shutil.rmtree(stale, ignore_errors=True)
        for stored in root.iterdir():
            tighten(stored)

    def upload(self, sha256: str) -> Upload:
        """Start receiving the model the client declares to hash to `sha256`. InvalidModel if
        `sha256` is not 64 lowercase hex digits."""
        return Upload(self, sha256)

    def path(self, sha256: str) -> Path:
        """The stored file of `sha256`. ModelNotFound when absent; InvalidModel if `sha256`
        is malformed."""
        path = self.root / _checked(sha256)
        if not path.is_file():
            raise ModelNotFound(f"model {sha256} is not in the broker's store; upload it first")
        return path

    def gpu_need(self, sha256: str) -> replica_memory.ModelMemory | None:
        """The GPU memory the stored model needs, estimated from its file
        (`common.replica_memory.estimate`, cached per file); None when the file cannot be
        read (logged). ModelNotFound when absent."""
        try:
            return replica_memory.estimate(self.path(sha256))
        except (OSError, ValueError) as err:
            logger.warning("model %s: its GPU memory need is unknown: %s", sha256[:12], err)
            return None

    def has(self, sha256: str) -> bool:
        """Whether `sha256` is stored. InvalidModel if `sha256` is malformed."""
        return (self.root / _checked(sha256)).is_file()

    def open_chunks(self, sha256: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The stored model's bytes in chunks of `chunk_bytes` (the last one shorter), to
        stream to a node. ModelNotFound or InvalidModel at once, before any chunk. The file is
        opened at the first `next()` and closed at the end or when the iterator is closed or
        dropped. Each `next()` blocks on a disk read."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        return _chunks(self.path(sha256), chunk_bytes)


def _chunks(path: Path, chunk_bytes: int) -> Iterator[bytes]:
    with path.open("rb") as file:
        while chunk := file.read(chunk_bytes):
            yield chunk
