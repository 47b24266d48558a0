"""The starlette app of `expr serve`: pages, the JSON API, the event stream, the guard.

Every response carries `Content-Security-Policy: default-src 'self'` (the pages load
nothing from elsewhere and run no inline script). With a token (any host but loopback
needs one) a request passes with `?token=` (which sets an HttpOnly, SameSite=Strict
cookie and, for a page, redirects to the same URL without it) or with that cookie; any
other request gets 401. Errors are one line of JSON, `{"error": "..."}`, never a
traceback: 400 for bad input, 404 for what is not there.
"""

from __future__ import annotations

import hmac
import json
import re
import sys
from collections.abc import Awaitable, Callable
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .api import Api, version_tag
from .live import LiveRuns
from .paths import BadRequest, NotFound

STATIC = Path(__file__).parent / "static"
COOKIE = "expr_token"
CSP = "default-src 'self'"
EVENT_POLL = 1.0  # seconds between the event stream's passes (pages update within ~2 s)
HEARTBEAT = 15.0  # seconds: a comment line keeps proxies from closing a quiet stream
_HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY")]

Scope = dict[str, Any]
ASGI = Callable[[Scope, Any, Any], Awaitable[None]]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message.splitlines()[0] if message else "error"}, status)


class Guard:
    """ASGI middleware: the token check and the headers of every response."""

    def __init__(self, app: ASGI, token: str | None) -> None:
        self.app = app
        self.token = token

    def _ok(self, given: str | None) -> bool:
        return given is not None and self.token is not None and hmac.compare_digest(
            given.encode(), self.token.encode())

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_HEADERS]
            await send(message)

        if self.token is None and not _loopback_host(scope):
            # DNS rebinding: a page of attacker.example that resolves to 127.0.0.1 reaches
            # this server with its own name in Host; without a token only loopback names pass
            await _error(403, "Host must be a loopback name (localhost, 127.0.0.1, [::1]) "
                              "without --token")(scope, receive, send_with_headers)
            return
        if self.token is not None:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            given = (query.get("token") or [None])[0]
            if self._ok(given):
                rest = urlencode([(k, v) for k, vs in query.items() if k != "token" for v in vs],
                                 doseq=True)
                cookie = f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"
                if not scope["path"].startswith("/api/"):
                    # a page: drop the token from the address bar (and the history)
                    location = scope["path"] + (f"?{rest}" if rest else "")
                    resp: Response = Response(status_code=303, headers={"location": location})
                    resp.headers.append("set-cookie", cookie)
                    await resp(scope, receive, send_with_headers)
                    return

                async def send_cookie(message: dict[str, Any]) -> None:
                    if message["type"] == "http.response.start":
                        message["headers"] = [*message.get("headers", []),
                                              (b"set-cookie", cookie.encode())]
                    await send_with_headers(message)

                await self.app(scope, receive, send_cookie)
                return
            if not self._ok(_cookie(scope)):
                await _error(401, "a token is required: open the URL expr serve printed")(
                    scope, receive, send_with_headers)
                return
        await self.app(scope, receive, send_with_headers)


_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")  # a % not followed by two hex digits
_LOOPBACK = frozenset(("localhost", "127.0.0.1", "[::1]", "::1"))


def _loopback_host(scope: Scope) -> bool:
    """True when the request's Host header (or its absence: HTTP/1.0) names this machine's
    loopback: `localhost`, a name under `.localhost`, `127.0.0.1`, `[::1]`, any port."""
    hosts = [v for k, v in scope.get("headers", []) if k == b"host"]
    if not hosts:
        return True
    if len(hosts) > 1:
        return False
    host = hosts[0].decode("latin-1").strip().lower()
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if name.startswith("[") and "]" in name:
        name = name[: name.index("]") + 1]
    return name in _LOOPBACK or name.endswith(".localhost")


def _cookie(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"cookie":
            jar: SimpleCookie = SimpleCookie()
            try:
                jar.load(value.decode("latin-1"))
            except Exception:
                return None
            if COOKIE in jar:
                return jar[COOKIE].value
    return None


def _names_ok(request: Request) -> bool:
    """A run page's `project/name`: valid percent-encoded UTF-8 (`%E0%A4%A` is not, and the
    page's own decoding threw) and valid names; else the page is "no such run"."""
    from urllib.parse import unquote_to_bytes

    from expr_tracker.store.layout import validate_name

    raw = request.scope.get("raw_path") or b""
    if _BAD_ESCAPE.search(raw):
        return False
    try:
        unquote_to_bytes(raw).decode("utf-8")
        for k in ("project", "name"):
            validate_name(request.path_params[k], k)
    except (UnicodeError, TypeError, ValueError):
        return False
    return True


async def _answer(call: Callable[[], Any]) -> Response:
    """Run one API call in a worker thread; its errors as one-line JSON."""
    try:
        return JSONResponse(await run_in_threadpool(call))
    except BadRequest as exc:
        return _error(400, str(exc))
    except NotFound as exc:
        return _error(404, str(exc))
    except Exception as exc:  # a bug or a disk error: one line here, one in the log
        sys.stderr.write(f"expr serve: {type(exc).__name__}: {exc}\n")
        return _error(500, f"internal error ({type(exc).__name__}); see the server's output")


def _params(request: Request) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in request.query_params.multi_items():
        out.setdefault(k, []).append(v)
    return out


def make_app(root: Path, token: str | None = None, cfg: Any = None) -> ASGI:
    """The app over the run root `root` (a resolved path); `token` guards every request."""
    from expr_tracker.health.config import HealthConfig

    # a long-running watcher: the stalls its pages find are recorded (`TopView._record`)
    api = Api(root, LiveRuns(cfg or HealthConfig(), record=True))

    def page(name: str) -> Callable[[Request], Awaitable[Response]]:
        async def serve_page(request: Request) -> Response:
            if "project" in request.path_params and not _names_ok(request):
                return _error(404, f"no such run: {request.url.path[len('/runs/'):][:200]}")
            return FileResponse(STATIC / name, headers={"cache-control": "no-cache"})
        return serve_page

    async def runs(request: Request) -> Response:
        return await _answer(lambda: api.runs(_params(request)))

    async def run_part(request: Request) -> Response:
        p, n, what = (request.path_params[k] for k in ("project", "name", "what"))
        call = {"summary": api.summary, "heatmap": api.heatmap, "top": api.top,
                "series": api.series, "progress": api.progress}.get(what)
        if call is None:
            return _error(404, f"no API /api/runs/{{project}}/{{name}}/{what}")
        return await _answer(lambda: call(p, n, _params(request)))

    async def compare(request: Request) -> Response:
        return await _answer(lambda: api.compare(_params(request)))

    async def events(request: Request) -> Response:
        p, n = request.path_params["project"], request.path_params["name"]
        try:
            live = await run_in_threadpool(lambda: api.live(p, n, _params(request)))
        except (BadRequest, NotFound) as exc:
            return _error(400 if isinstance(exc, BadRequest) else 404, str(exc))
        since = request.query_params.get("version")
        return StreamingResponse(_stream(request, live, since), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"no page {request.url.path}")

    routes = [
        Route("/", page("index.html")),
        Route("/runs/{project}/{name}", page("run.html")),
        Route("/compare", page("compare.html")),
        Route("/api/runs", runs),
        Route("/api/compare", compare),
        Route("/api/runs/{project}/{name}/events", events),
        Route("/api/runs/{project}/{name}/{what}", run_part),
        Mount("/static", StaticFiles(directory=STATIC, follow_symlink=False)),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    return Guard(app, token)


async def _stream(request: Request, live: Any, since: str | None) -> Any:
    """`change` events: one at once (unless the page says it drew version `since` and the
    run is still there), then one each time the run's version moves."""
    import time

    import anyio

    last = since
    quiet_since = time.monotonic()
    while not await request.is_disconnected():
        try:
            state = await run_in_threadpool(live.refresh)
        except Exception as exc:  # the run went away meanwhile: say so, end the stream
            yield f"event: gone\ndata: {json.dumps({'error': str(exc)})}\n\n"
            return
        tag = version_tag(live)
        if tag != last:
            last = tag
            data = {"version": last, "frontier": state.frontier, "lead": state.lead,
                    "live": len(state.live), "world_size": state.world_size}
            yield f"event: change\ndata: {json.dumps(data)}\n\n"
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= HEARTBEAT:
            yield ": quiet\n\n"
            quiet_since = time.monotonic()
        await anyio.sleep(EVENT_POLL)
