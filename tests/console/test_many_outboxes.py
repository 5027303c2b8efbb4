"""The dashboard of many outboxes, in-process, on real PostgreSQL schemas (and a MariaDB
database beside them): the overview of them all, each one's pages, replays that touch only
the outbox named, a database that is down, and reads bounded by the page.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker
from outbox_core.config import Settings
from outbox_core.console import fleet_console_app
from outbox_core.console.many import Outboxes, slug
from outbox_core.console.security import CSRF_COOKIE, SESSION_COOKIE
from outbox_core.fleet.relay import FleetRelay
from outbox_core.fleet.targets import Databases
from outbox_core.message import State
from tests.conftest import reachable_url
from tests.console.test_app import TOKEN, put, set_state, states
from tests.faults.private_servers import PrivatePostgres, free_port

pytestmark = pytest.mark.needs_server

TABLE = "h3_outbox"
BEARER = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json"}


@dataclass
class Fleet:
    """Outboxes in schemas ``h3_<run>_<name>`` (``url``'s), and the pattern naming them."""

    url: str
    run: str
    outboxes: dict[str, Outbox] = field(default_factory=dict)
    made: list[tuple[str, str]] = field(default_factory=list)

    @property
    def pattern(self) -> str:
        """The ``--schemas`` pattern of this run's outboxes."""
        return f"h3_{self.run}_*"

    def label(self, name: str) -> str:
        """The dashboard's label of outbox ``name`` (its schema)."""
        return f"h3_{self.run}_{name}"

    def add(self, name: str, url: str | None = None) -> Outbox:
        """A schema (MySQL: database) ``h3_<run>_<name>`` with an installed outbox."""
        url = url or self.url
        schema = self.label(name)
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            conn.execute(sa.schema.CreateSchema(schema))
        engine.dispose()
        self.made.append((url, schema))
        outbox = Outbox(url, schema=schema, table=TABLE)
        outbox.install()
        self.outboxes[name] = outbox
        return outbox

    def settings(self, *more_urls: str, **values: Any) -> Settings:
        """Settings naming every outbox of the pattern, on ``url`` and ``more_urls``."""
        return Settings(
            database_url=self.url,
            database_urls=more_urls,
            schemas=self.pattern,
            table=TABLE,
            **values,
        )

    def client(self, *more_urls: str, token: str | None = None, **options: Any) -> TestClient:
        """A client of the dashboard of this run's outboxes."""
        outboxes = Outboxes(Databases(self.settings(*more_urls)), **options)
        return TestClient(fleet_console_app(outboxes, token=token))

    def drop(self) -> None:
        """Drop every schema made (tables and all)."""
        for outbox in self.outboxes.values():
            outbox.dispose()
        for url, schema in self.made:
            engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
            with contextlib.suppress(sa.exc.OperationalError), engine.begin() as conn:
                conn.execute(sa.schema.DropSchema(schema, cascade=url.startswith("postgresql")))
            engine.dispose()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Outboxes ``a`` and ``b`` in two PostgreSQL schemas; more added by the test."""
    made = Fleet(reachable_url("postgresql", tmp_path), uuid.uuid4().hex[:8])
    try:
        made.add("a")
        made.add("b")
        yield made
    finally:
        made.drop()


def by_label(client: TestClient, path: str = "/api/outboxes") -> dict[str, dict[str, Any]]:
    """The overview's lines as JSON, by label."""
    answer = client.get(path)
    assert answer.status_code == 200, answer.text
    return {line["label"]: line for line in answer.json()["outboxes"]}


def wait_for(check: Any, what: str, timeout: float = 20.0) -> Any:
    """Poll ``check()`` until it returns something true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.1)  # the poll's pace


def test_the_overview_lists_every_outbox_with_its_counts_and_relays(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Two PostgreSQL schemas and a MariaDB database: each one's line holds its own counts,
    links to its pages, and the relays serving it once a fleet relay runs."""
    maria = reachable_url("mysql", tmp_path)
    fleet.add("m", maria)
    a, b, m = (fleet.outboxes[n] for n in "abm")
    put(a, 3)
    dead_b = put(b, 3)
    set_state(b, dead_b[:1], State.DEAD, "nope")
    set_state(b, dead_b[1:2], State.LEASED)
    dead_m = put(m, 2)
    set_state(m, dead_m, State.DEAD, "nope")
    client = fleet.client(maria)
    lines = by_label(client)
    assert set(lines) == {fleet.label(n) for n in "abm"}
    counts = {label: (x["pending"], x["leased"], x["dead"]) for label, x in lines.items()}
    assert counts == {fleet.label("a"): (3, 0, 0), fleet.label("b"): (1, 1, 1)} | {
        fleet.label("m"): (0, 0, 2)
    }
    assert lines[fleet.label("a")]["oldest_pending_age"] is not None
    assert lines[fleet.label("m")]["database"].startswith("mysql+pymysql://")
    assert all(x["relays"] == 0 and x["error"] is None for x in lines.values())
    page = client.get("/").text
    for n in "abm":
        assert f'href="/o/{slug(fleet.label(n))}/"' in page
    assert f'href="/o/{fleet.label("b")}/events?state=dead"' in page

    settings = fleet.settings(maria, heartbeat=0.5, poll_interval=0.05)
    relay = FleetRelay(settings, MemoryBroker(), name="h3-dashboard")
    thread = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:

        def served() -> dict[str, dict[str, Any]] | None:
            now = by_label(client)
            done = all(x["relays"] == 1 and x["pending"] == 0 for x in now.values())
            return now if done else None

        wait_for(served, "every outbox served by the relay and drained")
    finally:
        relay.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_each_outboxs_pages_show_that_outbox_only(fleet: Fleet) -> None:
    """Below ``/o/<label>/``: the events, one event, counts and relays of that outbox (the
    same row ids exist in both), the switcher to the other, a 404 for an unknown one."""
    a, b = fleet.outboxes["a"], fleet.outboxes["b"]
    ids_a = put(a, 2, topic="alpha.created")
    ids_b = put(b, 3, topic="beta.created")
    assert ids_a == ids_b[:2]  # the same ids: only the outbox named tells them apart
    set_state(a, ids_a, State.DEAD, "alpha failed")
    set_state(b, ids_b, State.DEAD, "beta failed")
    client = fleet.client()
    la, lb = fleet.label("a"), fleet.label("b")
    page = client.get(f"/o/{la}/events?state=dead")
    assert page.status_code == 200
    assert "alpha.created" in page.text and "beta" not in page.text
    assert {e["topic"] for e in client.get(f"/o/{lb}/api/events?state=dead").json()} == {
        "beta.created"
    }
    assert client.get(f"/o/{la}/api/events/{ids_a[0]}").json()["topic"] == "alpha.created"
    assert "beta failed" in client.get(f"/o/{lb}/events/{ids_a[0]}").text
    assert client.get(f"/o/{la}/api/overview").json()["dead"] == 2
    assert client.get(f"/o/{lb}/api/overview").json()["dead"] == 3
    for path in ("/", "/relays", "/held"):
        answer = client.get(f"/o/{la}{path}")
        assert answer.status_code == 200, path
        # The layout: this outbox named, the way back, the others to switch to.
        text = answer.text
        assert 'id="switcher"' in text and f"<option selected>{la}</option>" in text
        assert f"<option>{lb}</option>" in text and 'href="/" id="nav-outboxes"' in text
    assert 'src="/static/console.js"' in page.text
    moved = client.get(f"/go?outbox={lb}&to=/events?state=dead", follow_redirects=False)
    assert moved.status_code == 303 and moved.headers["location"] == f"/o/{lb}/events?state=dead"
    moved = client.get(f"/go?outbox={lb}&to=/events/{ids_a[0]}", follow_redirects=False)
    assert moved.headers["location"] == f"/o/{lb}/"
    assert client.get("/o/h3_no_such_outbox/events").status_code == 404
    assert client.get("/go?outbox=h3_no_such_outbox").status_code == 404


def test_a_replay_acts_on_the_outbox_named_only(fleet: Fleet) -> None:
    """Signed in once at the root, a replay below one outbox returns its dead events and no
    other outbox's (the same ids there); the token, session and CSRF checks are as for one
    outbox, and a read-only dashboard refuses."""
    a, b = fleet.outboxes["a"], fleet.outboxes["b"]
    ids = put(a, 3)
    assert put(b, 3) == ids
    set_state(a, ids, State.DEAD, "boom")
    set_state(b, ids, State.DEAD, "boom")
    la, lb = fleet.label("a"), fleet.label("b")
    dead = [int(State.DEAD)] * 3

    read_only = fleet.client()
    csrf = (read_only.get("/"), str(read_only.cookies[CSRF_COOKIE]))[1]
    refused = read_only.post(f"/o/{la}/replay", data={"ids": str(ids[0]), "csrf": csrf})
    assert refused.status_code == 403 and "read-only" in refused.text
    assert read_only.post(f"/o/{la}/replay", data={"key": "k1"}, headers=BEARER).status_code == 403

    client = fleet.client(token=TOKEN)
    client.get(f"/o/{la}/events?state=dead")
    csrf = str(client.cookies[CSRF_COOKIE])
    # Not signed in; then a wrong CSRF token and another site's Origin, signed in.
    form = {"ids": str(ids[0]), "csrf": csrf}
    assert client.post(f"/o/{la}/replay", data=form).status_code == 403
    login = client.post("/login", data={"token": TOKEN, "csrf": csrf}, follow_redirects=False)
    assert login.status_code == 303 and login.headers["location"] == "/"
    assert "Path=/;" in login.headers["set-cookie"] and SESSION_COOKIE in client.cookies
    wrong = client.post(f"/o/{la}/replay", data={"ids": str(ids[0]), "csrf": "nope"})
    assert wrong.status_code == 403
    evil = {"Origin": "http://evil.example"}
    assert client.post(f"/o/{la}/replay", data=form, headers=evil).status_code == 403
    assert states(a, ids) == dead and states(b, ids) == dead

    done = client.post(
        f"/o/{la}/replay",
        data={"ids": [str(ids[0]), str(ids[1])], "csrf": csrf, "back": "/events?state=dead"},
        follow_redirects=False,
    )
    assert done.status_code == 303
    assert done.headers["location"] == f"/o/{la}/events?state=dead&replayed=2"
    assert states(a, ids) == [int(State.PENDING)] * 2 + [int(State.DEAD)]
    assert states(b, ids) == dead  # the other outbox, same ids: untouched
    # A script with the bearer token, by key, on the other outbox.
    by_key = TestClient(client.app).post(f"/o/{lb}/replay", data={"key": "k1"}, headers=BEARER)
    assert by_key.json() == {"replayed": 3}
    assert states(b, ids) == [int(State.PENDING)] * 3
    assert states(a, ids)[2] == int(State.DEAD)
    # Nothing replays at the root, where no outbox is named.
    assert client.post("/replay", data={"key": "k1", "csrf": csrf}).status_code in (404, 405)
    assert states(a, ids)[2] == int(State.DEAD)


def test_a_database_that_is_down_shows_its_error_and_the_page_stands(fleet: Fleet) -> None:
    """One database never answers, another goes down after its outbox was found: the
    overview shows each one's error on its lines, the others' counts, and the down
    outbox's own pages answer 503 with the reason, password masked."""
    put(fleet.outboxes["a"], 2)
    server = PrivatePostgres()
    try:
        server.start()
        fleet.add("p", server.url)
        put(fleet.outboxes["p"], 4)
        never = f"postgresql+psycopg://app:S3cretPw@127.0.0.1:{free_port()}/nothing"
        client = fleet.client(server.url, never, rediscover=0.0, deadline=10.0)
        lines = by_label(client)
        assert lines[fleet.label("a")]["pending"] == 2
        assert lines[fleet.label("p")]["pending"] == 4 and lines[fleet.label("p")]["error"] is None
        (down,) = [x for x in lines.values() if x["error"]]
        assert down["linked"] is False and down["pending"] is None
        assert "S3cretPw" not in down["error"] + down["database"]

        fleet.outboxes["p"].dispose()
        server.stop("fast")
        page = client.get("/")
        assert page.status_code == 200 and "S3cretPw" not in page.text
        lines = by_label(client)
        gone = lines[fleet.label("p")]  # found before: still listed, with why it is not read
        assert gone["error"] and gone["pending"] is None and gone["linked"] is True
        assert lines[fleet.label("a")]["pending"] == 2 and lines[fleet.label("a")]["error"] is None
        assert f'id="outbox-{fleet.label("p")}"' in page.text
        own = client.get(f"/o/{fleet.label('p')}/api/overview")
        assert own.status_code == 503 and "did not answer" in own.text
    finally:
        server.remove()


def test_reads_are_bounded_by_the_page_and_the_list_is_found_again(fleet: Fleet) -> None:
    """With more outboxes than a page holds, a view reads that page's outboxes only (a few
    statements each, on one connection); the filter and paging choose them; an outbox
    made since the last view shows on the next."""
    for name in ("c", "d", "e"):
        fleet.add(name)
    outboxes = Outboxes(Databases(fleet.settings()), rediscover=0.0)
    client = TestClient(fleet_console_app(outboxes, page_size=2))
    seen: list[str] = []
    engine = outboxes.bases[0].engine
    sa.event.listen(engine, "before_cursor_execute", lambda *args: seen.append(args[2]))
    first = client.get("/api/outboxes").json()
    assert (first["total"], first["pages"], len(first["outboxes"])) == (5, 3, 2)
    seen.clear()
    again = client.get("/api/outboxes?page=3").json()
    assert [x["label"] for x in again["outboxes"]] == [fleet.label("e")]
    # One outbox: its counts and its relays; plus one statement finding the outboxes.
    assert 1 <= len(seen) <= 4, seen
    seen.clear()
    found = client.get(f"/api/outboxes?q={fleet.run}_D").json()["outboxes"]
    assert [x["label"] for x in found] == [fleet.label("d")]  # any case
    page = client.get("/?page=2").text
    assert 'id="page-previous"' in page and 'id="page-next"' in page
    fleet.add("f")
    assert client.get("/api/outboxes").json()["total"] == 6
    assert client.get("/api/outboxes?page=x").status_code == 400
