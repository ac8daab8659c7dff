"""Content addressing, shared by the broker's model store, the node's model cache and the
edge client: files are named by the sha256 of their bytes."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import quote

_SHA256 = re.compile(r"[0-9a-f]{64}")


class InvalidDigest(ValueError):
    """A value that is not a sha256 hex digest (each service maps it to its own refusal)."""


def check_sha256(value: str, what: str = "sha256") -> str:
    """`value` if it is 64 lowercase hex digits; InvalidDigest (naming `what`, quoting a
    short prefix of the value) otherwise."""
    if not _SHA256.fullmatch(value):
        raise InvalidDigest(f"{what} {quote(value)} is not 64 lowercase hex digits")
    return value


def file_sha256(path: Path, block_bytes: int = 1 << 20) -> str:
    """The sha256 hex digest of a file. Blocking: reads the whole file."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(block_bytes):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class PutResult:
    """What storing one file did: its name, its size, and whether it was there already."""

    sha256: str
    size_bytes: int
    deduplicated: bool
