"""The dashboard in a Django project, for its staff: ``include("outbox_core.contrib.django.urls")``.

The view hands each request to the dashboard's ASGI application
(:func:`outbox_core.console.console_app`) below the URL prefix it is
included at, and returns what the application answers. Django signs the
operators in: staff users with the view (or change) permission on outbox
events see the dashboard; those with the change permission, the one the
admin's replay action needs, may replay dead events. The application checks
its own CSRF token and ``Origin`` on every change (the view is exempt from
Django's). The application is built once per process, from the outbox of
:func:`~outbox_core.contrib.django.api.outbox_for` and
``settings.OUTBOX["DASHBOARD"]``, and again when those settings change.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.urls import NoReverseMatch, reverse
from django.utils.encoding import iri_to_uri

from outbox_core.contrib.django.api import outbox_for
from outbox_core.contrib.django.conf import OutboxSettings, current_settings
from outbox_core.outbox import Outbox

try:
    from starlette.types import ASGIApp, Message

    from outbox_core.console import console_app
    from outbox_core.console.app import OPERATOR_SCOPE_KEY
except ImportError as exc:  # pragma: no cover - the extra is part of the development install
    raise ImproperlyConfigured(
        f"the outbox dashboard needs the 'dashboard' extra ({exc}): "
        "pip install 'outbox-toolkit[dashboard]'"
    ) from exc

#: May see the dashboard (with ``is_staff``); the change permission implies it, as in the admin.
VIEW_PERMISSION = "outbox_toolkit.view_outboxevent"
#: May replay dead events: the permission the admin's replay action needs.
REPLAY_PERMISSION = "outbox_toolkit.change_outboxevent"

View = Callable[..., Coroutine[Any, Any, HttpResponse]]


@dataclass(frozen=True)
class _Built:
    outbox: Outbox
    conf: OutboxSettings
    app: ASGIApp


_built: _Built | None = None
_lock = threading.Lock()


def dashboard_app() -> ASGIApp:
    """The console app of this process (built on first use, again when the settings change)."""
    global _built
    # The outbox is rebuilt when settings.OUTBOX or the database changes (tests
    # rename it): the application follows it.
    outbox = outbox_for()
    conf = current_settings()
    found = _built
    if found is None or found.outbox is not outbox or found.conf is not conf:
        with _lock:
            found = _built
            if found is None or found.outbox is not outbox or found.conf is not conf:
                app = console_app(
                    outbox,
                    hide_payloads=conf.dashboard.hide_payloads,
                    refresh=conf.dashboard.refresh,
                    host_signs_in=True,
                )
                found = _built = _Built(outbox, conf, app)
    return found.app


def _login_url() -> str:
    try:
        return reverse("admin:login")
    except NoReverseMatch:  # no django.contrib.admin in the project
        return str(settings.LOGIN_URL)


def access(request: HttpRequest) -> HttpResponse | bool:
    """May ``request``'s user replay (True), only look (False), or the login redirect.

    Anonymous users are sent to the login page (``admin:login``, else
    ``LOGIN_URL``), as the admin does; a signed-in user who is not active
    staff with the view or change permission on outbox events gets 403. A
    sync function: the user and permissions come from the database.
    """
    user: Any = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return redirect_to_login(request.get_full_path(), _login_url())
    if not (user.is_active and user.is_staff):
        raise PermissionDenied("the outbox dashboard is for staff users")
    replay = bool(user.has_perm(REPLAY_PERMISSION))
    if not (replay or user.has_perm(VIEW_PERMISSION)):
        raise PermissionDenied("the outbox dashboard needs the view permission on outbox events")
    return replay


def _prepare(request: HttpRequest) -> HttpResponse | tuple[bool, ASGIApp]:
    allowed = access(request)
    if isinstance(allowed, HttpResponse):
        return allowed
    return allowed, dashboard_app()


def asgi_scope(request: HttpRequest, subpath: str, operator: bool) -> dict[str, Any]:
    """The ASGI scope of ``request`` for the application mounted where ``subpath`` starts."""
    path = request.path
    # request.path ends with the part below the prefix (both are decoded); the
    # prefix keeps FORCE_SCRIPT_NAME, so the page's links work in the browser.
    root_path = path[: len(path) - len(subpath)].rstrip("/")
    headers = [
        (name.lower().encode("latin-1"), str(value).encode("latin-1"))
        for name, value in request.headers.items()
        if name.lower() != "host"
    ]
    # Django's idea of the host (ALLOWED_HOSTS, USE_X_FORWARDED_HOST): the
    # application compares a POST's Origin with it.
    headers.append((b"host", request.get_host().encode("latin-1")))
    meta = request.META
    address = meta.get("REMOTE_ADDR")
    client = (str(address), int(meta.get("REMOTE_PORT") or 0)) if address else None
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method or "GET",
        "scheme": request.scheme or "http",
        # The full path with root_path its prefix, as ASGI servers and Starlette's Mount give it.
        "path": f"{root_path}/{subpath}",
        "root_path": root_path,
        "query_string": iri_to_uri(meta.get("QUERY_STRING", "")).encode("ascii"),
        "headers": headers,
        "client": client,
        "server": (str(meta.get("SERVER_NAME", "")), int(meta.get("SERVER_PORT") or 0)),
        OPERATOR_SCOPE_KEY: operator,
    }


async def call_asgi(app: ASGIApp, scope: dict[str, Any], body: bytes) -> HttpResponse:
    """Run ``app`` on one request and return its whole answer as an ``HttpResponse``."""
    answered = asyncio.Event()
    sent_body = False
    start: Message | None = None
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        # A disconnect only once the answer is complete: a streamed file is not cut short.
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                answered.set()

    await app(scope, receive, send)
    if start is None:
        raise RuntimeError("the outbox dashboard sent no response")
    return http_response(int(start["status"]), start.get("headers", []), b"".join(chunks))


def http_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> HttpResponse:
    """An ``HttpResponse`` with an ASGI answer's status, headers and body.

    Set-Cookie headers become the response's cookies (Django sends those);
    a header given twice is joined with commas, as HTTP allows.
    """
    response = HttpResponse(body, status=status)
    seen: set[str] = set()
    for raw_name, raw_value in headers:
        name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
        if name.lower() == "set-cookie":
            cookie: SimpleCookie = SimpleCookie()
            try:
                cookie.load(value)
            except CookieError:
                continue  # dropped rather than sent half-read (Starlette writes them well-formed)
            for key, morsel in cookie.items():
                response.cookies[key] = morsel
        elif name.lower() in seen:
            response[name] = f"{response[name]}, {value}"
        else:
            seen.add(name.lower())
            response[name] = value
    return response


def _exempt(view: View) -> View:
    """``view`` outside Django's CSRF check (the application checks its own) and atomic requests.

    Both are marks on the function itself: ``csrf_exempt`` of Django 4.2 wraps
    an async view in a sync one, and ``ATOMIC_REQUESTS`` refuses async views
    (the dashboard writes nothing through Django's connections; a replay
    commits on the outbox's own).
    """
    view.csrf_exempt = True  # type: ignore[attr-defined]
    for alias in settings.DATABASES:
        view = transaction.non_atomic_requests(using=alias)(view)
    return view


@_exempt
async def dashboard(request: HttpRequest, subpath: str = "") -> HttpResponse:
    """The dashboard's page, API call, replay or static file at ``subpath`` below the prefix."""
    prepared = await sync_to_async(_prepare)(request)
    if isinstance(prepared, HttpResponse):
        return prepared
    operator, app = prepared
    return await call_asgi(app, asgi_scope(request, subpath, operator), request.body)
