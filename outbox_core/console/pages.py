"""What every dashboard page shares: templates, sign-in, CSRF, the security headers.

:class:`Pages` is the base of the handlers of one outbox
(:class:`~outbox_core.console.app.Console`) and of many
(:class:`~outbox_core.console.fleet.FleetPages`): rendering with a CSRF
cookie, sign-in with the operator token, and the check every change passes.
With many outboxes the cookies live at the dashboard's root, so one sign-in
and one CSRF cookie serve every outbox's pages.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jinja2
from starlette.datastructures import FormData, MutableHeaders
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
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
from outbox_core.console.views import rounded
from outbox_core.redaction import redact

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
#: The ASGI scope key an application that signs its operators in itself sets
#: (``console_app(host_signs_in=True)``; Django's view does it for its staff).
OPERATOR_SCOPE_KEY = "outbox.operator"
#: The ASGI scope key holding the root of a dashboard of many outboxes (its
#: cookies' path and its overview), where one outbox's pages sit below it.
ROOT_SCOPE_KEY = "outbox.console_root"


def pretty_json(value: Any) -> str:
    """A payload or headers as indented JSON text (escaped by the template, not here)."""
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def new_templates() -> Jinja2Templates:
    """The dashboard's templates, autoescaping every value: user content is text, never markup."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
    templates = Jinja2Templates(env=env)
    templates.env.filters["age"] = rounded
    # Not Jinja's tojson (made for <script>, it writes < as \u003c): the operator
    # reads the payload as stored, and autoescaping keeps it text.
    templates.env.filters["pretty_json"] = pretty_json
    return templates


class Pages:
    """Rendering, sign-in and the change check that every dashboard page shares."""

    def __init__(
        self,
        *,
        guard: Guard,
        hide_payloads: bool = False,
        refresh: float = 5.0,
        host_signs_in: bool = False,
        templates: Jinja2Templates | None = None,
    ) -> None:
        self.guard = guard
        self.host_signs_in = host_signs_in
        #: Changes are possible at all: a token, or the host application's operators.
        self.writable = guard.writable or host_signs_in
        self.hide_payloads = hide_payloads
        self.refresh = refresh
        self.templates = templates or new_templates()

    def context(self, request: Request) -> dict[str, Any]:
        """What this kind of page adds to every template's values."""
        return {}

    async def healthz(self, request: Request) -> Response:
        """``/healthz``: the dashboard answers (it does not touch the database)."""
        return PlainTextResponse("ok")

    async def login(self, request: Request) -> Response:
        """``/login``: the token form (GET), or a session for the right token (POST)."""
        if not self.guard.writable or self.host_signs_in:
            return self.bad(request, "no token sign-in here: see the dashboard's settings", 404)
        if request.method == "GET":
            return self.render(request, "login.html", failed=False)
        form = await request.form()
        if not self.csrf_passes(request, form):
            return self.forbidden(request, "the form's CSRF token does not match: reload the page")
        if not self.guard.token_matches(str(form.get("token") or "")):
            log.warning("dashboard sign-in refused: wrong token")
            return self.render(request, "login.html", failed=True, status_code=403)
        response = RedirectResponse(self.url(request, "/"), 303)
        response.set_cookie(
            SESSION_COOKIE,
            self.guard.new_session(),
            max_age=SESSION_SECONDS,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path=self.cookie_path(request),
        )
        return response

    async def logout(self, request: Request) -> Response:
        """``/logout`` (POST): end the browser's session."""
        form = await request.form()
        if not self.csrf_passes(request, form):
            return self.forbidden(request, "the form's CSRF token does not match: reload the page")
        response = RedirectResponse(self.url(request, "/"), 303)
        response.delete_cookie(SESSION_COOKIE, path=self.cookie_path(request))
        return response

    def signed_in(self, request: Request) -> bool:
        """The request comes from a signed-in operator (a session, or the host's mark)."""
        if self.host_signs_in:
            return request.scope.get(OPERATOR_SCOPE_KEY) is True
        return self.guard.session_ok(request.cookies.get(SESSION_COOKIE))

    def csrf_passes(self, request: Request, form: FormData) -> bool:
        """The form's CSRF field matches its cookie, and a browser's Origin is this host."""
        field = form.get("csrf")
        return csrf_ok(
            request.cookies.get(CSRF_COOKIE), field if isinstance(field, str) else None
        ) and same_origin(request.headers.get("origin"), request.headers.get("host"))

    def refuse_change(self, request: Request, form: FormData) -> Response | None:
        """None when the request may change things: a bearer token, or a session and CSRF."""
        if not self.writable:
            return self.forbidden(
                request,
                "read-only dashboard: start it with a token (OUTBOX_DASHBOARD_TOKEN or "
                "--token-file) to replay events",
            )
        if self.guard.bearer_ok(request.headers.get("authorization")):
            return None
        if not self.signed_in(request):
            return self.forbidden(request, "sign in as an operator first")
        if not self.csrf_passes(request, form):
            return self.forbidden(request, "the form's CSRF token does not match: reload the page")
        return None

    def render(
        self, request: Request, template: str, status_code: int = 200, **values: Any
    ) -> Response:
        """``template`` with the values every page has, setting the CSRF cookie when new."""
        csrf = request.cookies.get(CSRF_COOKIE) or new_csrf()
        context = {
            "request": request,
            "csrf": csrf,
            "writable": self.writable,
            "host_signs_in": self.host_signs_in,
            "signed_in": self.signed_in(request),
            "hide_payloads": self.hide_payloads,
            "refresh": self.refresh,
            "replayed": request.query_params.get("replayed"),
            "root": self.root(request),
            **self.context(request),
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
                path=self.cookie_path(request),
            )
        return response

    def bad(self, request: Request, message: str, status: int = 400) -> Response:
        """The reason a request is refused, as JSON or as a page."""
        if self.wants_json(request):
            return JSONResponse({"error": message}, status)
        return self.render(request, "message.html", status_code=status, message=message)

    def forbidden(self, request: Request, message: str) -> Response:
        """:meth:`bad` with 403."""
        return self.bad(request, message, 403)

    @staticmethod
    def wants_json(request: Request) -> bool:
        """The client asked for JSON (a script), not a page."""
        return "application/json" in request.headers.get("accept", "")

    @staticmethod
    def url(request: Request, path: str) -> str:
        """``path`` of this application (below the prefix it is mounted at)."""
        return f"{request.scope.get('root_path', '')}{path}"

    @staticmethod
    def root(request: Request) -> str:
        """The dashboard's root: that of many outboxes above one outbox's pages, else ours."""
        return str(request.scope.get(ROOT_SCOPE_KEY, request.scope.get("root_path", "")))

    @classmethod
    def cookie_path(cls, request: Request) -> str:
        """Where the cookies live: the dashboard's root, so one sign-in serves all of it."""
        return cls.root(request) or "/"


async def outbox_error(request: Request, exc: Exception) -> Response:
    """A database error, masked: the page says what failed without any secret."""
    message = redact(str(exc))
    log.warning("dashboard read failed: %s", message)
    return PlainTextResponse(f"the database did not answer: {message}", 503)


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


__all__ = [
    "CSP",
    "OPERATOR_SCOPE_KEY",
    "ROOT_SCOPE_KEY",
    "SECURITY_HEADERS",
    "Pages",
    "SecurityHeaders",
    "new_templates",
    "outbox_error",
    "pretty_json",
]
