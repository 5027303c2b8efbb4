"""The dashboard as an ASGI application: pages, a JSON API, and replays for the operator.

Mount it in a FastAPI or Starlette application (``app.mount("/outbox",
console_app(...))``), wrap it for WSGI (:func:`console_wsgi`), or run it
alone with ``outbox dashboard``. Pages render on the server with Jinja2
(autoescaping every value); the charts are drawn by uPlot from JSON the
page embeds as data and refreshes from ``/api/overview``. Every response
carries a Content-Security-Policy that runs only the dashboard's own
scripts, so a ``<script>`` in a payload is shown, never run.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox_core.console.security import (
    CSRF_COOKIE,
    SESSION_COOKIE,
    SESSION_SECONDS,
    Guard,
    csrf_ok,
    new_csrf,
    same_origin,
)
from outbox_core.console.views import LISTED_STATES, RANGES, Reader, parse_ids, rounded
from outbox_core.errors import OutboxError
from outbox_core.outbox import Outbox
from outbox_core.redaction import mask_url, redact

log = logging.getLogger("outbox.dashboard")

HERE = Path(__file__).parent
#: Only the dashboard's own scripts and styles run; nothing is framed or posted elsewhere.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
#: The most ids one replay takes.
MAX_REPLAY_IDS = 1000
#: The ASGI scope key an application that signs its operators in itself sets
#: (``console_app(host_signs_in=True)``; Django's view does it for its staff).
OPERATOR_SCOPE_KEY = "outbox.operator"

Handler = Callable[[Request], Awaitable[Response]]


class Console:
    """The dashboard's request handlers over one outbox."""

    def __init__(
        self,
        outbox: Outbox,
        *,
        guard: Guard,
        hide_payloads: bool = False,
        refresh: float = 5.0,
        log_tailing: Callable[[], dict[str, Any] | None] | None = None,
        host_signs_in: bool = False,
    ) -> None:
        self.outbox = outbox
        self.guard = guard
        self.host_signs_in = host_signs_in
        #: Changes are possible at all: a token, or the host application's operators.
        self.writable = guard.writable or host_signs_in
        self.reader = Reader(outbox, hide_payloads=hide_payloads)
        self.hide_payloads = hide_payloads
        self.refresh = refresh
        self.log_tailing = log_tailing
        # Autoescaping on for every template: user content is text, never markup.
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True
        )
        self.templates = Jinja2Templates(env=env)
        self.templates.env.filters["age"] = rounded
        # Not Jinja's tojson (made for <script>, it writes < as \u003c): the operator
        # reads the payload as stored, and autoescaping keeps it text.
        self.templates.env.filters["pretty_json"] = pretty_json
        self.database = mask_url(outbox.engine.url)
        self.table = outbox.table.fullname

    # -- pages ----------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        """``/``: counts, the oldest pending age, inflow and outflow, the relays' throughput."""
        range_name = request.query_params.get("range", "1h")
        if range_name not in RANGES:
            return self._bad(request, f"unknown range {range_name!r}: one of {', '.join(RANGES)}")
        page = await run_in_threadpool(self.reader.overview, range_name)
        return self._render(
            request, "overview.html", page=page, data=page.as_dict(), ranges=list(RANGES)
        )

    async def relays(self, request: Request) -> Response:
        """``/relays``: ordered relays, unowned partitions, log tailing's slot."""
        page = await run_in_threadpool(self._relays_page)
        return self._render(request, "relays.html", page=page)

    async def events(self, request: Request) -> Response:
        """``/events``: dead (or pending, leased) events, filtered, newest first."""
        query = self._event_query(request)
        if isinstance(query, Response):
            return query
        rows = await run_in_threadpool(lambda: self.reader.events(**query))
        more = None
        if len(rows) == query["limit"]:
            params = {k: v for k, v in query.items() if v and k not in ("limit", "before_id")}
            more = urlencode({**params, "before": rows[-1]["id"]})
        return self._render(request, "events.html", rows=rows, query=query, more=more)

    async def event(self, request: Request) -> Response:
        """``/events/{id}``: one event, its payload, headers, attempts and error."""
        row = await run_in_threadpool(self.reader.event, int(request.path_params["id"]))
        if row is None:
            return self._bad(request, "no such event (sent and cleaned up, or never there)", 404)
        return self._render(request, "event.html", row=row)

    async def held(self, request: Request) -> Response:
        """``/held``: keys whose events wait behind a dead head."""
        rows = await run_in_threadpool(self.reader.held_keys)
        return self._render(request, "held.html", rows=rows)

    # -- the JSON API ---------------------------------------------------------------------

    async def api_overview(self, request: Request) -> Response:
        """``/api/overview``: the overview's figures as JSON."""
        range_name = request.query_params.get("range", "1h")
        if range_name not in RANGES:
            return JSONResponse({"error": f"unknown range {range_name!r}"}, 400)
        try:
            since = (
                float(request.query_params["since"]) if "since" in request.query_params else None
            )
        except ValueError:
            return JSONResponse({"error": "since must be seconds since the epoch"}, 400)
        if since is not None and not math.isfinite(since):
            return JSONResponse({"error": "since must be seconds since the epoch"}, 400)
        page = await run_in_threadpool(self.reader.overview, range_name, since)
        return JSONResponse(page.as_dict())

    async def api_relays(self, request: Request) -> Response:
        """``/api/relays``: the relays page as JSON."""
        return JSONResponse((await run_in_threadpool(self._relays_page)).as_dict())

    async def api_events(self, request: Request) -> Response:
        """``/api/events``: the events page as JSON."""
        query = self._event_query(request)
        if isinstance(query, Response):
            return JSONResponse({"error": "bad query"}, 400)
        return JSONResponse(await run_in_threadpool(lambda: self.reader.events(**query)))

    async def api_event(self, request: Request) -> Response:
        """``/api/events/{id}``: one event as JSON."""
        row = await run_in_threadpool(self.reader.event, int(request.path_params["id"]))
        return JSONResponse(row, 200 if row is not None else 404)

    async def api_held(self, request: Request) -> Response:
        """``/api/held``: the held keys as JSON."""
        return JSONResponse(await run_in_threadpool(self.reader.held_keys))

    async def healthz(self, request: Request) -> Response:
        """``/healthz``: the dashboard answers (it does not touch the database)."""
        return PlainTextResponse("ok")

    # -- changes --------------------------------------------------------------------------

    async def login(self, request: Request) -> Response:
        """``/login``: the token form (GET), or a session for the right token (POST)."""
        if not self.guard.writable or self.host_signs_in:
            return self._bad(request, "no token sign-in here: see the dashboard's settings", 404)
        if request.method == "GET":
            return self._render(request, "login.html", failed=False)
        form = await request.form()
        if not self._csrf_passes(request, form):
            return self._forbidden(request, "the form's CSRF token does not match: reload the page")
        if not self.guard.token_matches(str(form.get("token") or "")):
            log.warning("dashboard sign-in refused: wrong token")
            return self._render(request, "login.html", failed=True, status_code=403)
        response = RedirectResponse(self._url(request, "/"), 303)
        response.set_cookie(
            SESSION_COOKIE,
            self.guard.new_session(),
            max_age=SESSION_SECONDS,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path=self._cookie_path(request),
        )
        return response

    async def logout(self, request: Request) -> Response:
        """``/logout`` (POST): end the browser's session."""
        form = await request.form()
        if not self._csrf_passes(request, form):
            return self._forbidden(request, "the form's CSRF token does not match: reload the page")
        response = RedirectResponse(self._url(request, "/"), 303)
        response.delete_cookie(SESSION_COOKIE, path=self._cookie_path(request))
        return response

    async def replay(self, request: Request) -> Response:
        """``/replay`` (POST): dead events back to pending, by ``ids`` or by ``key`` (in order)."""
        form = await request.form()
        refused = self._refuse_change(request, form)
        if refused is not None:
            return refused
        try:
            ids = parse_ids([str(v) for v in form.getlist("ids")])
        except ValueError as exc:
            return self._bad(request, str(exc))
        key = str(form.get("key") or "") or None
        if bool(ids) == bool(key):
            return self._bad(request, "replay takes event ids or one key, not both or neither")
        if len(ids) > MAX_REPLAY_IDS:
            return self._bad(request, f"at most {MAX_REPLAY_IDS} ids per replay")
        if ids:
            count = await run_in_threadpool(lambda: self.outbox.replay(ids=ids))
        else:
            count = await run_in_threadpool(lambda: self.outbox.replay(key=key))
        log.info("dashboard replay: %d dead events returned to pending", count)
        if self._wants_json(request):
            return JSONResponse({"replayed": count})
        back = str(form.get("back") or "/events")
        if not back.startswith("/") or back.startswith("//"):
            back = "/events"  # only a page of this dashboard
        separator = "&" if "?" in back else "?"
        return RedirectResponse(self._url(request, f"{back}{separator}replayed={count}"), 303)

    # -- helpers --------------------------------------------------------------------------

    def _relays_page(self) -> Any:
        tailing = self.log_tailing() if self.log_tailing is not None else None
        return self.reader.relays(tailing)

    def _event_query(self, request: Request) -> dict[str, Any] | Response:
        params = request.query_params
        state = params.get("state", "dead")
        if state not in LISTED_STATES:
            return self._bad(request, f"unknown state {state!r}: one of {', '.join(LISTED_STATES)}")
        before = params.get("before")
        if before is not None and not before.isdigit():
            return self._bad(request, "before must be an event id")
        return {
            "state": state,
            "topic": params.get("topic") or None,
            "key": params.get("key") or None,
            "error": params.get("error") or None,
            "before_id": int(before) if before else None,
            "limit": 50,
        }

    def _signed_in(self, request: Request) -> bool:
        if self.host_signs_in:
            return request.scope.get(OPERATOR_SCOPE_KEY) is True
        return self.guard.session_ok(request.cookies.get(SESSION_COOKIE))

    def _csrf_passes(self, request: Request, form: FormData) -> bool:
        field = form.get("csrf")
        return csrf_ok(
            request.cookies.get(CSRF_COOKIE), field if isinstance(field, str) else None
        ) and same_origin(request.headers.get("origin"), request.headers.get("host"))

    def _refuse_change(self, request: Request, form: FormData) -> Response | None:
        """None when the request may change things: a bearer token, or a session and CSRF."""
        if not self.writable:
            return self._forbidden(
                request,
                "read-only dashboard: start it with a token (OUTBOX_DASHBOARD_TOKEN or "
                "--token-file) to replay events",
            )
        if self.guard.bearer_ok(request.headers.get("authorization")):
            return None
        if not self._signed_in(request):
            return self._forbidden(request, "sign in as an operator first")
        if not self._csrf_passes(request, form):
            return self._forbidden(request, "the form's CSRF token does not match: reload the page")
        return None

    def _render(
        self, request: Request, template: str, status_code: int = 200, **values: Any
    ) -> Response:
        csrf = request.cookies.get(CSRF_COOKIE) or new_csrf()
        context = {
            "request": request,
            "csrf": csrf,
            "writable": self.writable,
            "host_signs_in": self.host_signs_in,
            "signed_in": self._signed_in(request),
            "database": self.database,
            "table": self.table,
            "hide_payloads": self.hide_payloads,
            "refresh": self.refresh,
            "replayed": request.query_params.get("replayed"),
            **values,
        }
        response: Response = self.templates.TemplateResponse(
            request, template, context, status_code=status_code
        )
        if request.cookies.get(CSRF_COOKIE) != csrf and status_code < 400:
            # Lax, unlike the session: a link from elsewhere (an alert in chat) still
            # sends it, so forms open in other tabs keep working. The check is the
            # form field matching it, which another site cannot read.
            response.set_cookie(
                CSRF_COOKIE,
                csrf,
                httponly=True,
                samesite="lax",
                secure=request.url.scheme == "https",
                path=self._cookie_path(request),
            )
        return response

    def _bad(self, request: Request, message: str, status: int = 400) -> Response:
        if self._wants_json(request):
            return JSONResponse({"error": message}, status)
        return self._render(request, "message.html", status_code=status, message=message)

    def _forbidden(self, request: Request, message: str) -> Response:
        return self._bad(request, message, 403)

    @staticmethod
    def _wants_json(request: Request) -> bool:
        return "application/json" in request.headers.get("accept", "")

    @staticmethod
    def _url(request: Request, path: str) -> str:
        return f"{request.scope.get('root_path', '')}{path}"

    @staticmethod
    def _cookie_path(request: Request) -> str:
        return request.scope.get("root_path", "") or "/"


async def _outbox_error(request: Request, exc: Exception) -> Response:
    """A database error, masked: the page says what failed without any secret."""
    message = redact(str(exc))
    log.warning("dashboard read failed: %s", message)
    return PlainTextResponse(f"the database did not answer: {message}", 503)


def pretty_json(value: Any) -> str:
    """A payload or headers as indented JSON text (escaped by the template, not here)."""
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


class SecurityHeaders:
    """ASGI middleware: the security headers on every response (static files included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; add the headers to the response's start."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, with_headers)


def console_app(
    outbox: Outbox,
    *,
    token: str | None = None,
    hide_payloads: bool = False,
    refresh: float = 5.0,
    log_tailing: Callable[[], dict[str, Any] | None] | None = None,
    host_signs_in: bool = False,
) -> Starlette:
    """The dashboard of ``outbox`` as an ASGI application.

    ``token``: the operator token (see :func:`~outbox_core.console.security.load_token`);
    None keeps the dashboard read-only. ``hide_payloads``: payloads and headers are
    never shown or sent. ``refresh``: seconds between the overview's updates.
    ``log_tailing``: a callable giving log tailing's slot status for the relays page.
    ``host_signs_in``: the application it is mounted in signs its operators in and
    marks their requests with ``scope["outbox.operator"] = True``; they may replay
    (with the CSRF check), and there is no token sign-in.
    """
    console = Console(
        outbox,
        guard=Guard(token),
        hide_payloads=hide_payloads,
        refresh=refresh,
        log_tailing=log_tailing,
        host_signs_in=host_signs_in,
    )
    routes = [
        Route("/", console.overview),
        Route("/relays", console.relays),
        Route("/events", console.events),
        Route("/events/{id:int}", console.event),
        Route("/held", console.held),
        Route("/api/overview", console.api_overview),
        Route("/api/relays", console.api_relays),
        Route("/api/events", console.api_events),
        Route("/api/events/{id:int}", console.api_event),
        Route("/api/held", console.api_held),
        Route("/healthz", console.healthz),
        Route("/login", console.login, methods=["GET", "POST"]),
        Route("/logout", console.logout, methods=["POST"]),
        Route("/replay", console.replay, methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(SecurityHeaders)],
        exception_handlers={OutboxError: _outbox_error},
    )
