"""Files only their owner may read: folders 0700, files 0600, whatever the umask.

The broker's state holds live deployment tokens (the SQLite file and its `-wal`) and clients'
models; the node's holds the same models, and each replica's token and log. No other local
user may read either. New folders and files are created private (`private_dir`,
`create_private_file`, `open_private`); what an older version or a copy left looser is
tightened at start (`tighten`), with a warning naming the path.

Files an operator gives by flag (a token file, the API keys file) are the operator's: they are
read as they are, and a warning names one that other users can read, with its mode
(`warn_if_readable`, `read_secret`).

Blocking (file system calls).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import BinaryIO

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


def open_private(path: Path) -> BinaryIO:
    """`path` opened for writing from its start (created or truncated), mode 0600 from its
    creation on: never readable by others, not even for a moment. A file that existed with
    another mode gets 0600 too."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "wb")


def warn_if_readable(path: Path, flag: str, group_may_read: bool = False) -> bool:
    """Warn, naming `flag`, the file and its mode, when group or other users may read or
    write `path` (other users only, with `group_may_read`: a file the service's group is
    meant to read, as the systemd recipe's root:edge-offload 0640 API keys file); True when
    it warned. The file is left as it is: it is the operator's."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if not mode & (0o007 if group_may_read else 0o077):
        return False
    logger.warning(
        "%s %s is readable by other users (mode %04o): chmod %s it",
        flag,
        path,
        mode,
        "640" if group_may_read else "600",
    )
    return True


def read_secret(path: Path, flag: str) -> str:
    """The secret in `path` (a token file), stripped; ValueError naming `flag` when it is
    empty. Warns when other users can read it (`warn_if_readable`)."""
    text = path.read_text().strip()
    if not text:
        raise ValueError(f"{flag} {path} is empty")
    warn_if_readable(path, flag)
    return text


def fsync_dir(path: Path) -> None:
    """Flush folder `path`'s entries to disk: a file renamed or created in it survives a
    crash only once its folder is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
