"""Where the model zoo keeps its files, and the one way it writes them.

Layout under the cache root (``$EDGE_OFFLOAD_CACHE``, default ``~/.cache/edge-offload``)::

    models/<name>-<16 hex>.onnx   built or extracted models, named by content key
    wheels/<wheel file>           PyPI wheels that pretrained models are extracted from

Every file is written through :func:`atomic_write`, so a reader sees either no file or a
complete one, never a half-written model, whatever happens to the writer.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "EDGE_OFFLOAD_CACHE"
DEFAULT_CACHE_ROOT = Path("~/.cache/edge-offload")
TEMP_SUFFIX = ".partial"
CACHE_FILE_MODE = 0o644


def cache_root() -> Path:
    """Return the cache root: ``$EDGE_OFFLOAD_CACHE`` if set and non-empty, else the default.

    Read on every call, so tests may point it elsewhere with ``monkeypatch.setenv``.
    """
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else DEFAULT_CACHE_ROOT.expanduser()


def models_dir() -> Path:
    """Return (without creating) the directory holding cached ``.onnx`` models."""
    return cache_root() / "models"


def wheels_dir() -> Path:
    """Return (without creating) the directory holding downloaded wheels."""
    return cache_root() / "wheels"


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either absent, its old self or complete.

    The bytes go to a temporary file in the same directory (created if missing), are fsynced,
    and the temporary file is renamed over ``path`` with :func:`os.replace`. On any error the
    temporary file is removed and the error propagates.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), CACHE_FILE_MODE)  # mkstemp creates 0600; others may read
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    logger.debug("wrote %s (%d bytes)", path, len(data))
