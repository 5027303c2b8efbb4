"""Log tailing through restarts: what the relay's progress row settled is not sent again.

The server is the module's own (``wal_level=logical``, ``tests/contract/conftest.py``'s
``logical_server``), crash-restarted here with ``pg_ctl restart -m immediate``;
the machine's shared PostgreSQL is never touched. Each test gets its own
outbox table, publication and slot. A slot's confirmed position survives a
crash only as of the server's last save of it (a checkpoint, or a move of its
restart point); the relay's progress row in ``<table>_wal`` is an ordinary,
crash-safe row written as the relay confirms. Covered:

* crash-restarts of the server under a producer while the relay runs: 0 lost,
  each crash's duplicates at most the events committed in the 2 s before it;
  the same with the relay process SIGKILLed at each crash and a new one
  started (it has only the progress row to go by), counted at RabbitMQ;
* a relay stopped, the server crashed, a new relay started: nothing the first
  one settled is sent again;
* each reconnect is logged once, with the position it resumed from;
* a ``<table>_wal`` of an earlier version (without the stream's figures'
  columns): the relay says so, still reports its position and resumes from
  it; ``install --source wal`` adds the columns;
* where a new stream starts: the progress row only within the server's WAL
  (not one restored from another cluster), the relay's own last confirm
  only on the same WAL history (system id and timeline), and a slot made
  again by ``install`` forgets the old one's row;
* ``outbox doctor --strict --source wal`` passes on a healthy set-up with
  thousands of published rows (all still pending in the table), and its
  backlog finding speaks of the stream: held events past the threshold warn;
* ``outbox status --source wal`` shows the stream (unread, in flight,
  published per second), not the table's states.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.cli.wal import install_wal, tailing_relay
from outbox_core.dialects.postgresql.wal import (
    StreamStart,
    drop_slot,
    parse_lsn,
    slot_facts,
)
from outbox_core.dialects.postgresql.wal.source import log_start
from outbox_core.errors import OutboxError
from outbox_core.message import Event, Outcome
from outbox_core.relay.tailing import TailingRelay
from tests.contract.broker_fixtures import RabbitState, require_rabbitmq
from tests.contract.test_wal_relay import Feed as RelayFeed
from tests.contract.test_wal_relay import installed_feed, wait_for
from tests.faults.private_servers import PrivatePostgres
from tests.support import outbox_cli

pytestmark = pytest.mark.needs_server

#: The duplicates a crash may cause: the events of this many seconds of traffic before it.
DUPLICATE_WINDOW = 2.0
#: Seconds of load between crashes (a slot's confirmed position is saved far less often).
BETWEEN_CRASHES = 5.0
CRASHES = 3


class Feed(RelayFeed):
    """The log-tailing tests' feed, with the positions these tests compare."""

    def stop(self, relay: TailingRelay) -> None:
        relay.stop()
        self.threads[self.relays.index(relay)].join(30)

    def event_ids(self) -> set[str]:
        """Every event id in the table: what was committed."""
        t = self.outbox.table
        with self.outbox.engine.connect() as conn:
            return {str(i) for i in conn.execute(sa.select(t.c.event_id)).scalars()}

    def progress_lsn(self) -> int:
        """The confirmed position of the slot's progress row (0: none)."""
        with self.outbox.engine.connect() as conn:
            found = conn.execute(
                sa.text(f"SELECT confirmed_lsn FROM {self.table}_wal WHERE slot = :slot"),
                {"slot": self.slot},
            ).scalar()
        return int(found or 0)

    def slot_lsn(self) -> int:
        with self.outbox.engine.connect() as conn:
            facts = slot_facts(conn, self.slot)
        assert facts is not None
        return facts.confirmed_flush_lsn or 0

    def wal_lsn(self) -> int:
        with self.outbox.engine.connect() as conn:
            return parse_lsn(
                conn.execute(sa.text("SELECT pg_current_wal_lsn()::text")).scalar_one()
            )


@pytest.fixture
def feed(logical_server: PrivatePostgres) -> Iterator[Feed]:
    # pool_pre_ping: the crashes leave the pool's connections dead.
    with installed_feed(Feed, logical_server, "wres", pool_pre_ping=True) as made:
        yield made


def delivered(queue: MemoryQueue) -> list[str]:
    return [e.event_id for e in queue.snapshot()]


def repeats(order: list[str], start: int, end: int) -> int:
    """Deliveries in ``order[start:end]`` of an event delivered earlier."""
    first: dict[str, int] = {}
    for index, event_id in enumerate(order):
        first.setdefault(event_id, index)
    return sum(1 for i in range(start, min(end, len(order))) if first[order[i]] < i)


# ------------------------------------------------------------------ crashes


class Producer:
    """A thread committing 3 events per transaction until stopped; when each commit returned."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.commits: list[tuple[float, int]] = []  # (monotonic time, events)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                self.feed.enqueue(*[(f"k{(n + j) % 7}", {"n": n + j}) for j in range(3)])
            except (sa.exc.SQLAlchemyError, OutboxError):
                time.sleep(0.05)  # the server is down: its rows are in the table or not
                continue
            self.commits.append((time.monotonic(), 3))
            n += 3
            time.sleep(0.005)

    def __enter__(self) -> Producer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def before(self, at: float) -> int:
        """Events committed in the :data:`DUPLICATE_WINDOW` seconds before ``at``."""
        return sum(n for t, n in self.commits if at - DUPLICATE_WINDOW <= t <= at)

    @property
    def rate(self) -> float:
        first, last = self.commits[0][0], self.commits[-1][0]
        return sum(n for _, n in self.commits) / max(last - first, 1e-9)


def per_crash(
    order: list[str], crashes: list[tuple[float, int]], producer: Producer
) -> list[tuple[int, int]]:
    """(duplicates after each crash, events committed in the 2 s before it)."""
    marks = [mark for _, mark in crashes] + [len(order)]
    return [
        (repeats(order, mark, marks[i + 1]), producer.before(at))
        for i, (at, mark) in enumerate(crashes)
    ]


def test_server_crashes_under_load_resend_at_most_the_last_two_seconds(feed: Feed) -> None:
    """``pg_ctl restart -m immediate`` under a producer while the relay runs."""
    queue = MemoryQueue("wal-crash")
    feed.start(MemoryBroker(queue))
    crashes: list[tuple[float, int]] = []  # (monotonic time, deliveries so far)
    with Producer(feed) as producer:
        wait_for(lambda: len(queue.snapshot()) > 100, 30, "the relay publishing")
        for _ in range(CRASHES):
            time.sleep(BETWEEN_CRASHES)
            crashes.append((time.monotonic(), len(queue.snapshot())))
            feed.logical_server.restart("immediate")
        time.sleep(1)
    wanted = feed.event_ids()
    wait_for(lambda: wanted <= set(delivered(queue)), 60, "every committed event delivered")
    time.sleep(1)  # anything else on its way
    order = delivered(queue)
    figures = per_crash(order, crashes, producer)
    print(
        f"\nwal server crashes: {len(wanted)} events at {producer.rate:.0f}/s, duplicates "
        "per crash " + ", ".join(f"{d} (bound {r})" for d, r in figures)
    )
    assert set(order) == wanted  # 0 lost, nothing else
    assert repeats(order, 0, crashes[0][1]) == 0
    for duplicates, recent in figures:
        assert duplicates <= recent, figures


@pytest.fixture
def rabbit() -> Iterator[RabbitState]:
    state = RabbitState(require_rabbitmq())
    yield state
    state.cleanup()


def test_a_relay_killed_with_each_server_crash_resends_at_most_the_last_two_seconds(
    feed: Feed, rabbit: RabbitState, tmp_path: Path
) -> None:
    """SIGKILL of the relay process and ``pg_ctl restart -m immediate``, a new relay after.

    The new relay knows nothing of the old one's confirms but the progress row.
    """
    procs: list[subprocess.Popen[str]] = []
    logs: list[Any] = []

    def spawn() -> None:
        name = f"relay{len(procs)}"
        logs.append((tmp_path / f"{name}.log").open("w+"))
        command = [
            sys.executable, "-m", "outbox_core.cli", "relay", "--source", "wal",
            "--db", feed.logical_server.url, "--table", feed.table,
            "--broker", rabbit.url, "--broker-option", f"exchange={rabbit.exchange}",
            "--name", name,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(command, stdout=logs[-1], stderr=subprocess.STDOUT, text=True)
        )

    def arrived() -> list[str]:
        rabbit.drain()
        return [p.message_id for p, _ in rabbit.messages]

    crashes: list[tuple[float, int]] = []
    spawn()
    try:
        with Producer(feed) as producer:
            wait_for(lambda: len(arrived()) > 100, 30, "the relay publishing")
            for _ in range(CRASHES):
                time.sleep(BETWEEN_CRASHES)
                crashes.append((time.monotonic(), len(arrived())))
                procs[-1].send_signal(signal.SIGKILL)
                feed.logical_server.restart("immediate")
                procs[-1].wait(10)
                spawn()
            time.sleep(1)
        wanted = feed.event_ids()
        wait_for(lambda: wanted <= set(arrived()), 60, "every committed event delivered")
        time.sleep(1)
        order = arrived()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        for handle in logs:
            handle.close()
    figures = per_crash(order, crashes, producer)
    print(
        f"\nwal relay killed with each server crash: {len(wanted)} events at "
        f"{producer.rate:.0f}/s, duplicates per crash "
        + ", ".join(f"{d} (bound {r})" for d, r in figures)
    )
    assert set(order) == wanted  # 0 lost, nothing else
    for duplicates, recent in figures:
        assert duplicates <= recent, figures


def test_a_new_relay_after_a_server_crash_resends_nothing_already_settled(feed: Feed) -> None:
    queue = MemoryQueue("wal-crash-new-relay")
    first = feed.start(MemoryBroker(queue))
    settled = feed.enqueue(*[(f"k{i % 5}", {"i": i}) for i in range(300)])
    wait_for(lambda: set(settled) <= set(delivered(queue)), 30, "the first events")
    wait_for(lambda: first.held == 0, 10, "the relay caught up")
    feed.stop(first)  # its last report: everything settled
    assert feed.progress_lsn() > feed.slot_lsn() or feed.progress_lsn() > 0
    feed.logical_server.restart("immediate")
    feed.start(MemoryBroker(queue))
    later = feed.enqueue(*[(f"k{i % 5}", {"i": i, "later": True}) for i in range(20)])
    wait_for(lambda: set(later) <= set(delivered(queue)), 30, "the later events")
    time.sleep(1)
    order = delivered(queue)
    again = len(order) - len(set(order))
    print(f"\nwal relay restarted after a server crash: {again} of {len(settled)} sent again")
    assert again == 0
    assert set(order) == set(settled) | set(later)


# ------------------------------------------------------------------ reconnects


def drop_reader(feed: Feed) -> None:
    """End the slot's walsender from the server side (as a network cut does)."""
    with feed.outbox.engine.connect() as conn:
        conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(active_pid, 5000) FROM pg_replication_slots "
                "WHERE slot_name = :slot AND active_pid IS NOT NULL"
            ),
            {"slot": feed.slot},
        )


RESUMED = re.compile(
    r"reconnected to slot '(\w+)' after [\d.]+s: resuming from ([0-9A-F]+/[0-9A-F]+)"
)


def test_each_reconnect_is_logged_once_with_its_position(
    feed: Feed, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    queue = MemoryQueue("wal-reconnect-log")
    relay = feed.start(MemoryBroker(queue))
    for round_ in range(2):
        ids = set(feed.enqueue(*[(f"k{i}", {"round": round_}) for i in range(10)]))
        wait_for(lambda ids=ids: ids <= set(delivered(queue)), 20, "the round's events")
        wait_for(lambda: relay.held == 0, 10, "caught up")
        reader = relay.reader
        assert reader is not None
        before = reader.confirmed
        drop_reader(feed)
        wait_for(
            lambda reader=reader: relay.reader not in (None, reader),  # type: ignore[misc]
            20,
            "the relay reconnected",
        )
        resumed = [m for r in caplog.records if (m := RESUMED.search(r.getMessage()))]
        assert len(resumed) == round_ + 1, [r.getMessage() for r in caplog.records]
        slot, position = resumed[-1].groups()
        assert slot == feed.slot
        # Its own confirmed position (or later: an idle confirm), not an older one.
        assert before <= parse_lsn(position) <= feed.wal_lsn()
    lost = [r for r in caplog.records if "connection lost" in r.getMessage()]
    assert len(lost) == 2, [r.getMessage() for r in lost]
    [started] = [r.getMessage() for r in caplog.records if "reading slot" in r.getMessage()]
    assert f"reading slot '{feed.slot}' from " in started and "the slot's confirmed" in started


def test_where_a_stream_starts_trusts_only_positions_of_this_servers_history(
    feed: Feed, caplog: pytest.LogCaptureFixture
) -> None:
    relay = tailing_relay(
        feed.outbox, MemoryBroker(MemoryQueue("wal-judge")), feed.outbox.settings, "judge"
    )
    slot, flushed = feed.slot_lsn(), feed.wal_lsn()
    told = StreamStart(feed.slot, system_id="7", timeline=1, flush_lsn=flushed, slot_lsn=slot)
    start = log_start(told)

    def progress(lsn: int) -> None:
        with feed.outbox.engine.connect() as conn:
            relay.source.table.progress.report(
                conn, slot=feed.slot, relay="old", confirmed_lsn=lsn, held=0, oldest_held_at=None
            )

    try:
        assert relay.choose_start(start) == slot  # no progress row yet
        progress(flushed)
        assert relay.choose_start(start) == flushed
        # From another cluster's backup: past this server's WAL, it would skip what comes.
        progress(flushed + (1 << 30))
        with caplog.at_level(logging.WARNING, logger="outbox.relay"):
            assert relay.choose_start(start) == slot
        assert "beyond the server's WAL" in caplog.text
        # Its own last confirm: on the same history only (a promoted standby's differs).
        relay.resume.settled = (start.history, flushed)
        assert relay.choose_start(start) == flushed
        assert relay.choose_start(log_start(dataclasses.replace(told, timeline=2))) == slot
        assert relay.choose_start(log_start(dataclasses.replace(told, system_id="8"))) == slot
    finally:
        relay.close()
    # A slot made again by install: the old one's position means nothing to it.
    progress(flushed)
    with feed.outbox.engine.begin() as conn:
        drop_slot(conn, feed.slot)
    install_wal(feed.outbox, feed.outbox.settings)
    assert feed.progress_lsn() == 0


def test_an_older_progress_table_still_resumes_and_install_adds_its_columns(
    feed: Feed, caplog: pytest.LogCaptureFixture
) -> None:
    """``<table>_wal`` made by an earlier version lacks the stream's figures' columns."""
    with feed.outbox.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"ALTER TABLE {feed.table}_wal DROP COLUMN read_lsn, "
                "DROP COLUMN published_last_minute"
            )
        )
    queue = MemoryQueue("wal-older-table")
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    relay = feed.start(MemoryBroker(queue))
    assert "column(s) published_last_minute, read_lsn" in caplog.text
    ids = feed.enqueue(*[(f"k{i % 3}", {"i": i}) for i in range(30)])
    wait_for(lambda: set(ids) <= set(delivered(queue)), 20, "the events")
    wait_for(lambda: relay.held == 0, 10, "caught up")
    feed.stop(relay)
    assert feed.progress_lsn() > 0  # the position is reported all the same
    assert "cannot report progress" not in caplog.text
    feed.logical_server.restart("immediate")
    feed.start(MemoryBroker(queue))
    later = feed.enqueue(("k0", {"later": True}))
    wait_for(lambda: set(later) <= set(delivered(queue)), 20, "the later event")
    order = delivered(queue)
    assert len(order) == len(set(order)) == 31
    install_wal(feed.outbox, feed.outbox.settings)
    with feed.outbox.engine.connect() as conn:
        columns = {c["name"] for c in sa.inspect(conn).get_columns(f"{feed.table}_wal")}
    assert {"read_lsn", "published_last_minute"} <= columns


# ------------------------------------------------------------------ doctor and status


def doctor(feed: Feed, *extra: str) -> tuple[int, dict[str, Any]]:
    result = outbox_cli(
        "doctor", "--db", feed.logical_server.url, "--table", feed.table,
        "--source", "wal", "--json", *extra,
    )  # fmt: skip
    return result.returncode, json.loads(result.stdout)


def finding(report: dict[str, Any], check: str) -> dict[str, Any]:
    [found] = [f for f in report["findings"] if f["check"] == check]
    return found


def test_doctor_strict_passes_on_a_healthy_log_tailing_set_up(feed: Feed) -> None:
    queue = MemoryQueue("wal-doctor-healthy")
    relay = feed.start(MemoryBroker(queue))
    ids: list[str] = []
    for chunk in range(6):
        ids += feed.enqueue(*[(f"k{i % 50}", {"c": chunk, "i": i}) for i in range(500)])
    wait_for(lambda: set(ids) <= set(delivered(queue)), 60, "3,000 events published")
    wait_for(lambda: relay.held == 0, 10, "caught up")
    time.sleep(2.5)  # every row is pending in the table, due for longer than the threshold
    code, report = doctor(feed, "--strict", "--max-backlog-age", "2s")
    assert code == 0, [f for f in report["findings"] if f["severity"] != "ok"]
    backlog = finding(report, "backlog")
    assert backlog["severity"] == "ok"
    assert "stream" in backlog["message"] and "3000 pending" not in backlog["message"]
    assert backlog["details"]["held"] == 0


def test_doctor_warns_of_events_held_past_the_threshold(feed: Feed) -> None:
    down = threading.Event()
    down.set()

    def decide(event: Event) -> Outcome | None:
        return Outcome.unavailable("broker down for the test") if down.is_set() else None

    queue = MemoryQueue("wal-doctor-held")
    relay = feed.start(MemoryBroker(queue, decide=decide))
    feed.enqueue(*[(f"k{i}", {"i": i}) for i in range(5)])
    wait_for(lambda: relay.held == 5, 20, "the relay holding the events")
    time.sleep(2.5)
    code, report = doctor(feed, "--strict", "--max-backlog-age", "2s")
    backlog = finding(report, "backlog")
    assert code == 1 and backlog["severity"] == "warning", backlog
    assert "5 held by relay test-0" in backlog["message"], backlog
    down.clear()
    wait_for(lambda: len(queue.snapshot()) == 5, 30, "published once the broker is back")


def test_status_shows_the_stream_not_the_tables_states(feed: Feed) -> None:
    queue = MemoryQueue("wal-status")
    relay = feed.start(MemoryBroker(queue))
    ids = feed.enqueue(*[(f"k{i % 10}", {"i": i}) for i in range(400)])
    wait_for(lambda: set(ids) <= set(delivered(queue)), 30, "400 events published")
    wait_for(lambda: relay.held == 0, 10, "caught up")
    time.sleep(1.5)  # a report after the last confirm
    args = ("status", "--db", feed.logical_server.url, "--table", feed.table, "--source", "wal")
    result = outbox_cli(*args, "--json")
    assert result.returncode == 0, result.stderr
    tailing = json.loads(result.stdout)["log_tailing"]
    assert tailing["published_last_minute"] == 400, tailing
    assert tailing["held"] == 0 and tailing["unread_bytes"] is not None
    assert json.loads(result.stdout)["sent_last_minute"] == 400
    text = outbox_cli(*args).stdout
    # No table of states: every row is pending there, published or not.
    assert "state     events" not in text
    assert not [line for line in text.splitlines() if line.startswith("pending")], text
    assert "table: 400 rows, 0 dead" in text, text
    assert "in flight: 0 events held by relay test-0" in text, text
    assert "unread:" in text, text
    assert re.search(r"400 published \(\d+\.\d/s\)", text), text
