"""Private files of the broker's state dir: folders 0700, files 0600.

The state holds live deployment tokens (the SQLite file and its `-wal`) and clients' models, so
no other local user may read it. The helpers live in `common.private_files`, which the node's
state uses too: new folders and files are created private (`private_dir`, `PRIVATE_FILE`);
what an older broker or a copy left looser is tightened at start (`tighten`), with a warning
naming the path. Blocking (file system calls).
"""

from common.private_files import (
    PRIVATE_DIR,
    PRIVATE_FILE,
    create_private_file,
    private_dir,
    tighten,
)

__all__ = ["PRIVATE_DIR", "PRIVATE_FILE", "create_private_file", "private_dir", "tighten"]
