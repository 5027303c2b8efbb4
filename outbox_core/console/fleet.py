"""The dashboard of many outboxes: an overview of them all, and each one's pages below it.

``/`` lists the outboxes a page at a time (label, database, pending, leased,
dead, the oldest pending age, relays present), ``/api/outboxes`` the same
as JSON, and ``/o/<outbox>/`` serves the pages of one outbox exactly as the
dashboard of that outbox alone does (events, held keys, relays, the flow
chart, replays), with a switcher to the others in the layout. A replay
under ``/o/<outbox>/`` acts on that outbox only, and passes the same token,
session and CSRF checks. One sign-in serves every outbox: the cookies live
at the dashboard's root.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from outbox_core.console.app import SWITCHED_PAGES, Console, outbox_app
from outbox_core.console.many import PAGE_SIZE, Outboxes, slug
from outbox_core.console.pages import HERE, ROOT_SCOPE_KEY, Pages, SecurityHeaders, outbox_error
from outbox_core.console.security import Guard
from outbox_core.console.views import LISTED_STATES
from outbox_core.errors import OutboxError
from outbox_core.fleet.targets import Databases
from outbox_core.outbox import Outbox

#: The most outboxes one overview page reads.
MAX_PAGE_SIZE = 200


class FleetPages(Pages):
    """The handlers of the overview of many outboxes, and of the switch between them."""

    def __init__(
        self,
        outboxes: Outboxes,
        *,
        guard: Guard,
        hide_payloads: bool = False,
        refresh: float = 5.0,
        host_signs_in: bool = False,
        page_size: int = PAGE_SIZE,
    ) -> None:
        super().__init__(
            guard=guard, hide_payloads=hide_payloads, refresh=refresh, host_signs_in=host_signs_in
        )
        self.outboxes = outboxes
        self.page_size = page_size
        first = outboxes.bases[0]
        self.table = first.table.name

    def context(self, request: Request) -> dict[str, Any]:
        """What the layout shows above the overview: no single outbox, the table's name."""
        count = len(self.outboxes.bases)
        return {
            "fleet": True,
            "database": f"{count} database{'s' if count != 1 else ''}",
            "table": self.table,
        }

    async def overview(self, request: Request) -> Response:
        """``/``: a page of the outboxes, each one's counts and relays (``?page=``, ``?q=``)."""
        asked = self._asked(request)
        if isinstance(asked, Response):
            return asked
        page = await run_in_threadpool(self.outboxes.page, *asked)
        return self.render(request, "outboxes.html", page=page)

    async def api_outboxes(self, request: Request) -> Response:
        """``/api/outboxes``: the overview's page as JSON."""
        asked = self._asked(request)
        if isinstance(asked, Response):
            return JSONResponse({"error": "page and size must be whole numbers"}, 400)
        return JSONResponse((await run_in_threadpool(self.outboxes.page, *asked)).as_dict())

    async def go(self, request: Request) -> Response:
        """``/go?outbox=<label>&to=<page>``: the switcher's move to another outbox's page."""
        name = request.query_params.get("outbox", "")
        member = await run_in_threadpool(self.outboxes.by_label, name)
        if member is None:
            return self.bad(request, f"no outbox labelled {name!r} (now)", 404)
        to = request.query_params.get("to", "/")
        path, _, state = to.partition("?state=")
        if path not in SWITCHED_PAGES or (state and state not in LISTED_STATES):
            to = "/"  # only a page that exists in every outbox
        return RedirectResponse(self.url(request, f"/o/{quote(slug(member.label))}{to}"), 303)

    def _asked(self, request: Request) -> tuple[int, int, str] | Response:
        params = request.query_params
        number, size = params.get("page", "1"), params.get("size", str(self.page_size))
        if not number.isdigit() or not size.isdigit() or int(size) < 1:
            return self.bad(request, "page and size must be whole numbers")
        return int(number), min(int(size), MAX_PAGE_SIZE), params.get("q", "")[:200]


class PerOutbox:
    """ASGI application at ``/o/{slug}``: the named outbox's own dashboard (built once)."""

    def __init__(self, fleet: FleetPages) -> None:
        self.fleet = fleet
        self.apps: dict[str, tuple[Outbox, ASGIApp]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request to the outbox's application; 404 for an outbox unknown."""
        name = scope["path_params"]["slug"]
        member = await run_in_threadpool(self.fleet.outboxes.member, name)
        if member is None:
            # The message page at the dashboard's root, not below an outbox that is not.
            request = Request({**scope, "root_path": scope.get(ROOT_SCOPE_KEY, "")})
            response = self.fleet.bad(request, "no such outbox (now): see the overview", 404)
            await response(scope, receive, send)
            return
        built = self.apps.get(name)
        if built is None or built[0] is not member.outbox:
            if len(self.apps) > 2 * len(self.fleet.outboxes.labels()) + 16:
                self.apps.clear()  # outboxes gone since: drop their applications
            console = Console(
                member.outbox,
                guard=self.fleet.guard,
                hide_payloads=self.fleet.hide_payloads,
                refresh=self.fleet.refresh,
                host_signs_in=self.fleet.host_signs_in,
                templates=self.fleet.templates,
                label=member.label,
                labels=self.fleet.outboxes.labels,
            )
            built = (member.outbox, outbox_app(console))
            self.apps[name] = built
        await built[1](scope, receive, send)


class MarkRoot:
    """ASGI middleware: remember the dashboard's root for the pages mounted below it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Set ``scope["outbox.console_root"]`` (unless an outer dashboard did) and pass on."""
        if scope["type"] == "http":
            scope.setdefault(ROOT_SCOPE_KEY, scope.get("root_path", ""))
        await self.app(scope, receive, send)


def _closing(outboxes: Outboxes) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """A lifespan that closes ``outboxes`` when the server stops."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        outboxes.close()

    return lifespan


def fleet_console_app(
    databases: Databases | Outboxes,
    *,
    token: str | None = None,
    hide_payloads: bool = False,
    refresh: float = 5.0,
    host_signs_in: bool = False,
    page_size: int = PAGE_SIZE,
) -> Starlette:
    """The dashboard of many outboxes (``databases``: what settings name, see
    :class:`~outbox_core.fleet.targets.Databases`) as an ASGI application.

    The options are :func:`~outbox_core.console.console_app`'s; ``page_size``:
    outboxes per overview page. Pass an :class:`~outbox_core.console.many.Outboxes`
    to choose how often the outboxes are found again and each database's deadline.
    The server's stop (the ASGI lifespan) closes the databases' engines.
    """
    outboxes = databases if isinstance(databases, Outboxes) else Outboxes(databases)
    fleet = FleetPages(
        outboxes,
        guard=Guard(token),
        hide_payloads=hide_payloads,
        refresh=refresh,
        host_signs_in=host_signs_in,
        page_size=page_size,
    )
    routes = [
        Route("/", fleet.overview),
        Route("/api/outboxes", fleet.api_outboxes),
        Route("/go", fleet.go),
        Route("/healthz", fleet.healthz),
        Route("/login", fleet.login, methods=["GET", "POST"]),
        Route("/logout", fleet.logout, methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
        Mount("/o/{slug}", app=PerOutbox(fleet)),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(MarkRoot), Middleware(SecurityHeaders)],
        exception_handlers={OutboxError: outbox_error},
        lifespan=_closing(outboxes),
    )
    app.state.outboxes = outboxes
    return app


__all__ = ["FleetPages", "MarkRoot", "PerOutbox", "fleet_console_app"]
