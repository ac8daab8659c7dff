"""The broker's ops HTTP server (aiohttp): health, metrics, JSON API and the live dashboard.

Routes, GET (HEAD too, as HTTP wants) unless said otherwise; any other method is 405:

- `/healthz`: `ok`, text/plain. Always open. A standby broker serves `create_standby_app`
  instead: 503 and `{"role": "standby", "leader": ...}` everywhere.
- `/metrics`: Prometheus text format. The state gauges, the standby gauges and the clients'
  offload series are set from the view at each scrape.
  Open unless `OpsAuth.metrics_open` is off.
- `/api/nodes`, `/api/deployments`, `/api/migrations`, `/api/prewarm`, `/api/load`,
  `/api/services`: what `OpsView` returns, as JSON, with `Cache-Control: no-store`. The ops
  token needed (`broker.ops.auth`).
- `/`: the dashboard page; it polls the `/api/...` routes every second (`static/`). The ops
  token needed: without it the browser is sent to `/login`.
- `/login`: the login form (GET) and its target (POST, form field `token`): the right token
  gets the session cookie (`Secure` over HTTPS) and a redirect to `/`, a wrong one 401 and
  the form again, a form that is not UTF-8 400.
  `POST /logout` drops the cookie. `/static/...` (scripts and styles, no data) is open.
- `POST /api/login-link`: a one-time login link, `{"path": "/login#code=...", "expires_in_s":
  ...}` (`OpsAuth.mint_login_code`). The ops token needed. The login page posts the link's code
  to `POST /login/once` (form field `code`): a code minted here, unused and unexpired, gets the
  session cookie and 204; any other 401. Neither the code nor the link is ever logged.

Every error is JSON, `{"error": message, "status": code}`: 401 without the ops token (before
anything else, so it tells nothing about the routes), 404 for an unknown path, 405 for another
method, 500 when the view fails (logged with its traceback). The page only loads files from
this server (its Content-Security-Policy says so): the broker host may have no Internet.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any, TypeVar

from aiohttp import web

from broker.ops.auth import LOGIN_CODE_TTL_S, OpsAuth
from broker.ops.metrics import BrokerMetrics
from broker.ops.view import OpsView

logger = logging.getLogger(__name__)

_STATIC_FILES = {
    "index.html": "text/html",
    "login.html": "text/html",
    "login.js": "text/javascript",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "uplot.min.js": "text/javascript",
    "uplot.min.css": "text/css",
}
"""The dashboard's files (package data under `static/`) and their media types. uPlot (the load
charts) is vendored there, as npm ships it: the page loads nothing from elsewhere."""

_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; object-src 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
}

_VIEW_KEY = web.AppKey("ops_view", OpsView)
_METRICS_KEY = web.AppKey("ops_metrics", BrokerMetrics)
_STATIC_KEY = web.AppKey("ops_static", dict[str, bytes])
_AUTH_KEY = web.AppKey("ops_auth", OpsAuth)

_OPEN_PATHS = frozenset({"/healthz", "/login", "/login/once", "/logout"})
"""Paths anyone may reach (besides `/static/...`, and `/metrics` when it is open)."""
_LOGIN_ERROR = b'<p id="login-error" class="status status-error" hidden></p>'

T = TypeVar("T")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ViewError(Exception):
    """A call to the `OpsView` failed, or returned what JSON cannot carry."""


def create_ops_app(view: OpsView, metrics: BrokerMetrics, auth: OpsAuth) -> web.Application:
    """The ops application over `view` and `metrics`, readable by whom `auth` allows.

    Reads the dashboard's files now, so that a broker installed without its package data fails
    at start, not when an operator opens the page.
    """
    app = web.Application(middlewares=[_json_errors, _ops_token])
    app[_VIEW_KEY] = view
    app[_METRICS_KEY] = metrics
    app[_AUTH_KEY] = auth
    static = resources.files("broker.ops") / "static"
    app[_STATIC_KEY] = {name: (static / name).read_bytes() for name in _STATIC_FILES}
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/api/nodes", _api_nodes)
    app.router.add_get("/api/deployments", _api_deployments)
    app.router.add_get("/api/migrations", _api_migrations)
    app.router.add_get("/api/prewarm", _api_prewarm)
    app.router.add_get("/api/load", _api_load)
    app.router.add_get("/api/services", _api_services)
    app.router.add_get("/", _static_file)
    app.router.add_get("/login", _login_page)
    app.router.add_post("/login", _login)
    app.router.add_post("/login/once", _login_once)
    app.router.add_post("/api/login-link", _login_link)
    app.router.add_post("/logout", _logout)
    app.router.add_get("/static/{name}", _static_file)
    return app


def create_standby_app(leader: Callable[[], str]) -> web.Application:
    """The ops server of a standby broker: `/healthz` answers 503 with
    `{"role": "standby", "leader": host:port or ""}` (load balancers send nothing here,
    operators see who leads); every other path 503 with the same, as an error."""

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response(
            {"role": "standby", "leader": leader()},
            status=503,
            headers={"Cache-Control": "no-store"},
        )

    async def elsewhere(request: web.Request) -> web.Response:
        where = leader()
        return _error(503, f"standby broker; the leader is at {where or 'not known yet'}")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_route("*", "/{tail:.*}", elsewhere)
    return app


async def start_ops_server(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (port 0: any free one), over HTTPS with `ssl_context`;
    returns the runner and the bound port.

    The caller stops it with `await runner.cleanup()`.
    """
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port: int = runner.addresses[0][1]
    logger.info("ops %s serving on %s:%d", "HTTPS" if ssl_context else "HTTP", host, bound_port)
    return runner, bound_port


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        headers = {"Allow": err.headers["Allow"]} if "Allow" in err.headers else None
        return _error(err.status, f"{err.reason}: {request.method} {request.path}", headers)
    except ViewError as err:
        logger.exception("ops: %s %s failed", request.method, request.path)
        return _error(500, str(err))


@web.middleware
async def _ops_token(request: web.Request, handler: Handler) -> web.StreamResponse:
    auth = request.app[_AUTH_KEY]
    path = request.path
    if (
        path in _OPEN_PATHS
        or path.startswith("/static/")
        or (path == "/metrics" and auth.metrics_open)
        or auth.allows(request)
    ):
        return await handler(request)
    if path == "/" and request.method in ("GET", "HEAD"):
        return _see_other("/login")
    return _error(
        401,
        "missing or wrong ops token: send 'Authorization: Bearer <token>' (the broker's "
        "--ops-token-file, or <state-dir>/ops-token when it has none), or log in at /login",
        {"WWW-Authenticate": 'Bearer realm="edge-offload ops"'},
    )


async def _login_page(request: web.Request) -> web.Response:
    return _page(request.app[_STATIC_KEY]["login.html"])


async def _login(request: web.Request) -> web.Response:
    auth = request.app[_AUTH_KEY]
    try:
        form = await request.post()
    except ValueError as err:  # UnicodeDecodeError among them: the sender's mistake, not ours
        logger.warning("ops: unreadable login form from %s: %s", request.remote, err)
        return _error(
            400, "the login form could not be read: send its field token as a UTF-8 form"
        )
    token = form.get("token")
    if isinstance(token, str) and auth.token_matches(token.strip()):
        response = _see_other("/")
        auth.start_session(response, secure=request.secure)
        logger.info("ops: login from %s", request.remote)
        return response
    logger.warning("ops: failed login from %s", request.remote)
    page = request.app[_STATIC_KEY]["login.html"].replace(
        _LOGIN_ERROR,
        b'<p id="login-error" class="status status-error">wrong token: try again</p>',
    )
    return _page(page, status=401)


async def _login_link(request: web.Request) -> web.Response:
    code = request.app[_AUTH_KEY].mint_login_code()
    logger.info("ops: one-time login link made for %s", request.remote)
    return web.json_response(
        {"path": f"/login#code={code}", "expires_in_s": LOGIN_CODE_TTL_S},
        headers={"Cache-Control": "no-store"},
    )


async def _login_once(request: web.Request) -> web.Response:
    auth = request.app[_AUTH_KEY]
    try:
        form = await request.post()
    except ValueError as err:  # UnicodeDecodeError among them: the sender's mistake, not ours
        logger.warning("ops: unreadable one-time login from %s: %s", request.remote, err)
        return _error(400, "the login could not be read: send its field code as a UTF-8 form")
    code = form.get("code")
    if isinstance(code, str) and auth.redeem_login_code(code.strip()):
        response = web.Response(status=204, headers={"Cache-Control": "no-store"})
        auth.start_session(response, secure=request.secure)
        logger.info("ops: login by a one-time link from %s", request.remote)
        return response
    logger.warning("ops: refused a one-time login link from %s", request.remote)
    return _error(
        401,
        "this login link was used already, has expired or is not one: paste the ops token, "
        "or ask for a new link (offload login-link)",
    )


async def _logout(request: web.Request) -> web.Response:
    response = _see_other("/login")
    OpsAuth.end_session(response)
    return response


def _see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location, "Cache-Control": "no-store"})


def _page(body: bytes, status: int = 200) -> web.Response:
    return web.Response(
        body=body, status=status, content_type="text/html", charset="utf-8", headers=_PAGE_HEADERS
    )


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(
        {"error": message, "status": status},
        status=status,
        headers={"Cache-Control": "no-store", **(headers or {})},
    )


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok", headers={"Cache-Control": "no-store"})


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[_METRICS_KEY]
    metrics.set_figures(await _call(request.app[_VIEW_KEY].figures))
    body, content_type = metrics.render()
    return web.Response(
        body=body, headers={"Content-Type": content_type, "Cache-Control": "no-store"}
    )


async def _api_nodes(request: web.Request) -> web.Response:
    return _json(await _call(request.app[_VIEW_KEY].nodes))


async def _api_deployments(request: web.Request) -> web.Response:
    return _json(await _call(request.app[_VIEW_KEY].deployments))


async def _api_migrations(request: web.Request) -> web.Response:
    return _json(await _call(request.app[_VIEW_KEY].migrations))


async def _api_load(request: web.Request) -> web.Response:
    return _json(await _call(request.app[_VIEW_KEY].load))


async def _api_prewarm(request: web.Request) -> web.Response:
    return _json(await _call(request.app[_VIEW_KEY].prewarm))


async def _api_services(request: web.Request) -> web.Response:
    return _json(await _call(request.app[_VIEW_KEY].services))


async def _call(method: Callable[[], Awaitable[T]]) -> T:
    try:
        return await method()
    except Exception as err:
        raise ViewError(f"{method.__name__}: {type(err).__name__}: {err}") from err


def _json(data: Any) -> web.Response:
    try:
        # allow_nan=False: NaN/Infinity are not JSON and would break the page's JSON.parse.
        text = json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ViewError(f"not JSON-serialisable: {err}") from err
    return web.Response(
        text=text, content_type="application/json", headers={"Cache-Control": "no-store"}
    )


async def _static_file(request: web.Request) -> web.Response:
    name = request.match_info.get("name", "index.html")
    if name not in _STATIC_FILES:
        raise web.HTTPNotFound()
    return web.Response(
        body=request.app[_STATIC_KEY][name],
        content_type=_STATIC_FILES[name],
        charset="utf-8",
        headers=_PAGE_HEADERS,
    )
