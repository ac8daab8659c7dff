"""Client API keys: their format, and the salted hash the store keeps instead of the key.

A key is ``<client_id>.<secret>``:

- ``client_id``: 1 to 64 characters of ``A-Z a-z 0-9 _ -`` (no dot, so the first dot splits);
- ``secret``: 16 to 256 characters of the same alphabet (`new_api_key` makes 43 random ones,
  256 bits, with `secrets.token_urlsafe`).

The id in the key lets the store find the one row to check, and the check is scrypt over the
secret with a per-client random salt, compared with `hmac.compare_digest`. The hash text
carries its parameters (``scrypt$n$r$p$salt$hash``, hex), so stronger parameters can come
later without invalidating stored keys. Hashing is CPU-bound, about 35 ms: callers on an event
loop run it off the loop (`StateStore.client_for_api_key` is blocking for this reason too).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import secrets

_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SECRET = re.compile(r"[A-Za-z0-9_-]{16,256}")

_N, _R, _P = 2**14, 8, 1
"""scrypt's interactive-login parameters: 16 MiB of memory per hash."""
_SALT_BYTES = 16
_HASH_BYTES = 32


def check_client_id(client_id: str) -> str:
    """`client_id` if it is a valid client id; ValueError saying the rule otherwise."""
    if not _ID.fullmatch(client_id):
        raise ValueError(
            f"client id {client_id!r} must be 1 to 64 characters of A-Z, a-z, 0-9, '_' or '-'"
        )
    return client_id


def parse_api_key(api_key: str) -> tuple[str, str] | None:
    """(client_id, secret) of a well-formed key; None for anything else."""
    client_id, dot, secret = api_key.partition(".")
    if not dot or not _ID.fullmatch(client_id) or not _SECRET.fullmatch(secret):
        return None
    return client_id, secret


def parse_api_keys_file(text: str, source: str) -> tuple[str, ...]:
    """The keys of an API keys file (one per line; blank lines and lines starting `#` are
    skipped). ValueError naming `source` and the line for a line that is not a key or a second
    key of one client; the message never quotes the line (it may be a key)."""
    keys: list[str] = []
    lines: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parsed = parse_api_key(line)
        if parsed is None:
            raise ValueError(
                f"{source}, line {number}: not an API key "
                "(<client id>.<secret>; make one with `offload keygen CLIENT_ID`)"
            )
        if (first := lines.setdefault(parsed[0], number)) != number:
            raise ValueError(
                f"{source}, line {number}: a second key of client {parsed[0]!r} "
                f"(line {first} has one); a client has one key"
            )
        keys.append(line)
    return tuple(keys)


def new_api_key(client_id: str) -> str:
    """A fresh random key for `client_id` (ValueError if the id is malformed)."""
    return f"{check_client_id(client_id)}.{secrets.token_urlsafe(32)}"


def _scrypt(secret: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(
        secret.encode(), salt=salt, n=n, r=r, p=p, dklen=_HASH_BYTES, maxmem=256 * n * r + 2**20
    )


def hash_secret(secret: str) -> str:
    """The self-describing salted hash of `secret` (a new random salt on every call)."""
    salt = secrets.token_bytes(_SALT_BYTES)
    digest = _scrypt(secret, salt, _N, _R, _P)
    return f"scrypt${_N}${_R}${_P}${salt.hex()}${digest.hex()}"


def verify_secret(secret: str, key_hash: str) -> bool:
    """Whether `secret` hashes to `key_hash`, compared in constant time."""
    scheme, n, r, p, salt, digest = key_hash.split("$")
    if scheme != "scrypt":
        raise ValueError(f"unknown key hash scheme {scheme!r}")
    actual = _scrypt(secret, bytes.fromhex(salt), int(n), int(r), int(p))
    return hmac.compare_digest(actual, bytes.fromhex(digest))


@functools.cache
def _decoy_hash() -> str:
    return hash_secret(secrets.token_urlsafe(32))


def spend_verify_time(secret: str) -> None:
    """Take the time a real check takes: used when a key names an unknown client, so response
    times do not tell which client ids exist."""
    verify_secret(secret, _decoy_hash())
