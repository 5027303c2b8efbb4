"""The dashboard's application, in-process: pages, the API, who may replay, escaping, secrets.

The browser tests (test_browser.py) drive the same application in Chromium;
these check each rule at the HTTP level on every database, and the mounts
(FastAPI, WSGI).
"""

from __future__ import annotations

import io
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from starlette.testclient import TestClient

from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker
from outbox_core.console import console_app, console_wsgi, load_token
from outbox_core.console.security import CSRF_COOKIE, SESSION_COOKIE, TOKEN_ENV, Guard
from outbox_core.errors import ConfigurationError
from outbox_core.message import State

TOKEN = "operator-token-0123456789"
XSS = '<script>window.__xss=1</script><img src=x onerror="window.__xss=1">'


def put(
    outbox: Outbox,
    n: int,
    *,
    topic: str = "orders.created",
    key: str | None = "k1",
    payload: Any = None,
) -> list[int]:
    """``n`` events enqueued in one transaction; their row ids."""
    with outbox.engine.begin() as conn:
        for i in range(n):
            outbox.enqueue(conn, topic=topic, key=key, payload=payload or {"n": i})
    t = outbox.table
    with outbox.engine.connect() as conn:
        return list(conn.execute(sa.select(t.c.id).order_by(t.c.id.desc()).limit(n)).scalars())[
            ::-1
        ]


def set_state(outbox: Outbox, ids: list[int], state: State, error: str | None = None) -> None:
    t = outbox.table
    with outbox.engine.begin() as conn:
        conn.execute(sa.update(t).where(t.c.id.in_(ids)).values(state=int(state), last_error=error))


def states(outbox: Outbox, ids: list[int]) -> list[int]:
    t = outbox.table
    with outbox.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.state).where(t.c.id.in_(ids)).order_by(t.c.id))
        return [int(s) for s in rows.scalars()]


def csrf_of(client: TestClient) -> str:
    client.get("/events")
    return str(client.cookies[CSRF_COOKIE])


def sign_in(client: TestClient) -> None:
    csrf = csrf_of(client)
    answer = client.post("/login", data={"token": TOKEN, "csrf": csrf}, follow_redirects=False)
    assert answer.status_code == 303
    assert SESSION_COOKIE in answer.cookies


@pytest.mark.needs_server
def test_overview_counts_match_the_table(outbox: Outbox) -> None:
    ids = put(outbox, 9)
    set_state(outbox, ids[:2], State.LEASED)
    set_state(outbox, ids[2:5], State.DEAD, "broker said no")
    client = TestClient(console_app(outbox))
    data = client.get("/api/overview").json()
    assert (data["pending"], data["leased"], data["dead"]) == (4, 2, 3)
    assert data["oldest_pending_age"] is not None
    # The chart's last hour: 9 created, one bucket per minute.
    assert sum(data["flow"]["created"]) == 9
    assert len(data["flow"]["starts"]) in (60, 61)
    page = client.get("/")
    assert page.status_code == 200
    for name, value in (("pending", 4), ("leased", 2), ("dead", 3)):
        assert re.search(rf'id="count-{name}"[^>]*>{value}<', page.text), name
    for rng in ("6h", "24h", "7d", "30d"):
        assert client.get(f"/?range={rng}").status_code == 200
    assert client.get("/?range=1y").status_code == 400


@pytest.mark.needs_server
def test_read_only_refuses_every_change_and_changes_nothing(outbox: Outbox) -> None:
    ids = put(outbox, 2)
    set_state(outbox, ids, State.DEAD, "boom")
    client = TestClient(console_app(outbox))
    page = client.get("/events?state=dead")
    assert 'id="read-only"' in page.text and 'name="ids"' not in page.text
    csrf = str(client.cookies[CSRF_COOKIE])
    for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}):
        answer = client.post("/replay", data={"ids": str(ids[0]), "csrf": csrf}, headers=headers)
        assert answer.status_code == 403
        assert "read-only" in answer.text
    assert client.get("/login").status_code == 404
    assert states(outbox, ids) == [int(State.DEAD)] * 2


@pytest.mark.needs_server
def test_replay_needs_a_session_and_its_csrf_token_or_the_bearer_token(outbox: Outbox) -> None:
    ids = put(outbox, 4)
    set_state(outbox, ids, State.DEAD, "boom")
    client = TestClient(console_app(outbox, token=TOKEN))
    csrf = csrf_of(client)
    # Not signed in.
    assert client.post("/replay", data={"ids": str(ids[0]), "csrf": csrf}).status_code == 403
    # A wrong token does not sign in.
    wrong = client.post("/login", data={"token": "x" * 20, "csrf": csrf}, follow_redirects=False)
    assert wrong.status_code == 403 and SESSION_COOKIE not in client.cookies
    # Sign-in itself needs the CSRF token.
    assert client.post("/login", data={"token": TOKEN}).status_code == 403
    sign_in(client)
    # Signed in, but no CSRF field, a wrong one, or another site's Origin: refused.
    assert client.post("/replay", data={"ids": str(ids[0])}).status_code == 403
    assert client.post("/replay", data={"ids": str(ids[0]), "csrf": "nope"}).status_code == 403
    evil = {"Origin": "http://evil.example"}
    refused = client.post("/replay", data={"ids": str(ids[0]), "csrf": csrf}, headers=evil)
    assert refused.status_code == 403
    assert states(outbox, ids) == [int(State.DEAD)] * 4
    # Signed in with the CSRF token: two ids replayed.
    done = client.post(
        "/replay",
        data={"ids": [str(ids[0]), str(ids[1])], "csrf": csrf, "back": "/events?state=dead"},
        follow_redirects=False,
    )
    assert done.status_code == 303 and done.headers["location"].endswith("replayed=2")
    # A script: the bearer token, no cookie, no CSRF.
    script = TestClient(console_app(outbox, token=TOKEN))
    answer = script.post(
        "/replay",
        data={"ids": str(ids[2])},
        headers={"Authorization": f"Bearer {TOKEN}", "Accept": "application/json"},
    )
    assert answer.json() == {"replayed": 1}
    assert states(outbox, ids) == [int(State.PENDING)] * 3 + [int(State.DEAD)]
    # Ids and a key together, or a bad id, are refused with the reason.
    bad = client.post("/replay", data={"ids": "1 x", "csrf": csrf})
    assert bad.status_code == 400 and "not an event id" in bad.text


@pytest.mark.needs_server
def test_replay_of_a_key_returns_its_dead_events_in_order(outbox: Outbox) -> None:
    mine = put(outbox, 3, key="acct-7")
    other = put(outbox, 1, key="acct-8")
    set_state(outbox, mine + other, State.DEAD, "boom")
    client = TestClient(console_app(outbox, token=TOKEN))
    held = client.get("/api/held").json()
    assert held == [] or {h["key"] for h in held} <= {"acct-7", "acct-8"}
    answer = client.post(
        "/replay",
        data={"key": "acct-7"},
        headers={"Authorization": f"Bearer {TOKEN}", "Accept": "application/json"},
    )
    assert answer.json() == {"replayed": 3}
    assert states(outbox, mine) == [int(State.PENDING)] * 3
    assert states(outbox, other) == [int(State.DEAD)]


@pytest.mark.needs_server
def test_user_content_is_escaped_and_payloads_can_be_hidden(outbox: Outbox) -> None:
    (event_id,) = put(outbox, 1, key=XSS, payload={"note": XSS})
    set_state(outbox, [event_id], State.DEAD, XSS)
    client = TestClient(console_app(outbox))
    for path in ("/events?state=dead", f"/events/{event_id}", "/held"):
        body = client.get(path).text
        assert "<script>window.__xss" not in body and "<img src=x" not in body, path
    assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in client.get(f"/events/{event_id}").text
    hidden = TestClient(console_app(outbox, hide_payloads=True))
    data = hidden.get(f"/api/events/{event_id}").json()
    assert data["payload"] == "hidden (--hide-payloads)"
    assert data["headers"] in (None, "hidden (--hide-payloads)")
    assert (
        "__xss" not in hidden.get(f"/events/{event_id}").text.split('id="event-payload"')[1][:200]
    )
    assert "hidden (--hide-payloads)" in hidden.get(f"/events/{event_id}").text


@pytest.mark.needs_server
def test_every_response_carries_the_security_headers(outbox: Outbox) -> None:
    client = TestClient(console_app(outbox))
    for path in ("/", "/static/console.js", "/api/overview", "/events/999999999"):
        headers = client.get(path).headers
        assert "script-src 'self'" in headers["content-security-policy"], path
        assert headers["x-content-type-options"] == "nosniff"
    assert client.get("/events/999999999").status_code == 404


@pytest.mark.needs_server
def test_no_password_or_token_in_any_response(backend: str, outbox: Outbox) -> None:
    if backend != "postgresql":
        pytest.skip("the PostgreSQL server here trusts loopback: a password is ignored")
    url = outbox.engine.url.set(password="S3cretPw123")
    secret_outbox = Outbox(url.render_as_string(hide_password=False), table=outbox.table.name)
    (event_id,) = put(outbox, 1)
    set_state(outbox, [event_id], State.DEAD, "amqp://app:S3cretPw123@rabbit/ refused")
    client = TestClient(console_app(secret_outbox, token=TOKEN))
    sign_in(client)
    paths = [
        "/",
        "/relays",
        "/events?state=dead",
        f"/events/{event_id}",
        "/held",
        "/login",
        "/api/overview",
        "/api/relays",
        "/api/events?state=dead",
        f"/api/events/{event_id}",
    ]
    for path in paths:
        answer = client.get(path)
        text = answer.text + str(answer.headers)
        assert "S3cretPw123" not in text and TOKEN not in text, path
    assert "***" in client.get(f"/events/{event_id}").text
    secret_outbox.dispose()


@pytest.mark.needs_server
def test_mounted_in_fastapi_links_and_redirects_stay_under_the_prefix(outbox: Outbox) -> None:
    ids = put(outbox, 1)
    set_state(outbox, ids, State.DEAD, "boom")
    app = FastAPI()
    app.mount("/ops/outbox", console_app(outbox, token=TOKEN))
    client = TestClient(app)
    page = client.get("/ops/outbox/events?state=dead")
    assert 'src="/ops/outbox/static/console.js"' in page.text
    assert client.get("/ops/outbox/static/console.js").status_code == 200
    csrf = str(client.cookies[CSRF_COOKIE])
    login = client.post(
        "/ops/outbox/login", data={"token": TOKEN, "csrf": csrf}, follow_redirects=False
    )
    assert login.headers["location"] == "/ops/outbox/"
    done = client.post(
        "/ops/outbox/replay",
        data={"ids": str(ids[0]), "csrf": csrf, "back": "/events?state=dead"},
        follow_redirects=False,
    )
    assert done.headers["location"] == "/ops/outbox/events?state=dead&replayed=1"


@pytest.mark.needs_server
def test_as_a_wsgi_application(outbox: Outbox) -> None:
    put(outbox, 3)
    app = console_wsgi(outbox)
    environ = {
        "REQUEST_METHOD": "GET",
        # Mounted under a prefix as docs/dashboard.md shows for Django's wsgi.py.
        "SCRIPT_NAME": "/ops/outbox",
        "PATH_INFO": "/api/overview",
        "QUERY_STRING": "",
        "SERVER_NAME": "localhost",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(b""),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    started: list[str] = []
    body = b"".join(app(environ, lambda status, headers, *exc: started.append(status)))
    assert started == ["200 OK"]
    assert b'"pending":3' in body
    page = b"".join(
        app(
            {**environ, "PATH_INFO": "/", "wsgi.input": io.BytesIO(b"")},
            lambda status, headers, *exc: started.append(status),
        )
    )
    assert started[-1] == "200 OK"
    assert b'src="/ops/outbox/static/console.js"' in page


def test_the_token_comes_from_the_environment_or_a_file_and_must_be_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_token() is None
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert load_token() == TOKEN
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(ConfigurationError, match="shorter than 16"):
        load_token()
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}-file\n")
    assert load_token(path) == f"{TOKEN}-file"
    with pytest.raises(ConfigurationError, match="token file"):
        load_token(tmp_path / "missing")


def test_sessions_are_signed_by_the_token_and_expire() -> None:
    guard = Guard(TOKEN)
    cookie = guard.new_session(now=1000.0)
    assert guard.session_ok(cookie, now=1001.0)
    assert not guard.session_ok(cookie, now=1000.0 + 9 * 3600)
    assert not Guard(TOKEN + "-rotated").session_ok(cookie, now=1001.0)
    expires, nonce, signature = cookie.split(".")
    assert not guard.session_ok(f"{int(expires) + 3600}.{nonce}.{signature}", now=1001.0)
    assert TOKEN not in cookie
    assert not Guard(None).session_ok(cookie)


@pytest.mark.needs_server
def test_every_running_relay_is_listed_with_its_throughput(outbox: Outbox) -> None:
    """An unordered and a partitioned relay both show on /relays and the overview, with what
    they published; the partitions are all owned."""
    put(outbox, 20)
    relays = [
        outbox.relay(MemoryBroker(), heartbeat=0.5, poll_interval=0.05),
        outbox.relay(MemoryBroker(), heartbeat=0.5, poll_interval=0.05, ordering="partitions"),
    ]
    threads = [
        threading.Thread(target=r.run, kwargs={"install_signal_handlers": False}) for r in relays
    ]
    for thread in threads:
        thread.start()
    client = TestClient(console_app(outbox))
    try:
        deadline = time.monotonic() + 20
        while True:
            data = client.get("/api/relays").json()
            shown = {r["mode"]: r for r in data["relays"]}
            published = sum(r["published"] or 0 for r in data["relays"])
            if {"none", "partitions"} <= set(shown) and published == 20:
                break
            assert time.monotonic() < deadline, data
            time.sleep(0.1)
        assert data["unowned_count"] == 0
        assert shown["partitions"]["count"] == 256 and shown["none"]["epoch"] is None
        overview = client.get("/api/overview").json()
        assert overview["outflow_per_minute"] == 20
        page = client.get("/relays").text
        assert all(r["relay_id"] in page for r in data["relays"])
    finally:
        for relay in relays:
            relay.stop()
        for thread in threads:
            thread.join(30)
    assert client.get("/api/relays").json()["relays"] == []  # clean stops remove their rows


@pytest.mark.needs_server
def test_a_refresh_reads_only_the_newest_buckets(outbox: Outbox) -> None:
    """The page refreshes with ``since`` (its newest bucket's start): only the buckets from
    there on come back, with the counts a full read gives them."""
    put(outbox, 7)
    client = TestClient(console_app(outbox))
    full = client.get("/api/overview").json()["flow"]
    newest = full["starts"][-1]
    part = client.get(f"/api/overview?since={newest}").json()["flow"]
    assert part["partial"] and not full["partial"]
    assert 1 <= len(part["starts"]) <= 3 and newest in part["starts"]
    assert part["seconds"] == full["seconds"] == 3600
    at = part["starts"].index(newest)
    assert part["created"][at] == full["created"][-1]
    assert sum(part["created"]) == 7
    for bad in ("x", "nan", "inf"):
        assert client.get(f"/api/overview?since={bad}").status_code == 400
