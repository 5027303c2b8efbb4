"""The dashboard as an ASGI application: pages, a JSON API, and replays for the operator.

Mount it in a FastAPI or Starlette application (``app.mount("/outbox",
console_app(...))``), wrap it for WSGI (:func:`console_wsgi`), or run it
alone with ``outbox dashboard``. Pages render on the server with Jinja2
(autoescaping every value); the charts are drawn by uPlot from JSON the
page embeds as data and refreshes from ``/api/overview``. Every response
carries a Content-Security-Policy that runs only the dashboard's own
scripts, so a ``<script>`` in a payload is shown, never run. Many outboxes
get a dashboard of their own (:func:`~outbox_core.console.fleet.fleet_console_app`)
that serves these same pages for each outbox below ``/o/<outbox>``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from outbox_core.console.pages import (
    HERE,
    OPERATOR_SCOPE_KEY,
    Pages,
    SecurityHeaders,
    log,
    outbox_error,
)
from outbox_core.console.security import Guard
from outbox_core.console.views import LISTED_STATES, RANGES, Reader, parse_ids
from outbox_core.errors import OutboxError
from outbox_core.outbox import Outbox
from outbox_core.redaction import mask_url

#: The most ids one replay takes.
MAX_REPLAY_IDS = 1000
#: The pages the outbox switcher keeps when it moves to another outbox (an event's
#: page is not: its id means nothing there).
SWITCHED_PAGES = ("/", "/relays", "/events", "/held")

Handler = Callable[[Request], Awaitable[Response]]


class Console(Pages):
    """The dashboard's request handlers over one outbox.

    ``label`` and ``labels``: this outbox is one of many (its label, and a
    callable listing them all for the layout's switcher).
    """

    def __init__(
        self,
        outbox: Outbox,
        *,
        guard: Guard,
        hide_payloads: bool = False,
        refresh: float = 5.0,
        log_tailing: Callable[[], dict[str, Any] | None] | None = None,
        host_signs_in: bool = False,
        templates: Jinja2Templates | None = None,
        label: str | None = None,
        labels: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        super().__init__(
            guard=guard,
            hide_payloads=hide_payloads,
            refresh=refresh,
            host_signs_in=host_signs_in,
            templates=templates,
        )
        self.outbox = outbox
        self.reader = Reader(outbox, hide_payloads=hide_payloads)
        self.log_tailing = log_tailing
        self.database = mask_url(outbox.engine.url)
        self.table = outbox.table.fullname
        self.label = label
        self.labels = labels

    def context(self, request: Request) -> dict[str, Any]:
        """The outbox's database and table; with many, its label and the switcher's list."""
        values: dict[str, Any] = {"database": self.database, "table": self.table}
        if self.label is not None:
            here = request.scope.get("path", "")[len(request.scope.get("root_path", "")) :]
            if here == "/events":
                here += "?state=" + request.query_params.get("state", "dead")
            elif here not in SWITCHED_PAGES:
                here = "/"
            values.update(
                outbox_label=self.label,
                outbox_labels=list(self.labels()) if self.labels is not None else [self.label],
                here=here,
            )
        return values

    # -- pages ----------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        """``/``: counts, the oldest pending age, inflow and outflow, the relays' throughput."""
        range_name = request.query_params.get("range", "1h")
        if range_name not in RANGES:
            return self.bad(request, f"unknown range {range_name!r}: one of {', '.join(RANGES)}")
        page = await run_in_threadpool(self.reader.overview, range_name)
        return self.render(
            request, "overview.html", page=page, data=page.as_dict(), ranges=list(RANGES)
        )

    async def relays(self, request: Request) -> Response:
        """``/relays``: ordered relays, unowned partitions, log tailing's slot."""
        page = await run_in_threadpool(self._relays_page)
        return self.render(request, "relays.html", page=page)

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
        return self.render(request, "events.html", rows=rows, query=query, more=more)

    async def event(self, request: Request) -> Response:
        """``/events/{id}``: one event, its payload, headers, attempts and error."""
        row = await run_in_threadpool(self.reader.event, int(request.path_params["id"]))
        if row is None:
            return self.bad(request, "no such event (sent and cleaned up, or never there)", 404)
        return self.render(request, "event.html", row=row)

    async def held(self, request: Request) -> Response:
        """``/held``: keys whose events wait behind a dead head."""
        rows = await run_in_threadpool(self.reader.held_keys)
        return self.render(request, "held.html", rows=rows)

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

    # -- changes --------------------------------------------------------------------------

    async def replay(self, request: Request) -> Response:
        """``/replay`` (POST): dead events back to pending, by ``ids`` or by ``key`` (in order)."""
        form = await request.form()
        refused = self.refuse_change(request, form)
        if refused is not None:
            return refused
        try:
            ids = parse_ids([str(v) for v in form.getlist("ids")])
        except ValueError as exc:
            return self.bad(request, str(exc))
        key = str(form.get("key") or "") or None
        if bool(ids) == bool(key):
            return self.bad(request, "replay takes event ids or one key, not both or neither")
        if len(ids) > MAX_REPLAY_IDS:
            return self.bad(request, f"at most {MAX_REPLAY_IDS} ids per replay")
        if ids:
            count = await run_in_threadpool(lambda: self.outbox.replay(ids=ids))
        else:
            count = await run_in_threadpool(lambda: self.outbox.replay(key=key))
        where = f" on {self.label}" if self.label is not None else ""
        log.info("dashboard replay%s: %d dead events returned to pending", where, count)
        if self.wants_json(request):
            return JSONResponse({"replayed": count})
        back = str(form.get("back") or "/events")
        if not back.startswith("/") or back.startswith("//"):
            back = "/events"  # only a page of this dashboard
        separator = "&" if "?" in back else "?"
        return RedirectResponse(self.url(request, f"{back}{separator}replayed={count}"), 303)

    # -- helpers --------------------------------------------------------------------------

    def _relays_page(self) -> Any:
        tailing = self.log_tailing() if self.log_tailing is not None else None
        return self.reader.relays(tailing)

    def _event_query(self, request: Request) -> dict[str, Any] | Response:
        params = request.query_params
        state = params.get("state", "dead")
        if state not in LISTED_STATES:
            return self.bad(request, f"unknown state {state!r}: one of {', '.join(LISTED_STATES)}")
        before = params.get("before")
        if before is not None and not before.isdigit():
            return self.bad(request, "before must be an event id")
        return {
            "state": state,
            "topic": params.get("topic") or None,
            "key": params.get("key") or None,
            "error": params.get("error") or None,
            "before_id": int(before) if before else None,
            "limit": 50,
        }


def outbox_routes(console: Console) -> list[Route | Mount]:
    """The routes of one outbox's pages, its API, sign-in and replays."""
    return [
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


def outbox_app(console: Console) -> Starlette:
    """One outbox's dashboard around ``console``: its routes, the headers, masked errors."""
    return Starlette(
        routes=outbox_routes(console),
        middleware=[Middleware(SecurityHeaders)],
        exception_handlers={OutboxError: outbox_error},
    )


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
    return outbox_app(console)


__all__ = [
    "MAX_REPLAY_IDS",
    "OPERATOR_SCOPE_KEY",
    "Console",
    "console_app",
    "outbox_app",
    "outbox_routes",
]
