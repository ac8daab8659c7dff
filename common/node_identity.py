"""A node's identity without TLS: the node secret, which binds a node id to one daemon.

The node makes its secret once (32 random bytes, URL-safe base64) and keeps it in its state
dir, `<state-dir>/node-secret`, mode 0600 from its creation whatever the umask. It shows the
secret on every call to the broker's NodeRegistry (metadata `offload-node-secret`). The first
registration of an id binds the id to the secret's sha256, which the broker keeps in its
state; from then on only a daemon that shows that secret registers or heartbeats as the id
(with TLS, a certificate for the id also proves it once the holder is no longer live). The
broker in turn shows the same secret to the node's NodeAgent (`authorization: Bearer ...`):
no other node has it, unlike the join token.

The secret is high-entropy, so a plain sha256 is enough to keep it (no salt, no slow hash),
and comparisons are constant time. Blocking (file system calls).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from pathlib import Path

from common.private_files import fsync_dir

logger = logging.getLogger(__name__)

NODE_SECRET_HEADER = "offload-node-secret"
"""The metadata key a node shows its secret under on NodeRegistry calls."""
SECRET_FILE = "node-secret"
"""Its file in the node's state dir."""
MIN_SECRET_CHARS = 32
MAX_SECRET_CHARS = 256
_SECRET = re.compile(r"[A-Za-z0-9_-]+")


def new_secret() -> str:
    """A fresh secret: 32 random bytes, 43 URL-safe characters."""
    return secrets.token_urlsafe(32)


def well_formed(secret: str) -> bool:
    """Whether `secret` looks like a node secret (length and alphabet), before any hashing."""
    return MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS and bool(_SECRET.fullmatch(secret))


def secret_sha256(secret: str) -> str:
    """What the broker keeps of a secret: its sha256, hex."""
    return hashlib.sha256(secret.encode()).hexdigest()


def proves(secret: str | None, bound_sha256: str | None) -> bool:
    """Whether `secret` is the one an id is bound to (`bound_sha256`); constant time. False
    for a missing secret or an unbound id."""
    if not secret or bound_sha256 is None or not well_formed(secret):
        return False
    return hmac.compare_digest(secret_sha256(secret).encode(), bound_sha256.encode())


def load_or_create_secret(state_dir: Path) -> str:
    """The node secret kept in `state_dir`, made (0600, atomically: a crash leaves either no
    file or a whole one) when there is none. A file others may read is tightened to 0600,
    with a warning. ValueError, naming the file, when it holds something else than a secret:
    the operator removes it and retires the node id (docs/OPERATIONS.md, Security)."""
    path = state_dir / SECRET_FILE
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    secret = new_secret()
    staging = state_dir / f".{SECRET_FILE}.{os.getpid()}.tmp"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, f"{secret}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        # link, not rename: of two daemons starting on one state dir, the first one's wins.
        os.link(staging, path)
    except FileExistsError:
        return _read(path)
    finally:
        staging.unlink(missing_ok=True)
    fsync_dir(state_dir)
    logger.info("node secret made: %s (0600)", path)
    return secret


def _read(path: Path) -> str:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, 0o600)
        logger.warning("%s was readable by others (mode %o); tightened to 600", path, mode)
    secret = path.read_text().strip()
    if not well_formed(secret):
        raise ValueError(
            f"{path} does not hold a node secret: remove it, and have the operator retire "
            "this node id (offload retire NODE_ID) before the node joins again"
        )
    return secret
