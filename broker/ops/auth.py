"""Who may read the ops server: holders of the ops token.

Two ways to show it, both checked in constant time:

- `Authorization: Bearer <token>`: scripts and the `offload` CLI (`--ops-token-file`);
- the session cookie a browser gets from `POST /login` (the login form of the dashboard): an
  HMAC of the token, never the token itself, `HttpOnly` (the page's scripts cannot read it),
  `SameSite=Strict` (other sites' pages cannot send it) and, when the page is served over
  HTTPS, `Secure` (the browser never sends it in plaintext). It stays valid until the token
  changes or the browser ends the session; `POST /logout` drops it.

The token never travels in a URL, so it cannot end up in an access log or a browser history.

A one-time login link is how a holder of the token lets a browser in without pasting it (the
demo prints one): `mint_login_code` makes a random code, not derived from the token, that
`redeem_login_code` accepts once, within `LOGIN_CODE_TTL_S`. The link carries it in its
fragment (`/login#code=...`), which browsers never send to the server, so it is in no access
log; the page posts it and drops it from the address bar. Only digests of the codes are kept.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from aiohttp import web

SESSION_COOKIE = "offload_ops_session"
_SESSION_CONTEXT = b"edge-offload ops session v1"

LOGIN_CODE_TTL_S = 300.0
"""How long a one-time login code stays valid after it is minted, seconds."""
MAX_LOGIN_CODES = 16
"""Codes outstanding at once; minting another forgets the oldest (memory stays bounded)."""
MAX_LOGIN_CODE_CHARS = 128
"""A longer code is refused before it is hashed: minted ones have 32 characters."""


class OpsAuth:
    """The ops token and the checks on it. `metrics_open`: whether `/metrics` is readable
    without the token (Prometheus scrapers often have none)."""

    def __init__(
        self,
        token: str,
        *,
        metrics_open: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not token:
            raise ValueError("the ops token must not be empty")
        self._bearer = f"Bearer {token}".encode()
        self._session = hmac.new(token.encode(), _SESSION_CONTEXT, hashlib.sha256).hexdigest()
        self.metrics_open = metrics_open
        self._clock = clock
        self._login_codes: list[tuple[bytes, float]] = []
        """(sha256 of a one-time code, when it expires on `clock`), oldest first."""

    def mint_login_code(self) -> str:
        """A new one-time login code (URL-safe, 32 characters), valid once for
        `LOGIN_CODE_TTL_S`. Only whoever holds the token may ask for one (the ops app checks)."""
        now = self._clock()
        live = [(digest, until) for digest, until in self._login_codes if until > now]
        code = secrets.token_urlsafe(24)
        self._login_codes = [
            *live[-(MAX_LOGIN_CODES - 1) :],
            (_digest(code), now + LOGIN_CODE_TTL_S),
        ]
        return code

    def redeem_login_code(self, supplied: str) -> bool:
        """Whether `supplied` is a code minted here, not used yet and not expired; it is used
        up either way. Compared in constant time with every code outstanding."""
        if not supplied or len(supplied) > MAX_LOGIN_CODE_CHARS or not supplied.isascii():
            return False
        now = self._clock()
        digest = _digest(supplied)
        found = None
        for entry in self._login_codes:  # no early exit: the same work whichever matches
            if hmac.compare_digest(entry[0], digest):
                found = entry
        self._login_codes = [e for e in self._login_codes if e is not found and e[1] > now]
        return found is not None and found[1] > now

    def token_matches(self, supplied: str) -> bool:
        """Whether `supplied` (what the login form sent) is the token."""
        return hmac.compare_digest(f"Bearer {supplied}".encode(), self._bearer)

    def allows(self, request: web.Request) -> bool:
        """Whether the request carries the token (header) or a session of it (cookie)."""
        header = request.headers.get("Authorization", "")
        cookie = request.cookies.get(SESSION_COOKIE, "")
        return hmac.compare_digest(header.encode(), self._bearer) or hmac.compare_digest(
            cookie.encode(), self._session.encode()
        )

    def start_session(self, response: web.StreamResponse, *, secure: bool) -> None:
        """Give the browser its session cookie (after a successful login); `secure`: the
        login came over HTTPS, so the cookie must never travel over plain HTTP."""
        response.set_cookie(
            SESSION_COOKIE,
            self._session,
            httponly=True,
            samesite="Strict",
            path="/",
            secure=secure,
        )

    @staticmethod
    def end_session(response: web.StreamResponse) -> None:
        response.del_cookie(SESSION_COOKIE, path="/")


def _digest(code: str) -> bytes:
    return hashlib.sha256(code.encode()).digest()
