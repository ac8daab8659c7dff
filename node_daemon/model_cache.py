"""The node's model cache: ONNX files (and warm-up .npz files) named by their sha256.

A file enters only through `Upload.commit`, which checks the sha256 the sender declared
against the content and renames a complete temporary file into place: nothing half-written
is ever visible under its hash. `path` checks the content again before a file is used
(once per file and modification: not after the upload that just hashed it), so a file
damaged on disk is refused, not served.

The folder is 0700 and every file in it `file_mode` (0600 unless a runtime's replicas read the
files as another user), whatever the umask: the cache holds clients' models, as the broker's
model store does. A looser folder left by an older daemon is tightened when the cache opens.
File I/O blocks: callers on an event loop use `asyncio.to_thread`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from common.content import PutResult, check_sha256, file_sha256
from common.private_files import PRIVATE_FILE, private_dir
from node_daemon.errors import InvalidRequest, ModelNotCached, ModelTooLarge

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 2 * 1024**3


class Upload:
    """One file being received. `write` each chunk, then `commit` (or `abort`)."""

    def __init__(self, cache: ModelCache, sha256: str, max_bytes: int) -> None:
        self._cache = cache
        self.sha256 = check_sha256(sha256, "declared sha256")
        self._max = max_bytes
        self._digest = hashlib.sha256()
        self._size = 0
        fd, name = tempfile.mkstemp(prefix=".upload-", dir=cache.root)
        self._tmp = Path(name)
        self._file = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._max:
            self.abort()
            raise ModelTooLarge(
                f"upload of {self.sha256[:12]} exceeds the node's limit of {self._max} bytes"
            )
        self._digest.update(data)
        self._file.write(data)

    def commit(self) -> PutResult:
        """Check the content against the declared sha256 and make the file visible."""
        self._file.close()
        actual = self._digest.hexdigest()
        if actual != self.sha256:
            self._tmp.unlink(missing_ok=True)
            raise InvalidRequest(
                f"declared sha256 {self.sha256} but the {self._size} bytes sent hash to "
                f"{actual}; nothing was stored"
            )
        if self._size == 0:
            self._tmp.unlink(missing_ok=True)
            raise InvalidRequest("the upload is empty")
        target = self._cache.root / self.sha256
        if target.exists():
            self._tmp.unlink(missing_ok=True)
            return PutResult(self.sha256, self._size, deduplicated=True)
        self._tmp.chmod(self._cache.file_mode)
        # These bytes were hashed as they were written: `path` need not read them again
        # (46.7 MB is 30-50 ms of a CPU the replica serving beside a migration's target
        # needs). Stated before the rename, so the key is the file that was hashed.
        stat = self._tmp.stat()
        os.replace(self._tmp, target)
        self._cache.verified(self.sha256, stat)
        logger.info("model cache: stored %s (%d bytes)", self.sha256[:12], self._size)
        return PutResult(self.sha256, self._size, deduplicated=False)

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


class ModelCache:
    def __init__(
        self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES, file_mode: int = PRIVATE_FILE
    ) -> None:
        """The cache in `root` (made 0700, or tightened to it). `file_mode`: what every cached
        file gets, those already there included (a daemon may change runtimes between
        starts): 0600 when replicas run as this user; 0644 when they run as another one and
        read their file through a bind mount (Docker), the 0700 folder keeping other local
        users out all the same."""
        self.root = root
        self.max_bytes = max_bytes
        self.file_mode = file_mode
        private_dir(root)
        for stale in root.glob(".upload-*"):  # left by a crash mid-upload
            stale.unlink(missing_ok=True)
        for cached in root.iterdir():
            if cached.is_file() and cached.stat().st_mode & 0o7777 != file_mode:
                cached.chmod(file_mode)
        self._verified: dict[str, tuple[int, int]] = {}

    def upload(self, sha256: str) -> Upload:
        return Upload(self, sha256, self.max_bytes)

    def put_file(self, path: Path) -> PutResult:
        """Copy a local file in (for tools and tests that have the file at hand)."""
        upload = self.upload(file_sha256(path))
        try:
            with path.open("rb") as file:
                while chunk := file.read(1 << 20):
                    upload.write(chunk)
        except BaseException:
            upload.abort()
            raise
        return upload.commit()

    def path(self, sha256: str) -> Path:
        """The cached file of `sha256`, its content checked. ModelNotCached when absent;
        a file whose content no longer matches is removed and reported absent."""
        check_sha256(sha256)
        path = self.root / sha256
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise ModelNotCached(
                f"model {sha256} is not in this node's cache; upload it with PutModel first"
            ) from None
        if self._verified.get(sha256) != (stat.st_size, stat.st_mtime_ns):
            if file_sha256(path) != sha256:
                path.unlink(missing_ok=True)
                self._verified.pop(sha256, None)
                raise ModelNotCached(
                    f"model {sha256} in this node's cache was damaged and has been removed; "
                    "upload it again"
                )
            self.verified(sha256, stat)
        return path

    def verified(self, sha256: str, stat: os.stat_result) -> None:
        """Take the file of `sha256` as checked while it keeps this size and mtime."""
        self._verified[sha256] = (stat.st_size, stat.st_mtime_ns)

    def has(self, sha256: str) -> bool:
        return (self.root / sha256).is_file()
