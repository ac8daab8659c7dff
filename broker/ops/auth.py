"""Who may read the ops server: holders of the ops token.

Two ways to show it, both checked in constant time:

- `Authorization: Bearer <token>`: scripts and the `offload` CLI (`--ops-token-file`);
- the session cookie a browser gets from `POST /login` (the login form of the dashboard): an
  HMAC of the token, never the token itself, `HttpOnly` (the page's scripts cannot read it),
  `SameSite=Strict` (other sites' pages cannot send it) and, when the page is served over
  HTTPS, `Secure` (the browser never sends it in plaintext). It stays valid until the token
  changes or the browser ends the session; `POST /logout` drops it.

The token never travels in a URL, so it cannot end up in an access log or a browser history.
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

SESSION_COOKIE = "offload_ops_session"
_SESSION_CONTEXT = b"edge-offload ops session v1"


class OpsAuth:
    """The ops token and the checks on it. `metrics_open`: whether `/metrics` is readable
    without the token (Prometheus scrapers often have none)."""

    def __init__(self, token: str, *, metrics_open: bool = True) -> None:
        if not token:
            raise ValueError("the ops token must not be empty")
        self._bearer = f"Bearer {token}".encode()
        self._session = hmac.new(token.encode(), _SESSION_CONTEXT, hashlib.sha256).hexdigest()
        self.metrics_open = metrics_open

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
