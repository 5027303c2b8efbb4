"""The dashboard in a real browser: what it shows, who may replay, and what never runs or leaks.

Each scenario runs ``outbox dashboard`` as the docs show it, against a table
of its own on PostgreSQL (the overview on MariaDB too), and drives headless
Chromium through it: the counts match the table and follow it by the page's
own refresh, replays need the operator token, a session and a CSRF token of
the same origin, user content is shown as text and never run, no page logs
an error (CSP violations included), and neither the database password nor
the token ever appears in a response.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from playwright.sync_api import Page, Response, expect

from outbox_core import Outbox
from outbox_core.message import State
from tests.console.conftest import (
    IMG,
    SCRIPT,
    WAIT_MS,
    Dashboard,
    Watch,
    add,
    add_dead,
    new_outbox,
    new_token,
    reachable_url,
    serve,
    set_state,
    sign_in,
    states,
)

pytestmark = [pytest.mark.system_tool, pytest.mark.needs_server]

PAYLOAD_MARK = "payload-marker-7f3a"
HEADER_MARK = "header-marker-9b1c"
HIDDEN = "hidden (--hide-payloads)"
PASSWORD = "S3cretPw123"
#: A form as Playwright's request API takes it.
Form = dict[str, str | float | bool]


@dataclass
class Shared:
    """A table of dead, held and hostile events, and a dashboard with a token over it."""

    url: str
    outbox: Outbox
    dashboard: Dashboard
    workdir: Path
    #: Dead events by name: three plain ones, and ``xss1``/``xss2`` carrying markup.
    dead: dict[str, int]


@pytest.fixture(scope="module")
def shared(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """Only read by the tests that use it: each scenario that replays has a table of its own."""
    with new_outbox(pg_url) as outbox:
        dead = {
            "full": add_dead(outbox, "order.created", "broker said: queue full", key="k-a"),
            "timeout": add_dead(outbox, "order.paid", "Timeout after 30s", key="k-b"),
            "refused": add_dead(outbox, "order.created", "connection refused", key="k-c"),
        }
        payload = {"html": SCRIPT, "img": IMG, "marker": PAYLOAD_MARK}
        headers = {"img": IMG, "script": SCRIPT, "trace": HEADER_MARK}
        dead["xss1"] = add(outbox, "xss.test", payload, key=SCRIPT, headers=headers)
        dead["xss2"] = add(outbox, "xss.test", payload, key=IMG, headers=headers)
        set_state(outbox, [dead["xss1"]], State.DEAD, f"broker said {IMG}")
        set_state(outbox, [dead["xss2"]], State.DEAD, f"broker said {SCRIPT}")
        for key in ("k-a", SCRIPT, IMG):  # events held behind those dead heads
            add(outbox, "order.created", {"later": True}, key=key)
        workdir = tmp_path_factory.mktemp("dashboard")
        token = new_token()
        with serve(pg_url, outbox.table.name, workdir, token=token, args=("--refresh", "1")) as d:
            yield Shared(pg_url, outbox, d, workdir, dead)


def dead_ids(page: Page) -> list[int]:
    """The ids of the rows the events page lists."""
    return [int(v) for v in page.locator("#events tr[data-id]").evaluate_all(
        "rows => rows.map(r => r.dataset.id)"
    )]  # fmt: skip


def csrf_of(page: Page) -> str:
    """The CSRF token the dashboard gave this browser (its cookie; the forms carry the same)."""
    found = [c["value"] for c in page.context.cookies() if c["name"] == "outbox_csrf"]
    assert found, "no CSRF cookie: the dashboard sets one with every page"
    return found[0]


# -- 1. the overview ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_overview_matches_the_table_and_follows_it(
    backend: str, page: Page, watch: Watch, tmp_path: Path
) -> None:
    url = reachable_url(backend)
    with new_outbox(url) as outbox:
        ids = [add(outbox, "order.created", {"i": i}, key=f"k{i}") for i in range(6)]
        set_state(outbox, ids[3:5], State.LEASED)
        set_state(outbox, ids[5:], State.DEAD, "refused")
        with serve(url, outbox.table.name, tmp_path, args=("--refresh", "1")) as dashboard:
            page.goto(dashboard.url("/"))
            expect(page.locator("#count-pending")).to_have_text("3")
            expect(page.locator("#count-leased")).to_have_text("2")
            expect(page.locator("#count-dead")).to_have_text("1")
            expect(page.locator("#oldest-age")).to_have_text(re.compile(r"^\d+(s|m \d+s)$"))
            expect(page.locator("#flow-chart canvas")).to_have_count(1)
            data = json.loads(page.locator("#overview-data").text_content() or "{}")
            assert sum(data["flow"]["created"]) == 6  # the chart draws every row created

            # The page follows the table by its own refresh, with no reload.
            add(outbox, "order.created", {"i": 6})
            add(outbox, "order.created", {"i": 7})
            set_state(outbox, ids[:1], State.DEAD, "refused")
            expect(page.locator("#count-pending")).to_have_text("4", timeout=WAIT_MS)
            expect(page.locator("#count-dead")).to_have_text("2")
            expect(page.locator("#count-leased")).to_have_text("2")
    assert watch.errors == []


# -- 2. dead events -------------------------------------------------------------------------


def test_dead_events_page_shows_errors_and_filters(shared: Shared, page: Page) -> None:
    dead = shared.dead
    page.goto(shared.dashboard.url("/events?state=dead"))
    assert sorted(dead_ids(page)) == sorted(dead.values())
    expected = {
        dead["full"]: "broker said: queue full",
        dead["timeout"]: "Timeout after 30s",
        dead["refused"]: "connection refused",
    }
    for event, error in expected.items():
        expect(page.locator(f'tr[data-id="{event}"] .error-text')).to_have_text(error)

    def filtered(field: str, value: str) -> list[int]:
        page.goto(shared.dashboard.url("/events?state=dead"))
        page.fill(f"#filter-{field}", value)
        with page.expect_navigation():
            page.click("#filter")
        return sorted(dead_ids(page))

    assert filtered("topic", "order.created") == sorted([dead["full"], dead["refused"]])
    assert filtered("key", "k-b") == [dead["timeout"]]
    assert filtered("error", "TIMEOUT") == [dead["timeout"]]  # a case-insensitive substring
    assert filtered("error", "refused") == [dead["refused"]]
    assert filtered("key", "no-such-key") == []
    expect(page.locator("#no-events")).to_be_visible()


# -- 3. replays with the token ----------------------------------------------------------------


def test_replay_with_the_token(pg_url: str, page: Page, tmp_path: Path) -> None:
    with new_outbox(pg_url) as outbox:
        a, b, c = (add_dead(outbox, "order.created", f"error {n}") for n in "abc")
        held = [add_dead(outbox, "acct", "declined", key="acct-7") for _ in range(2)]
        keyed = [add_dead(outbox, "acct", "declined", key="acct-8") for _ in range(2)]
        waiting = [add(outbox, "acct", {"later": key}, key=key) for key in ("acct-7", "acct-8")]
        with serve(pg_url, outbox.table.name, tmp_path, token=new_token()) as dashboard:
            sign_in(page, dashboard)
            expect(page.locator("#logout")).to_be_visible()

            # Two events ticked on the dead events page.
            page.goto(dashboard.url("/events?state=dead"))
            page.check(f'input[name=ids][value="{a}"]')
            page.check(f'input[name=ids][value="{b}"]')
            with page.expect_navigation():
                page.click("#replay-selected")
            expect(page.locator("#replayed")).to_have_text(re.compile(r"^2 dead events"))
            assert states(outbox, [a, b, c]) == {a: State.PENDING, b: State.PENDING, c: State.DEAD}
            assert sorted(dead_ids(page)) == sorted([c, *held, *keyed])

            # One event from its own page.
            page.goto(dashboard.url(f"/events/{c}"))
            with page.expect_navigation():
                page.click("#replay-one")
            expect(page.locator("#replayed")).to_have_text(re.compile(r"^1 dead events"))
            expect(page.locator("#event-state")).to_have_text("pending")
            assert states(outbox, [c]) == {c: State.PENDING}

            # A held key from the held keys page: both dead events, the waiting one untouched.
            page.goto(dashboard.url("/held"))
            expect(page.locator("#held tbody tr")).to_have_count(2)
            with page.expect_navigation():
                page.locator("#held tr", has_text="acct-7").locator(".replay-key").click()
            expect(page.locator("#replayed")).to_have_text(re.compile(r"^2 dead events"))
            expect(page.locator("#held tbody tr")).to_have_count(1)
            assert set(states(outbox, [*held, waiting[0]]).values()) == {State.PENDING}

            # A key from the event page of its first dead event.
            page.goto(dashboard.url(f"/events/{keyed[0]}"))
            with page.expect_navigation():
                page.click("#replay-key")
            expect(page.locator("#replayed")).to_have_text(re.compile(r"^2 dead events"))
            assert set(states(outbox, keyed).values()) == {State.PENDING}
            page.goto(dashboard.url("/held"))
            expect(page.locator("#no-held")).to_be_visible()


# -- 4. refusals ------------------------------------------------------------------------------


def test_without_a_token_the_dashboard_is_read_only(shared: Shared, page: Page) -> None:
    dead = list(shared.dead.values())
    table = shared.outbox.table.name
    with serve(shared.url, table, shared.workdir) as dashboard:
        page.goto(dashboard.url("/"))
        expect(page.locator("#read-only")).to_be_visible()
        expect(page.locator("#login-link")).to_have_count(0)
        page.goto(dashboard.url("/events?state=dead"))
        expect(page.locator("#events tr[data-id]")).to_have_count(len(dead))
        expect(page.locator("input[name=ids]")).to_have_count(0)
        expect(page.locator("#replay-selected")).to_have_count(0)
        page.goto(dashboard.url(f"/events/{dead[0]}"))
        expect(page.locator("#event-error")).to_have_text("broker said: queue full")
        expect(page.locator("#replay-one, #replay-key")).to_have_count(0)
        page.goto(dashboard.url("/held"))
        expect(page.locator("#held tbody tr")).to_have_count(3)
        expect(page.locator(".replay-key")).to_have_count(0)
        assert page.goto(dashboard.url("/login")).status == 404  # type: ignore[union-attr]

        form: Form = {"csrf": csrf_of(page), "ids": ",".join(map(str, dead))}
        refused = page.request.post(dashboard.url("/replay"), form=form, max_redirects=0)
        assert refused.status == 403
        bearer = {"Authorization": "Bearer " + new_token()}
        with dashboard.http() as http:
            assert (
                http.post("/replay", data={"ids": str(dead[0])}, headers=bearer).status_code == 403
            )
            assert http.post("/replay", data={"key": "k-a"}).status_code == 403
    assert set(states(shared.outbox, dead).values()) == {State.DEAD}


def test_changes_need_the_token_a_session_and_the_same_origin(
    pg_url: str, page: Page, tmp_path: Path
) -> None:
    with new_outbox(pg_url) as outbox:
        a, b, c = (add_dead(outbox, "order.created", f"error {n}") for n in "abc")
        with serve(pg_url, outbox.table.name, tmp_path, token=new_token()) as dashboard:
            replay = dashboard.url("/replay")

            # (b) Not signed in: refused, with a valid CSRF token or a wrong bearer token.
            page.goto(dashboard.url("/events?state=dead"))
            expect(page.locator("#replay-selected")).to_have_count(0)
            expect(page.locator("#login-link")).to_be_visible()
            form: Form = {"csrf": csrf_of(page), "ids": str(a)}
            assert page.request.post(replay, form=form, max_redirects=0).status == 403
            with dashboard.http() as http:
                assert http.post("/replay", data={"ids": str(a)}).status_code == 403
                wrong = {"Authorization": "Bearer " + new_token()}
                assert http.post("/replay", data={"ids": str(a)}, headers=wrong).status_code == 403
            # A wrong token at /login is refused and gives no session.
            page.goto(dashboard.url("/login"))
            page.fill("#token", new_token())
            with page.expect_navigation() as signing_in:
                page.click("#sign-in")
            assert signing_in.value is not None and signing_in.value.status == 403
            expect(page.locator("#login-failed")).to_be_visible()
            assert "outbox_session" not in {c["name"] for c in page.context.cookies()}

            # (c) Signed in, but the form is not the dashboard's own: refused.
            sign_in(page, dashboard)
            csrf = csrf_of(page)
            evil = {"Origin": "http://evil.example"}
            foreign: list[tuple[Form, dict[str, str]]] = [
                ({"csrf": "not-the-token", "ids": str(a)}, {}),
                ({"ids": str(a)}, {}),
                ({"csrf": csrf, "ids": str(a)}, evil),
            ]
            for form, headers in foreign:
                answer = page.request.post(replay, form=form, headers=headers, max_redirects=0)
                assert answer.status == 403, (form, headers)
            # A page on another site posting its form here: no session crosses over.
            page.route(
                "http://evil.example/**",
                lambda route: route.fulfill(
                    content_type="text/html",
                    body=f'<form method="post" action="{replay}"><input name="ids" value="{a}">'
                    '<input name="csrf" value="guessed"><button id="go">win</button></form>',
                ),
            )
            page.goto("http://evil.example/")
            with page.expect_navigation() as crossed:
                page.click("#go")
            assert crossed.value is not None and crossed.value.status == 403
            assert states(outbox, [a, b, c]) == {a: State.DEAD, b: State.DEAD, c: State.DEAD}
            # The same request from the dashboard's own origin passes: the session was valid.
            # (The CSRF token is read again: the refusal page of the cross-site post came
            # without the Strict cookies and set a new one.)
            csrf = csrf_of(page)
            own = {"Origin": dashboard.base}
            answer = page.request.post(
                replay, form={"csrf": csrf, "ids": str(a)}, headers=own, max_redirects=0
            )
            assert answer.status == 303
            assert states(outbox, [a]) == {a: State.PENDING}

            # (d) A script sends the token as a bearer token: no session, no CSRF needed.
            bearer = {"Authorization": f"Bearer {dashboard.token}", "Accept": "application/json"}
            with dashboard.http() as http:
                answer_b = http.post("/replay", data={"ids": str(b)}, headers=bearer)
            assert answer_b.status_code == 200 and answer_b.json() == {"replayed": 1}
            assert states(outbox, [b, c]) == {b: State.PENDING, c: State.DEAD}


# -- 5. user content is data, never markup ----------------------------------------------------


@pytest.mark.parametrize("where", ["events", "xss1", "xss2", "held"])
def test_user_content_is_shown_never_run(
    shared: Shared, page: Page, watch: Watch, where: str
) -> None:
    dead = shared.dead
    paths = {
        "events": "/events?state=dead&topic=xss.test",
        "xss1": f"/events/{dead['xss1']}",
        "xss2": f"/events/{dead['xss2']}",
        "held": "/held",
    }
    sign_in(page, shared.dashboard)  # signed in, the pages also carry the replay forms
    page.goto(shared.dashboard.url(paths[where]))
    if where == "events":
        texts = [
            page.locator(f'tr[data-id="{dead[n]}"]').text_content() or "" for n in ("xss1", "xss2")
        ]
        assert SCRIPT in texts[0] and f"broker said {IMG}" in texts[0]
        assert IMG in texts[1] and f"broker said {SCRIPT}" in texts[1]
    elif where == "held":
        rows = page.locator("#held tbody tr")
        expect(rows).to_have_count(3)
        held = rows.evaluate_all("rows => rows.map(r => r.textContent)")
        assert any(SCRIPT in t and f"broker said {IMG}" in t for t in held), held
        assert any(IMG in t and f"broker said {SCRIPT}" in t for t in held), held
    else:
        key, error = (SCRIPT, IMG) if where == "xss1" else (IMG, SCRIPT)
        expect(page.locator("#event-key")).to_have_text(key)
        expect(page.locator("#event-error")).to_have_text(f"broker said {error}")
    # Handlers that would have run by now: the page, its images and scripts are loaded.
    page.wait_for_load_state("networkidle")
    assert page.evaluate("typeof window.__xss") == "undefined"
    assert page.locator("script:not([src])").count() == 0  # none came in with the content
    assert watch.dialogs == []
    assert watch.errors == []


def test_payload_and_headers_are_shown_as_written(shared: Shared, page: Page) -> None:
    """The event page shows a payload's and headers' text as stored, ``<`` as ``<``."""
    page.goto(shared.dashboard.url(f"/events/{shared.dead['xss1']}"))
    payload = page.locator("#event-payload").text_content() or ""
    headers = page.locator("#event-headers").text_content() or ""
    assert json.loads(payload)["html"] == SCRIPT
    assert SCRIPT in payload, payload
    assert IMG.replace('"', '\\"') in headers, headers
    assert page.evaluate("typeof window.__xss") == "undefined"


# -- 6. no script errors ----------------------------------------------------------------------


def test_no_page_logs_an_error(shared: Shared, page: Page, watch: Watch) -> None:
    dashboard = shared.dashboard
    paths = [
        "/",
        "/?range=24h",
        "/relays",
        "/events?state=dead",
        f"/events/{shared.dead['full']}",
        "/held",
        "/login",
    ]
    for signed_in in (False, True):
        if signed_in:
            sign_in(page, dashboard)
        for path in paths:
            if path.startswith("/?") or path == "/":
                # The overview's own refresh runs once too.
                with page.expect_response(lambda r: "/api/overview" in r.url) as refreshed:
                    page.goto(dashboard.url(path))
                assert refreshed.value.ok
                expect(page.locator("#flow-chart canvas")).to_have_count(1)
            else:
                page.goto(dashboard.url(path))
            assert watch.errors == [], (path, signed_in)
    # The watch would see a CSP violation: an inline script is refused, and logged.
    with page.expect_console_message(lambda m: "Content Security Policy" in m.text):
        page.evaluate(
            "() => { const s = document.createElement('script');"
            " s.textContent = 'window.__ran = 1'; document.body.appendChild(s); }"
        )
    assert page.evaluate("typeof window.__ran") == "undefined"
    assert any("Content Security Policy" in e for e in watch.errors), watch.errors


# -- 7. --hide-payloads -----------------------------------------------------------------------


def test_hide_payloads(shared: Shared, page: Page) -> None:
    event = shared.dead["xss1"]
    args = ("--hide-payloads",)
    with serve(shared.url, shared.outbox.table.name, shared.workdir, args=args) as dashboard:
        page.goto(dashboard.url(f"/events/{event}"))
        expect(page.locator("#event-payload")).to_have_text(HIDDEN)
        expect(page.locator("#event-headers")).to_have_text(HIDDEN)
        expect(page.locator("#event-key")).to_have_text(SCRIPT)  # the rest is shown
        assert PAYLOAD_MARK not in page.content() and HEADER_MARK not in page.content()
        for path in (f"/api/events/{event}", "/api/events?state=dead", f"/events/{event}"):
            body = page.request.get(dashboard.url(path)).text()
            assert PAYLOAD_MARK not in body and HEADER_MARK not in body, path
        api = page.request.get(dashboard.url(f"/api/events/{event}")).json()
        assert api["payload"] == HIDDEN and api["headers"] == HIDDEN


# -- 8. no secret in any response -------------------------------------------------------------


def test_no_password_or_token_in_any_response(shared: Shared, page: Page) -> None:
    url = sa.make_url(shared.url).set(password=PASSWORD)  # loopback trust: ignored, yet present
    token = new_token()
    table = shared.outbox.table.name
    event = shared.dead["xss1"]
    pages = [
        "/", "/?range=7d", "/relays", "/events?state=dead", "/events?state=pending",
        f"/events/{event}", "/held", "/events/999999", "/?range=nope", "/login",
    ]  # fmt: skip
    apis = [
        "/api/overview", "/api/relays", "/api/events?state=dead", f"/api/events/{event}",
        "/api/held", "/api/events/999999", "/healthz", "/static/console.js", "/nowhere",
    ]  # fmt: skip
    seen: list[tuple[str, str]] = []
    responses: list[Response] = []
    page.on("response", lambda response: responses.append(response))

    def read_browser_responses() -> None:
        for response in responses:
            headers = json.dumps(response.headers_array())
            body = "" if 300 <= response.status < 400 else response.text()
            seen.append((response.url, f"{headers}\n{body}"))
        responses.clear()

    with serve(url.render_as_string(hide_password=False), table, shared.workdir, token=token) as d:
        # As the browser: signed out, a wrong token, signed in, every page and API.
        for path in ["/", "/login"]:
            page.goto(d.url(path))
            read_browser_responses()
        for offered in (new_token(), token):
            page.goto(d.url("/login"))
            read_browser_responses()
            page.fill("#token", offered)
            with page.expect_navigation():
                page.click("#sign-in")
            read_browser_responses()
        expect(page.locator("#logout")).to_be_visible()  # signed in by the right token
        for path in pages + apis:
            page.goto(d.url(path))
            read_browser_responses()
        refused = page.request.post(d.url("/replay"), form={"csrf": "x", "ids": "1"})
        seen.append(("POST /replay", json.dumps(refused.headers_array) + refused.text()))
        assert "postgres:***@" in page.goto(d.url("/")).text()  # type: ignore[union-attr]

        # As a script: the same, and each way of signing in and posting.
        with d.http() as http:
            answers = [http.get(path) for path in pages + apis]
            csrf = http.cookies["outbox_csrf"]
            for offered in (new_token(), token):
                answers.append(http.post("/login", data={"csrf": csrf, "token": offered}))
            answers += [http.get(path) for path in pages]  # signed in now
            answers.append(http.post("/replay", data={"csrf": "x", "ids": "1"}))
            answers.append(
                http.post("/replay", data={"ids": "1"}, headers={"Accept": "application/json"})
            )
        assert any(a.status_code == 303 and "outbox_session" in a.headers.get("set-cookie", "")
                   for a in answers), "the right token did not sign in"  # fmt: skip
        seen += [(str(a.url), f"{a.headers.multi_items()}\n{a.text}") for a in answers]
    seen.append(("the dashboard's output", d.output.read_text(errors="replace")))
    assert len(seen) > 40
    for where, text in seen:
        assert PASSWORD not in text, f"the database password in {where}"
        assert token not in text, f"the operator token in {where}"
