"""``/metrics`` and ``/healthz`` of a relay over many outboxes, on real PostgreSQL schemas.

* the counters carry each outbox's label (the relay's own names otherwise),
  the outboxes past ``metrics_outboxes`` counted under ``outbox="other"``;
* the backlog gauges per outbox, read with one statement per database per scrape
  (PostgreSQL schemas, MariaDB databases);
* one database of two unreachable: ``/healthz`` stays 200, names it (URL
  masked), and the other database's events are relayed; every database
  unreachable: 503.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox, Outcome
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.config import Settings
from outbox_core.fleet import FleetRelay
from outbox_core.fleet import metrics as fleet_metrics
from outbox_core.message import Event
from outbox_core.metrics import MetricsServer
from outbox_core.redaction import mask_url
from tests.conftest import reachable_url
from tests.contract.broker_fixtures import unused_port

pytestmark = pytest.mark.needs_server

TOPIC = "order.created"


class Schemas:
    """Three schemas (MariaDB: databases) named ``h2_<run>_a/b/c``, each an installed
    outbox; dropped after."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.tag = f"h2_{uuid.uuid4().hex[:6]}"
        self.names = [f"{self.tag}_{s}" for s in "abc"]
        self.engine = sa.create_engine(url)
        with self.engine.begin() as conn:
            for name in self.names:
                conn.execute(sa.schema.CreateSchema(name))
        self.outboxes = {name: Outbox(self.engine, schema=name) for name in self.names}
        for outbox in self.outboxes.values():
            outbox.install()

    @property
    def pattern(self) -> str:
        return f"{self.tag}_*"

    def enqueue(self, name: str, n: int, topic: str = TOPIC, delay: float | None = None) -> None:
        outbox = self.outboxes[name]
        with self.engine.begin() as conn:
            for i in range(n):
                outbox.enqueue(conn, topic, {"i": i}, delay=delay)

    def drop(self) -> None:
        cascade = self.engine.dialect.name == "postgresql"  # a MariaDB database drops its tables
        with self.engine.begin() as conn:
            for name in self.names:
                conn.execute(sa.schema.DropSchema(name, cascade=cascade, if_exists=True))
        self.engine.dispose()


@pytest.fixture
def schemas(pg_url: str) -> Iterator[Schemas]:
    made = Schemas(pg_url)
    try:
        yield made
    finally:
        made.drop()


@pytest.fixture(params=["postgresql", "mysql"])
def any_schemas(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Schemas]:
    """PostgreSQL schemas, or MariaDB databases (its schemas)."""
    made = Schemas(reachable_url(request.param, tmp_path))
    try:
        yield made
    finally:
        made.drop()


def reject_bad(event: Event) -> Outcome | None:
    return Outcome.reject("no route") if event.topic == "bad" else None


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def sample(text: str, name: str, labels: str) -> float | None:
    match = re.search(re.escape(f"{name}{{{labels}}}") + r" ([0-9.e+-]+)", text)
    return None if match is None else float(match.group(1))


def wait_for(check: Callable[[], Any], timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    return check()


def drain(relay: FleetRelay, timeout: float = 20) -> None:
    """``run_once`` until a probe finds no outbox with due events."""
    deadline = time.monotonic() + timeout
    while relay.run_once().claimed:
        assert time.monotonic() < deadline, "the fleet did not drain"


def test_counters_per_outbox_the_bound_and_backlog_in_one_statement(
    any_schemas: Schemas, monkeypatch: pytest.MonkeyPatch
) -> None:
    schemas = any_schemas
    a, b, c = schemas.names
    schemas.enqueue(a, 3)
    schemas.enqueue(a, 1, delay=3600)  # stays pending: the backlog gauges
    schemas.enqueue(b, 2)
    schemas.enqueue(b, 1, topic="bad")  # rejected: dead
    schemas.enqueue(c, 4)
    schemas.enqueue(c, 2, delay=3600)
    # Every scrape reads the table (no cached reading): one scrape's statements are counted.
    monkeypatch.setattr(fleet_metrics, "BACKLOG_MAX_AGE", 0.0)
    settings = Settings(database_url=schemas.url, schemas=schemas.pattern, metrics_outboxes=2)
    relay = FleetRelay(settings, MemoryBroker(MemoryQueue("h2"), decide=reject_bad))
    server = MetricsServer.for_fleet(relay, 0, host="127.0.0.1").start()
    try:
        assert relay.labels == [a, b, c]
        drain(relay)
        engine = relay.databases[0].engine
        statements: list[str] = []

        def count(*args: Any) -> None:
            statements.append(args[2])

        sa.event.listen(engine, "before_cursor_execute", count)
        try:
            status, text = get(f"http://127.0.0.1:{server.port}/metrics")
        finally:
            sa.event.remove(engine, "before_cursor_execute", count)
    finally:
        server.stop()
        relay.close()
    assert status == 200
    # Three outboxes in one database: one statement read all their gauges.
    assert len(statements) == 1, statements
    published = "outbox_events_published_total"
    assert sample(text, published, f'outbox="{a}",topic="{TOPIC}"') == 3
    assert sample(text, published, f'outbox="{b}",topic="{TOPIC}"') == 2
    # metrics_outboxes=2: the third outbox found is counted under "other".
    assert sample(text, published, f'outbox="other",topic="{TOPIC}"') == 4
    assert f'outbox="{c}"' not in text
    assert sample(text, "outbox_events_dead_total", f'outbox="{b}",topic="bad"') == 1
    assert sample(text, "outbox_publish_failures_total", f'outbox="{b}",reason="reject"') == 1
    assert sample(text, "outbox_publish_latency_seconds_count", f'outbox="{a}"') == 3
    assert sample(text, "outbox_batch_size_sum", f'outbox="{b}"') == 3
    # No series without the outbox label: a fleet's counters are all per outbox.
    assert not re.search(r"^outbox_events_published_total\{topic=", text, re.M)
    assert sample(text, "outbox_pending_events", f'outbox="{a}"') == 1
    assert sample(text, "outbox_pending_events", f'outbox="{b}"') == 0
    assert sample(text, "outbox_pending_events", 'outbox="other"') == 2
    assert sample(text, "outbox_dead_events", f'outbox="{b}"') == 1
    age = sample(text, "outbox_oldest_pending_age_seconds", f'outbox="{a}"')
    assert age is not None and 0 <= age < 120
    assert sample(text, "outbox_oldest_pending_age_seconds", f'outbox="{b}"') == 0
    database = mask_url(sa.make_url(schemas.url))
    assert sample(text, "outbox_database_up", f'database="{database}"') == 1
    # The broker's gauges stay unlabelled: one broker serves every outbox.
    assert re.search(r"^outbox_broker_up 1\.0$", text, re.M)


def test_one_database_down_of_two_is_named_and_stays_200(schemas: Schemas) -> None:
    a = schemas.names[0]
    gone = f"postgresql+psycopg://postgres:h2secret@127.0.0.1:{unused_port()}/h2_gone"
    settings = Settings(
        database_url=schemas.url,
        database_urls=(gone,),
        schemas=schemas.pattern,
        max_poll_interval=0.5,
    )
    queue = MemoryQueue("h2-down")
    relay = FleetRelay(settings, MemoryBroker(queue))
    server = MetricsServer.for_fleet(relay, 0, host="127.0.0.1").start()
    base = f"http://127.0.0.1:{server.port}"
    thread = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        schemas.enqueue(a, 2)
        # The reachable database's outboxes are relayed meanwhile (counted once settled).
        series = f'outbox="{a}",topic="{TOPIC}"'

        def relayed() -> str | None:
            text = get(base + "/metrics")[1]
            return text if sample(text, "outbox_events_published_total", series) == 2 else None

        text = wait_for(relayed)
        assert len(queue.snapshot()) == 2, text

        def named() -> tuple[int, str] | None:
            reply = get(base + "/healthz")
            return reply if "problem" in reply[1] else None

        status, body = wait_for(named)
    finally:
        relay.stop()
        thread.join(30)
        server.stop()
    assert not thread.is_alive()
    health = json.loads(body)
    assert status == 200, health
    assert health["status"] == "degraded"
    masked = mask_url(sa.make_url(gone))
    assert "h2secret" not in body
    assert f"database {masked} unreachable" in health["problem"]
    assert "the other databases' are relayed" in health["problem"]
    assert [d["up"] for d in health["databases"]] == [True, False]
    assert health["databases"][0]["outboxes"] == 3
    assert health["database"] == "1 of 2 unreachable"
    assert sample(text, "outbox_database_up", f'database="{masked}"') == 0


def test_every_database_down_is_503() -> None:
    urls = [f"postgresql+psycopg://postgres@127.0.0.1:{unused_port()}/h2_gone{i}" for i in (1, 2)]
    settings = Settings(database_url=urls[0], database_urls=(urls[1],))
    relay = FleetRelay(settings, MemoryBroker(MemoryQueue("h2-all-down")))
    server = MetricsServer.for_fleet(relay, 0, host="127.0.0.1").start()
    try:
        relay.run_once()  # the probe fails on both
        status, body = get(f"http://127.0.0.1:{server.port}/healthz")
    finally:
        server.stop()
        relay.close()
    health = json.loads(body)
    assert status == 503, health
    assert health["status"] == "unhealthy"
    assert health["database"] == "2 of 2 unreachable"
    assert "the other databases" not in health["problem"]
