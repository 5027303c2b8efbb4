"""Every running relay has a row in the presence table, whatever its mode (issue #37).

On each database: a running relay (unordered, by heads, by key partitions)
is listed by ``Outbox.fleet()`` within a few seconds with its mode, host,
pid and counts; its row goes when it stops cleanly; a SIGKILLed relay's row
ages and another relay removes it past the age limit; the rows are written
on a connection of their own, never the claims'; a table from before the
presence table relays as before, saying once that ``outbox install`` adds it,
and a presence table dropped under a running relay costs it one warning.
Log tailing (``--source wal``) on PostgreSQL is listed as ``wal``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.cli.render import render_status
from outbox_core.dialects.base.presence import PresenceRow
from outbox_core.message import Event, Outcome
from outbox_core.relay import Relay
from outbox_core.relay.presence import PublishCounts
from outbox_core.relay.schedule import Every
from tests.faults.private_servers import PrivatePostgres

pytestmark = pytest.mark.needs_server

#: Heartbeat of the relays under test, in seconds: rows within a second or two.
BEAT = 0.5
#: How long a row may take to show what a relay did.
WITHIN = 15.0


def wait_for(check: Callable[[], Any], what: str, within: float = WITHIN) -> Any:
    """``check()``'s first true value, polled until ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        time.sleep(0.05)


class Running:
    """Relays running on threads of this process, stopped at teardown."""

    def __init__(self) -> None:
        self.threads: dict[int, tuple[Relay, threading.Thread]] = {}

    def start(self, relay: Relay) -> Relay:
        thread = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
        thread.start()
        self.threads[id(relay)] = (relay, thread)
        return relay

    def stop(self, relay: Relay) -> None:
        _, thread = self.threads.pop(id(relay))
        relay.stop()
        thread.join(30)
        assert not thread.is_alive()

    def stop_all(self) -> None:
        for relay, _ in list(self.threads.values()):
            self.stop(relay)


@pytest.fixture
def running() -> Iterator[Running]:
    made = Running()
    yield made
    made.stop_all()


def enqueue(outbox: Outbox, n: int) -> None:
    with outbox.engine.begin() as conn:
        events = [{"topic": "presence.t", "payload": i, "key": f"k{i % 7}"} for i in range(n)]
        outbox.enqueue_many(conn, events)


def row_of(outbox: Outbox, relay_id: str) -> PresenceRow | None:
    return next((r for r in outbox.fleet() if r.relay_id == relay_id), None)


def rejecting(every: int) -> Callable[[Event], Outcome | None]:
    """A memory broker's decider: each ``every``-th payload rejected (made dead)."""

    def decide(event: Event) -> Outcome | None:
        return Outcome.reject("no") if event.payload % every == 0 else None

    return decide


@pytest.mark.parametrize("ordering", ["none", "heads", "partitions"])
def test_a_running_relay_is_listed_with_its_mode_host_and_counts_until_it_stops(
    outbox: Outbox, running: Running, ordering: str
) -> None:
    events, every = 120, 10
    dead = len(range(0, events, every))
    enqueue(outbox, events)
    queue = MemoryQueue(f"presence-{outbox.table.name}")
    broker = MemoryBroker(queue, decide=rejecting(every))
    # A dead event does not hold its key: every event is published or dead.
    relay = running.start(
        outbox.relay(broker, ordering=ordering, heartbeat=BEAT, block_on_dead=False)
    )
    row = wait_for(
        lambda: (r := row_of(outbox, relay.relay_id)) and r.published + r.dead == events and r,
        "the relay's row counts every event",
    )
    assert len(queue.snapshot()) == events - dead
    assert (row.mode, row.host, row.pid) == (ordering, socket.gethostname(), os.getpid())
    assert (row.published, row.dead) == (events - dead, dead)
    assert row.published_last_minute == events - dead
    assert row.heartbeat_age < 5 and row.uptime >= row.heartbeat_age
    assert relay.relay_id.startswith(relay.name[:50] + ":")
    if ordering == "partitions":
        # The membership table's id: the two tables join.
        assert [m.relay_id for m in outbox.relays()] == [relay.relay_id]
    status = outbox.status()
    assert [r.relay_id for r in status.fleet] == [relay.relay_id]
    assert status.as_dict()["fleet"][0]["published"] == events - dead
    line = next(x for x in render_status(status).splitlines() if relay.relay_id in x)
    assert f"{events - dead} published" in line and ordering in line
    # The heartbeat goes on while the relay idles.
    before = row_of(outbox, relay.relay_id)
    assert before is not None
    wait_for(
        lambda: (r := row_of(outbox, relay.relay_id)) and r.uptime > before.uptime + 2 * BEAT,
        "a later heartbeat",
    )
    assert row_of(outbox, relay.relay_id).heartbeat_age < 5  # type: ignore[union-attr]
    running.stop(relay)
    assert outbox.fleet() == []  # a clean stop deletes the row


def test_each_relay_has_a_row_newest_first(outbox: Outbox, running: Running) -> None:
    queue = MemoryQueue(f"presence-two-{outbox.table.name}")
    first = running.start(outbox.relay(MemoryBroker(queue), heartbeat=BEAT, name="same"))
    wait_for(lambda: row_of(outbox, first.relay_id), "the first relay's row")
    second = running.start(outbox.relay(MemoryBroker(queue), heartbeat=BEAT, name="same"))
    wait_for(lambda: len(outbox.fleet()) == 2, "both rows")
    # One name, two relays: each its own row, the newest first.
    assert [r.relay_id for r in outbox.fleet()] == [second.relay_id, first.relay_id]
    running.stop(first)
    assert [r.relay_id for r in outbox.fleet()] == [second.relay_id]


def test_presence_is_written_on_a_connection_of_its_own(outbox: Outbox, running: Running) -> None:
    """The claims' connections never run a presence statement, and the other way round."""
    presence_table = outbox.tables.presence.name
    seen: list[tuple[int, str, bool]] = []
    lock = threading.Lock()

    def record(conn: sa.Connection, cursor: Any, statement: str, *args: Any) -> None:
        dbapi = id(conn.connection.dbapi_connection)
        with lock:
            seen.append((dbapi, threading.current_thread().name, presence_table in statement))

    sa.event.listen(outbox.engine, "before_cursor_execute", record)
    try:
        enqueue(outbox, 300)
        queue = MemoryQueue(f"presence-conn-{outbox.table.name}")
        relay = running.start(outbox.relay(MemoryBroker(queue), heartbeat=BEAT, batch_size=20))
        wait_for(
            lambda: (r := row_of(outbox, relay.relay_id)) and r.published == 300,
            "every event counted",
        )
        running.stop(relay)
    finally:
        sa.event.remove(outbox.engine, "before_cursor_execute", record)
    relay_threads = [s for s in seen if s[1] != threading.current_thread().name]
    # Presence statements run on the presence thread only ...
    assert {name for _, name, is_presence in relay_threads if is_presence} == {"outbox-presence"}
    # ... on a connection no claim or settle ever uses.
    presence = {conn for conn, name, _ in relay_threads if name == "outbox-presence"}
    others = {conn for conn, name, _ in relay_threads if name != "outbox-presence"}
    assert presence and others and not presence & others


def test_the_last_minute_is_the_last_sixty_seconds() -> None:
    now = [1000.0]
    counts = PublishCounts(clock=lambda: now[0])
    counts.add(5)
    now[0] += 30
    counts.add(7, dead=1)
    assert counts.snapshot() == (12, 1, 12)
    now[0] += 31  # the first five are 61 s old
    assert counts.snapshot() == (12, 1, 7)
    now[0] += 120
    assert counts.snapshot() == (12, 1, 0)
    counts.add(2)  # into a slot a minute old: it starts again
    assert counts.snapshot() == (14, 1, 2)


KILLED_RELAY = """
import sys
from outbox_core import Outbox
url, table = sys.argv[1:3]
relay = Outbox(url, table=table).relay("memory://killed", heartbeat=0.5, name="killed")
relay.run(install_signal_handlers=False)
"""


def test_a_killed_relays_row_ages_and_another_relay_removes_it(
    outbox: Outbox, db_url: str, running: Running
) -> None:
    killed = subprocess.Popen(
        [sys.executable, "-c", KILLED_RELAY, db_url, outbox.table.name],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        gone = wait_for(
            lambda: next((r for r in outbox.fleet() if r.pid == killed.pid), None),
            "the relay process's row",
            within=60,  # a fresh interpreter imports the toolkit first
        )
        assert gone.relay_id.startswith("killed:") and gone.mode == "none"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
    # No clean stop: the row stays, its heartbeat aging on the database's clock.
    aged = wait_for(
        lambda: (r := row_of(outbox, gone.relay_id)) and r.heartbeat_age > 4 * BEAT and r,
        "the killed relay's heartbeat ages",
    )
    assert aged.uptime >= aged.heartbeat_age
    # Another relay removes rows whose heartbeat is older than its limit (small here).
    relay = outbox.relay(MemoryBroker(MemoryQueue("presence-forget")), heartbeat=BEAT)
    relay.presence.forget_after = aged.heartbeat_age + 2
    relay.presence.forgetting = Every(0.2)
    running.start(relay)
    wait_for(lambda: row_of(outbox, relay.relay_id), "the live relay's row")
    assert row_of(outbox, gone.relay_id) is not None  # not yet past the limit
    wait_for(lambda: row_of(outbox, gone.relay_id) is None, "the stale row removed")
    assert [r.relay_id for r in outbox.fleet()] == [relay.relay_id]


def test_a_table_without_the_presence_table_relays_and_says_so_once(
    outbox: Outbox, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    outbox.tables.presence.drop(outbox.engine)
    enqueue(outbox, 50)
    queue = MemoryQueue(f"presence-none-{outbox.table.name}")
    relay = running.start(outbox.relay(MemoryBroker(queue), heartbeat=BEAT))
    wait_for(lambda: len(queue.snapshot()) == 50, "every event relayed")
    wait_for(lambda: relay.presence.installed is False, "the table looked for")
    running.stop(relay)  # its presence task ended at once: nothing more to say
    said = [r for r in caplog.records if "outbox install" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, said
    assert outbox.tables.presence.name in said[0].getMessage()
    assert outbox.fleet() == [] and outbox.status().fleet == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    outbox.install()  # adds it
    assert sa.inspect(outbox.engine).has_table(outbox.tables.presence.name)


def test_a_presence_table_gone_under_a_running_relay_stops_only_its_row(
    outbox: Outbox, backend: str, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")

    def said() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "stops writing its row" in r.getMessage()]

    queue = MemoryQueue(f"presence-gone-{outbox.table.name}")
    relay = running.start(outbox.relay(MemoryBroker(queue), heartbeat=BEAT))
    wait_for(lambda: row_of(outbox, relay.relay_id), "the relay's row")
    outbox.tables.presence.drop(outbox.engine)
    enqueue(outbox, 40)
    wait_for(lambda: len(queue.snapshot()) == 40, "every event relayed")
    # sqlite3 files a missing table as an OperationalError: retried with backoff there.
    if backend != "sqlite":
        wait_for(said, "the relay gives up its row")
    running.stop(relay)  # its presence task ended with that line
    if backend != "sqlite":
        assert len(said()) == 1 and said()[0].levelno == logging.WARNING
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_log_tailing_relay_is_listed_as_wal(logical_server: PrivatePostgres) -> None:
    from tests.contract.test_wal_relay import Feed, installed_feed

    with installed_feed(Feed, logical_server, "pr") as feed:
        feed.enqueue(*[(f"k{i % 3}", i) for i in range(30)])
        queue = MemoryQueue(f"presence-wal-{feed.table}")
        relay = feed.start(MemoryBroker(queue, decide=rejecting(10)), heartbeat=BEAT)
        row = wait_for(
            lambda: (r := row_of(feed.outbox, relay.relay_id)) and r.published + r.dead == 30 and r,
            "the wal relay's row counts every event",
        )
        # A dead event's key is held: its later events are dead too, never published.
        assert (row.published, row.dead) == (len(queue.snapshot()), relay.dead) == (9, 21)
        assert (row.mode, row.pid, row.published_last_minute) == ("wal", os.getpid(), 9)
        relay.stop()
        feed.threads[-1].join(30)
        assert feed.outbox.fleet() == []
