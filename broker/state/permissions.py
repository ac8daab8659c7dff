"""Private files of the broker's state dir: folders 0700, files 0600.

The state holds live deployment tokens (the SQLite file and its `-wal`) and clients' models, so
no other local user may read it. New folders and files are created private (`private_dir`,
`PRIVATE_FILE`); what an older broker or a copy left looser is tightened at start
(`tighten`), with a warning naming the path. Blocking (file system calls).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def private_dir(path: Path) -> None:
    """Create `path` (and missing parents) as a 0700 folder, or tighten it if it exists."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    tighten(path)


def tighten(path: Path) -> bool:
    """Take group and other permissions off `path` (a folder stays 0700 at most, a file 0600);
    True when it had to, with a warning naming the path. A missing path or a symlink is left
    alone (False)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode) or not info.st_mode & 0o077:
        return False
    limit = PRIVATE_DIR if stat.S_ISDIR(info.st_mode) else PRIVATE_FILE
    mode = stat.S_IMODE(info.st_mode) & limit
    os.chmod(path, mode)
    logger.warning(
        "state: %s was readable by others (mode %o); tightened to %o",
        path,
        stat.S_IMODE(info.st_mode),
        mode,
    )
    return True


def create_private_file(path: Path) -> None:
    """Create `path` empty with mode 0600 unless it exists (then it is tightened)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, PRIVATE_FILE))
    except FileExistsError:
        tighten(path)
