"""TLS material as PEM bytes, without gRPC or `cryptography`: what the runtime (inside the
image) reads, and what `common.certs` checks and `runtime.tls` turns into credentials."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TlsIdentity:
    """One party's TLS material as PEM bytes: the CA its peers' certificates must chain to,
    and its own certificate chain and key (empty for a client that presents none, and the CA
    empty for a server that asks for no client certificate). The key is left out of
    `repr`."""

    ca: bytes = b""
    cert: bytes = b""
    key: bytes = field(default=b"", repr=False)


def read_pem(path: Path, flag: str) -> bytes:
    """The PEM file `path` (given as `flag`); ValueError naming both when it cannot be read
    or holds no PEM block. The runtime's only check: the node checked the files it wrote."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{flag} {path}: {err.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path} holds no PEM block")
    return data
