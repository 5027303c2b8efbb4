"""The log-tailing relay (``outbox relay --source wal``) on a real PostgreSQL and RabbitMQ.

The server is the module's own (``wal_level=logical``, started once, removed
afterwards); each test gets its own outbox table, publication and slot.
Covered:

* events enqueued with ``Outbox.enqueue`` reach RabbitMQ in commit order,
  rolled-back ones never; two transactions of one key committing against
  their id order are delivered in commit order;
* ``enqueue(delay=)`` waits, holding its key only;
* a replication connection cut after a publish and before its confirm, and
  ``pg_ctl restart -m fast`` / ``-m immediate``: resumed from the slot's
  confirmed position, the unconfirmed sent again, 0 lost (PostgreSQL < 17
  may resend more after a restart);
* SIGKILL of the active relay subprocess every few seconds under a
  producer (a burst just before each kill, so it lands mid-publish), a
  standby taking over: 0 lost, first deliveries in commit order per key,
  duplicates counted, takeover time measured; SIGTERM exits 0;
* a broker outage (``OUTBOX_FAULT_OUTAGE`` seconds, 60 by default): nothing
  dead, no attempt spent, the slot not confirmed past unpublished events,
  everything delivered after;
* retry holds only its key; past ``max_attempts`` or on reject the row is
  dead in the table (``status`` shows it), its key's later events held dead
  behind it, and ``outbox replay --key`` brings them back through the stream
  (a replay taken from the log before other sessions see it is waited for);
* a database error other than a lost connection reconnects, losing nothing;
* ``outbox install --source wal`` / ``outbox uninstall --source wal`` and
  the refusals: not PostgreSQL, ``wal_level=replica``, no REPLICATION
  (passwords never shown).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.cli.wal import install_wal, tailing_relay, uninstall_wal, wal_status
from outbox_core.dialects.postgresql.wal import SlotInUse, slot_facts
from outbox_core.message import Event, Outcome, State
from outbox_core.relay.tailing import TailingRelay
from outbox_core.relay.tailing.handover import HandOver
from outbox_core.relay.tailing.publisher import Publisher
from outbox_core.relay.tailing.source import LogTransaction
from tests.contract.broker_fixtures import RabbitState, require_rabbitmq
from tests.contract.test_wal_stream import private_postgres, retry
from tests.faults.private_servers import PrivatePostgres, free_port

pytestmark = pytest.mark.needs_server

#: Seconds of the broker outage (the issue's figure is 60).
OUTAGE = float(os.environ.get("OUTBOX_FAULT_OUTAGE", "60"))
#: How long a standby may take to read the slot once the active relay is dead.
TAKEOVER = 5.0
TOPIC = "contract.wal"
RELAY = ("relay", "--source", "wal")


@dataclass
class Feed:
    """One test's outbox table with its publication and slot."""

    logical_server: PrivatePostgres
    outbox: Outbox
    relays: list[TailingRelay] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def table(self) -> str:
        return self.outbox.table.name

    @property
    def slot(self) -> str:
        return f"outbox_{self.table}"

    def enqueue(self, *events: tuple[str | None, Any]) -> list[str]:
        """One transaction enqueuing ``(key, payload)`` pairs; their event ids."""
        with self.outbox.engine.begin() as conn:
            return [self.outbox.enqueue(conn, TOPIC, p, key=k) for k, p in events]

    def start(self, broker: Any, **knobs: Any) -> TailingRelay:
        """A relay running on a thread of this process (stopped at teardown)."""
        settings = self.outbox.settings.replace(**knobs)
        relay = tailing_relay(self.outbox, broker, settings, f"test-{len(self.relays)}")
        thread = threading.Thread(target=relay.run, kwargs={"install_signal_handlers": False})
        thread.start()
        self.relays.append(relay)
        self.threads.append(thread)
        return relay

    def rows(self) -> dict[str, tuple[int, int, str | None]]:
        """event_id -> (state, attempts, last_error)."""
        t = self.outbox.table
        with self.outbox.engine.connect() as conn:
            found = conn.execute(sa.select(t.c.event_id, t.c.state, t.c.attempts, t.c.last_error))
            return {str(r[0]): (r[1], r[2], r[3]) for r in found}

    def confirmed(self) -> int:
        with self.outbox.engine.connect() as conn:
            facts = slot_facts(conn, self.slot)
        assert facts is not None
        return facts.confirmed_flush_lsn or 0


F = TypeVar("F", bound=Feed)


@contextlib.contextmanager
def installed_feed(
    kind: type[F], logical_server: PrivatePostgres, prefix: str, **engine_options: Any
) -> Iterator[F]:
    """A fresh outbox table with its publication and slot; relays stopped, all dropped after."""
    outbox = Outbox(
        logical_server.url,
        table=f"{prefix}_{uuid.uuid4().hex[:10]}",
        engine_options=engine_options or None,
    )
    outbox.install()
    install_wal(outbox, outbox.settings)
    made = kind(logical_server, outbox)
    try:
        yield made
    finally:
        for relay in made.relays:
            relay.stop()
        for thread in made.threads:
            thread.join(30)
        retry(lambda: uninstall_wal(outbox, outbox.settings), SlotInUse, within=15)
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


@pytest.fixture
def feed(logical_server: PrivatePostgres) -> Iterator[Feed]:
    with installed_feed(Feed, logical_server, "wr") as made:
        yield made


def wait_for(check: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        time.sleep(0.05)


def outbox_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "outbox_core.cli", *args]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(outbox_cmd(*args), capture_output=True, text=True, timeout=120)


def payloads(queue: MemoryQueue) -> list[Any]:
    return [e.payload for e in queue.snapshot()]


# ------------------------------------------------------------------ order


@pytest.fixture
def rabbit() -> Iterator[RabbitState]:
    state = RabbitState(require_rabbitmq())
    yield state
    state.cleanup()


def test_events_reach_rabbitmq_in_commit_order_and_rolled_back_ones_never(
    feed: Feed, rabbit: RabbitState
) -> None:
    first = feed.enqueue(("a", {"n": 1}), ("b", {"n": 2}))
    with feed.outbox.engine.connect() as conn:
        feed.outbox.enqueue(conn, TOPIC, {"n": "rolled back"}, key="a")
        conn.rollback()
    relay = feed.start(rabbit.broker())
    second = feed.enqueue(("a", {"n": 3}), (None, {"n": 4}))
    wanted = first + second
    wait_for(lambda: len(rabbit.arrived()) >= 4, 20, "4 events at RabbitMQ")
    time.sleep(0.5)
    order = [p.message_id for p, _ in rabbit.messages]
    # Exactly the committed events; key a's in commit order (keys are ordered, not the
    # whole stream: a keyless event may pass a key's second event).
    assert sorted(order) == sorted(wanted)
    assert order.index(first[0]) < order.index(second[0])
    assert sorted(payload["n"] for _, _, payload in rabbit.arrived().values()) == [1, 2, 3, 4]
    # Confirmed past the last transaction, and the rows were never updated.
    assert relay.published == 4 and relay.held == 0
    assert {s for s, _, _ in feed.rows().values()} == {int(State.PENDING)}


def test_two_transactions_of_a_key_go_in_commit_order_not_id_order(feed: Feed) -> None:
    queue = MemoryQueue("wal-order")
    with feed.outbox.engine.connect() as t1, feed.outbox.engine.connect() as t2:
        early = feed.outbox.enqueue(t1, TOPIC, {"tx": 1}, key="k")  # lower id
        late = feed.outbox.enqueue(t2, TOPIC, {"tx": 2}, key="k")
        t2.commit()
        t1.commit()
    feed.start(MemoryBroker(queue))
    wait_for(lambda: len(queue.snapshot()) == 2, 15, "both events")
    delivered = queue.snapshot()
    assert [e.event_id for e in delivered] == [late, early]
    assert delivered[0].id > delivered[1].id  # against id order


def test_a_delayed_event_waits_and_holds_its_key(feed: Feed) -> None:
    queue = MemoryQueue("wal-delay")
    feed.start(MemoryBroker(queue))
    with feed.outbox.engine.begin() as conn:
        later = feed.outbox.enqueue(conn, TOPIC, {"n": 1}, key="a", delay=1.5)
        behind = feed.outbox.enqueue(conn, TOPIC, {"n": 2}, key="a")
        other = feed.outbox.enqueue(conn, TOPIC, {"n": 3}, key="b")
    committed = time.monotonic()
    wait_for(lambda: len(queue.snapshot()) == 1, 10, "the other key's event")
    assert queue.snapshot()[0].event_id == other
    wait_for(lambda: len(queue.snapshot()) == 3, 10, "the delayed event")
    assert time.monotonic() - committed >= 1.4
    assert [e.event_id for e in queue.snapshot()] == [other, later, behind]


def test_a_relay_catching_up_reports_the_backlog_age_not_zero(feed: Feed) -> None:
    """Each step reads a batch and publishes it all (nothing held between steps): the
    age of what is still unread in the slot is what status and /metrics must show."""
    with feed.outbox.engine.connect() as conn:
        for n in range(1500):
            feed.outbox.enqueue(conn, TOPIC, {"n": n}, key=f"k{n % 50}")
            conn.commit()
    time.sleep(1.5)
    queue = MemoryQueue("wal-behind")
    relay = feed.start(MemoryBroker(queue), batch_size=50)
    ages: list[float] = []
    while len(queue.snapshot()) < 1400:
        oldest = relay.oldest_unpublished
        if oldest is not None:
            ages.append((datetime.now(UTC) - oldest).total_seconds())
        time.sleep(0.005)
    assert ages and max(ages) >= 1.5, ages[:5]
    wait_for(lambda: relay.published == 1500, 20, "the backlog drained")
    wait_for(lambda: relay.oldest_unpublished is None, 5, "nothing unpublished once caught up")


# ------------------------------------------------------------------ long waits go to the table


class KeyNotHeld(HandOver):
    """Broken on purpose: hands a long wait to the table but not its key's later events."""

    @property
    def keys(self) -> set[str]:
        return set()

    @keys.setter
    def keys(self, value: set[str]) -> None:
        pass


def wal_lsn(feed: Feed) -> int:
    with feed.outbox.engine.connect() as conn:
        return int(str(conn.execute(sa.text("SELECT pg_current_wal_lsn() - '0/0'")).scalar()))


@pytest.mark.alone  # it times the slot's confirm (2.5 s)
@pytest.mark.parametrize("broken", [False, True], ids=["relay", "key-not-held"])
def test_a_long_delay_waits_in_the_table_and_the_slot_moves_on(feed: Feed, broken: bool) -> None:
    queue = MemoryQueue("wal-defer")
    relay = feed.start(MemoryBroker(queue), defer_after=1.0)
    if broken:
        relay.handover.__class__ = KeyNotHeld
    with feed.outbox.engine.begin() as conn:
        late = feed.outbox.enqueue(conn, TOPIC, {"n": 1}, key="a", delay=4)
    behind, other = feed.enqueue(("a", {"n": 2}), ("b", {"n": 3}))
    committed, lsn = time.monotonic(), wal_lsn(feed)
    if broken:
        # Its key's later event overtakes it: what the hand-over of the key prevents.
        wait_for(lambda: len(queue.snapshot()) == 3, 15, "every event")
        order = [e.event_id for e in queue.snapshot()]
        assert order.index(behind) < order.index(late)
        return
    wait_for(lambda: [e.event_id for e in queue.snapshot()] == [other], 10, "the other key's")
    # The slot moved past both transactions while a's events wait in the table, not memory.
    wait_for(lambda: feed.confirmed() >= lsn, 2.5, "the slot confirmed past the delayed events")
    assert time.monotonic() - committed < 3.5 and relay.held == 0
    with feed.outbox.engine.connect() as conn:
        t = feed.outbox.table
        owners = dict(
            conn.execute(sa.select(t.c.event_id, t.c.lease_owner).where(t.c.key == "a")).all()
        )
    assert owners == {late: "wal:deferred", behind: "wal:deferred"}
    shown = wal_status(feed.outbox, feed.outbox.settings)
    assert shown.deferred == 2 and shown.oldest_unpublished_age is not None
    wait_for(lambda: len(queue.snapshot()) == 3, 15, "the delayed event and the one behind it")
    assert time.monotonic() - committed >= 3.9
    assert [e.event_id for e in queue.snapshot()] == [other, late, behind]
    assert feed.rows()[late][0] == State.SENT and feed.rows()[behind][0] == State.SENT
    assert relay.deferred == 2 and relay.published == 3


def test_a_long_backoff_hands_the_key_over_and_the_next_relay_finishes_it_in_order(
    feed: Feed,
) -> None:
    queue = MemoryQueue("wal-defer-retry")
    calls: dict[str, int] = {}

    def decide(event: Event) -> Outcome | None:
        calls[event.event_id] = calls.get(event.event_id, 0) + 1
        if event.payload.get("fail") and calls[event.event_id] == 1:
            return Outcome.retry("later")
        return None

    knobs: dict[str, Any] = {"defer_after": 1.0, "backoff_base": 3.0, "backoff_cap": 3.0}
    first = feed.start(MemoryBroker(queue, decide=decide), **knobs)
    failing, behind = feed.enqueue(("x", {"fail": True}), ("x", {"n": 2}))
    wait_for(lambda: calls.get(failing) == 1, 10, "the first attempt")
    wait_for(lambda: first.held == 0, 5, "x handed to the table")
    assert feed.rows()[failing][1] == 1  # the attempt spent is in the row
    first.stop()
    feed.threads[0].join(30)
    # A new relay: x is still held (its next event goes to the table behind the others).
    second = feed.start(MemoryBroker(queue, decide=decide), **knobs)
    wait_for(lambda: "x" in second.handover.keys, 10, "the key held at connect")
    (later,) = feed.enqueue(("x", {"n": 3}))
    wait_for(lambda: len(queue.snapshot()) == 3, 20, "x's three events")
    assert [e.event_id for e in queue.snapshot()] == [failing, behind, later]
    assert calls == {failing: 2, behind: 1, later: 1}
    assert {feed.rows()[i][0] for i in (failing, behind, later)} == {State.SENT}
    wait_for(lambda: not second.handover.keys, 5, "x back to the stream")
    (last,) = feed.enqueue(("x", {"n": 4}))
    wait_for(lambda: len(queue.snapshot()) == 4, 10, "x's next event, from the stream")
    assert queue.snapshot()[-1].event_id == last and feed.rows()[last][0] == State.PENDING


def test_a_dead_key_holds_its_long_delayed_events_dead_too(feed: Feed) -> None:
    queue = MemoryQueue("wal-defer-dead")

    def decide(event: Event) -> Outcome | None:
        return Outcome.reject("no such customer") if event.payload.get("bad") else None

    relay = feed.start(MemoryBroker(queue, decide=decide), defer_after=1.0)
    (bad,) = feed.enqueue(("d", {"bad": True}))
    wait_for(lambda: feed.rows()[bad][0] == State.DEAD, 10, "the rejected event dead")
    with feed.outbox.engine.begin() as conn:
        late = feed.outbox.enqueue(conn, TOPIC, {"n": 2}, key="d", delay=1.5)
    (behind,) = feed.enqueue(("d", {"n": 3}))
    # Not handed to the table past the dead event: held dead behind it.
    wait_for(lambda: feed.rows()[behind][0] == State.DEAD, 10, "the key's later events dead")
    assert feed.rows()[late][0] == State.DEAD
    time.sleep(2)
    assert queue.snapshot() == [] and relay.deferred == 0


def test_hand_over_order_follows_the_previous_relays_even_when_its_clock_was_ahead(
    feed: Feed,
) -> None:
    queue = MemoryQueue("wal-defer-skew")
    first = feed.start(MemoryBroker(queue), defer_after=1.0)
    with feed.outbox.engine.begin() as conn:
        early = feed.outbox.enqueue(conn, TOPIC, {"n": 1}, key="s", delay=3)
    wait_for(lambda: "s" in first.handover.keys and first.held == 0, 10, "s handed over")
    first.stop()
    feed.threads[0].join(30)
    # The first relay's host clock ran 30 s ahead of the next one's.
    t = feed.outbox.table
    with feed.outbox.engine.begin() as conn:
        handed = conn.execute(sa.select(t.c.lease_until).where(t.c.event_id == early)).scalar()
        assert handed is not None
        ahead = handed + timedelta(seconds=30)
        conn.execute(sa.update(t).where(t.c.event_id == early).values(lease_until=ahead))
    second = feed.start(MemoryBroker(queue), defer_after=1.0)
    wait_for(lambda: "s" in second.handover.keys, 10, "the key held at connect")
    (later,) = feed.enqueue(("s", {"n": 2}))
    wait_for(lambda: len(queue.snapshot()) == 2, 15, "both events of s")
    assert [e.event_id for e in queue.snapshot()] == [early, later]


# ------------------------------------------------------------------ failures


def test_retry_holds_only_its_key_and_past_max_attempts_it_is_dead(feed: Feed) -> None:
    queue = MemoryQueue("wal-retry")
    calls: dict[str, int] = {}

    def decide(event: Event) -> Outcome | None:
        calls[event.event_id] = calls.get(event.event_id, 0) + 1
        kind = event.payload.get("fail")
        if kind == "twice" and calls[event.event_id] <= 2:
            return Outcome.retry("not yet")
        if kind == "always":
            return Outcome.retry("never")
        return None

    flaky, after = feed.enqueue(("a", {"fail": "twice"}), ("a", {"n": 2}))
    others = feed.enqueue(*[("b", {"n": i}) for i in range(3)])
    (hopeless,) = feed.enqueue(("c", {"fail": "always"}))
    relay = feed.start(
        MemoryBroker(queue, decide=decide), backoff_base=0.3, backoff_cap=0.6, max_attempts=3
    )
    wait_for(lambda: len(queue.snapshot()) == 5, 20, "a's and b's events")
    order = [e.event_id for e in queue.snapshot()]
    # b went on while a waited; a's second event only after its first.
    assert order.index(others[2]) < order.index(flaky) < order.index(after)
    assert calls[flaky] == 3 and calls[after] == 1
    wait_for(lambda: feed.rows()[hopeless][0] == State.DEAD, 10, "c dead")
    _, attempts, error = feed.rows()[hopeless]
    assert attempts == 3 and error == "never" and calls[hopeless] == 3
    assert relay.dead == 1


def test_a_database_error_of_another_kind_reconnects_and_loses_nothing(
    feed: Feed, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A server coming back answers with more than OperationalError (PyMySQL's
    # "Packet sequence number wrong" is an InternalError): the relay reconnects,
    # as for a lost connection, and says so; it does not end.
    queue = MemoryQueue("wal-odd-error")
    loaded = Publisher.load_dead_keys
    failures = [sa.exc.InternalError("SELECT", {}, Exception("Packet sequence number wrong"))]

    def load_dead_keys(self: Publisher) -> None:
        if failures:
            raise failures.pop()
        loaded(self)

    monkeypatch.setattr(Publisher, "load_dead_keys", load_dead_keys)
    made = feed.enqueue(("a", {"n": 1}), ("b", {"n": 2}))
    feed.start(MemoryBroker(queue))
    wait_for(lambda: len(queue.snapshot()) == 2, 20, "the events after the reconnect")
    assert sorted(e.event_id for e in queue.snapshot()) == sorted(made)
    assert "database error (InternalError: " in caplog.text


def test_reject_marks_the_row_dead_and_replay_brings_it_back_through_the_stream(
    feed: Feed,
) -> None:
    queue = MemoryQueue("wal-reject")
    poisoned = threading.Event()
    poisoned.set()

    def decide(event: Event) -> Outcome | None:
        if poisoned.is_set() and event.payload.get("poison"):
            return Outcome.reject("poison")
        return None

    feed.start(MemoryBroker(queue, decide=decide))
    bad, held = feed.enqueue(("a", {"poison": True}), ("a", {"n": 2}))
    (other,) = feed.enqueue(("b", {"n": 3}))
    wait_for(lambda: feed.rows()[held][0] == State.DEAD, 15, "the key held dead")
    (later,) = feed.enqueue(("a", {"n": 4}))
    wait_for(lambda: feed.rows()[later][0] == State.DEAD, 15, "a later event of the key")
    rows = feed.rows()
    assert rows[bad] == (int(State.DEAD), 1, "poison")
    assert "earlier event of key 'a' is dead" in (rows[held][2] or "")
    assert [e.event_id for e in queue.snapshot()] == [other]
    status = feed.outbox.status()
    assert [(d.topic, d.count) for d in status.dead] == [(TOPIC, 3)]
    poisoned.clear()
    result = run("replay", "--db", feed.logical_server.url, "--table", feed.table, "--key", "a")
    assert result.returncode == 0 and "replayed 3 dead events" in result.stdout, result.stderr
    wait_for(lambda: len(queue.snapshot()) == 4, 15, "the replayed events")
    assert [e.event_id for e in queue.snapshot()] == [other, bad, held, later]
    (after,) = feed.enqueue(("a", {"n": 5}))  # the key flows again
    wait_for(lambda: len(queue.snapshot()) == 5, 15, "the next event of the key")
    assert queue.snapshot()[-1].event_id == after


def test_a_replay_the_log_shows_before_other_sessions_see_it_is_read_once_they_do(
    feed: Feed,
) -> None:
    # MySQL sends the binlog before InnoDB commits, PostgreSQL writes the commit
    # record before the transaction ends: the relay may take in a replay whose
    # rows other sessions still see dead. It must wait for them, not drop them.
    relay = tailing_relay(
        feed.outbox, MemoryBroker(MemoryQueue("wal-early")), feed.outbox.settings, "early"
    )
    made = feed.enqueue(("a", {"n": 1}), ("a", {"n": 2}))
    t = feed.outbox.table
    with feed.outbox.engine.begin() as conn:
        conn.execute(t.update().where(t.c.event_id.in_(made)).values(state=int(State.DEAD)))
        ids = list(
            conn.execute(sa.select(t.c.id).where(t.c.event_id.in_(made)).order_by(t.c.id)).scalars()
        )
    replay = feed.outbox.engine.connect()
    try:
        replay.execute(t.update().where(t.c.id.in_(ids)).values(state=int(State.PENDING)))
        later = threading.Timer(1.0, replay.commit)  # the replay becomes visible a second on
        later.start()
        started = time.monotonic()
        relay.publisher.intake(
            LogTransaction(end=1, commit=1, committed_at=datetime.now(UTC), events=(), replayed=ids)
        )
        waited = time.monotonic() - started
        later.join()
    finally:
        replay.close()
    assert [i.event.event_id for i in relay.publisher.lanes.lane("a")] == made
    assert waited >= 0.5  # it waited for the replay's commit


def test_skip_dead_lets_the_key_move_on(feed: Feed) -> None:
    queue = MemoryQueue("wal-skip")

    def decide(event: Event) -> Outcome | None:
        return Outcome.reject("poison") if event.payload.get("poison") else None

    feed.start(MemoryBroker(queue, decide=decide), block_on_dead=False)
    bad, good = feed.enqueue(("a", {"poison": True}), ("a", {"n": 2}))
    wait_for(lambda: len(queue.snapshot()) == 1, 15, "the next event of the key")
    assert queue.snapshot()[0].event_id == good
    assert feed.rows()[bad][0] == State.DEAD and feed.rows()[good][0] == State.PENDING


class FlakyBroker(MemoryBroker):
    """A memory broker that is down (unavailable, probes fail) while ``down`` is set."""

    def __init__(self, queue: MemoryQueue) -> None:
        super().__init__(queue, decide=self._decide)
        self.down = threading.Event()
        self.refused = 0
        self.probes = 0

    def _decide(self, event: Event) -> Outcome | None:
        if self.down.is_set():
            self.refused += 1
            return Outcome.unavailable("broker down")
        return None

    def probe(self) -> str | None:
        self.probes += 1
        return "broker down" if self.down.is_set() else None


def first_commit(feed: Feed, ids: list[str], keyed: dict[str, list[str]]) -> int:
    """Enqueue one event (key ``k0``); where its transaction's commit record starts in the
    WAL, read back through a temporary ``pgoutput`` slot of the test's own (its BEGIN
    message carries that position, on every version, with no extension)."""
    slot = f"t_{uuid.uuid4().hex[:10]}"
    with feed.outbox.engine.connect() as watcher:
        publication = watcher.execute(
            sa.text("SELECT pubname FROM pg_publication_tables WHERE tablename = :t"),
            {"t": feed.table},
        ).scalar_one()
        watcher.execute(
            sa.text("SELECT pg_create_logical_replication_slot(:s, 'pgoutput', true)"),
            {"s": slot},
        )
        watcher.commit()
        with feed.outbox.engine.begin() as conn:
            xid = int(str(conn.execute(sa.text("SELECT txid_current()")).scalar()))
            made = feed.outbox.enqueue(conn, TOPIC, {"n": 0.5}, key="k0")
        begins = watcher.execute(
            sa.text(
                "SELECT data FROM pg_logical_slot_peek_binary_changes(:s, NULL, NULL, "
                "'proto_version', '1', 'publication_names', :p) WHERE xid = :x"
            ),
            {"s": slot, "p": publication, "x": xid % 2**32},
        ).scalars()
        begin = next(bytes(data) for data in begins if bytes(data)[:1] == b"B")
    ids.append(made)
    keyed.setdefault("k0", []).append(made)
    return int.from_bytes(begin[1:9], "big")  # the BEGIN message's final_lsn


def test_a_broker_outage_spends_no_attempt_holds_what_it_reads_and_resumes(feed: Feed) -> None:
    queue = MemoryQueue("wal-outage")
    broker = FlakyBroker(queue)
    relay = feed.start(broker, max_attempts=1)  # one spent attempt would make it dead
    feed.enqueue(("k", {"n": 0}))
    wait_for(lambda: len(queue.snapshot()) == 1, 15, "the first event")
    wait_for(lambda: relay.held == 0, 5, "nothing in flight")
    broker.down.set()
    with feed.outbox.engine.connect() as conn:
        before = int(str(conn.execute(sa.text("SELECT pg_current_wal_lsn() - '0/0'")).scalar()))
    ids: list[str] = []
    keyed: dict[str, list[str]] = {}
    started = time.monotonic()
    held_from = first_commit(feed, ids, keyed)
    n = 1
    while time.monotonic() - started < OUTAGE:
        made = feed.enqueue((f"k{n % 3}", {"n": n}), (None, {"n": n + 1000}))
        keyed.setdefault(f"k{n % 3}", []).append(made[0])
        ids += made
        n += 1
        time.sleep(0.2)
    # The slot never passed what the broker did not take: a transaction is sent again
    # while its commit record starts at or past the confirmed position. (The relay may
    # confirm its own progress write that landed between ``before`` and that commit.)
    assert feed.confirmed() <= held_from
    assert relay.dead == 0 and broker.refused <= 2 * relay.batch_size
    # Read ahead (below the backlog) and held: the oldest is as old as the outage.
    wait_for(lambda: relay.held == len(ids), 5, "the outage's events held")
    oldest = relay.oldest_held()
    assert oldest is not None
    assert (datetime.now(UTC) - oldest).total_seconds() >= OUTAGE - 1
    assert broker.probes >= 2
    broker.down.clear()
    wait_for(lambda: len(queue.snapshot()) == 1 + len(ids), 30, "everything after the outage")
    after = queue.snapshot()[1:]
    assert sorted(e.event_id for e in after) == sorted(ids)
    for key, wanted in keyed.items():
        assert [e.event_id for e in after if e.key == key] == wanted
    assert not [r for r in feed.rows().values() if r[0] == State.DEAD]
    wait_for(lambda: feed.confirmed() > before, 10, "the slot confirmed after the outage")


# ------------------------------------------------------------------ lost connections


def drop_reader(feed: Feed) -> None:
    """End the slot's walsender from the server side (as a restart or a network cut does)."""
    with feed.outbox.engine.connect() as conn:
        conn.execute(
            sa.text(
                # Waits (up to 5 s) until it is gone: no confirm slips in after the cut.
                "SELECT pg_terminate_backend(active_pid, 5000) FROM pg_replication_slots "
                "WHERE slot_name = :slot AND active_pid IS NOT NULL"
            ),
            {"slot": feed.slot},
        )


class CuttingBroker(MemoryBroker):
    """Delivers, then cuts the relay's replication connection once, before it confirms."""

    def __init__(self, queue: MemoryQueue, feed: Feed) -> None:
        super().__init__(queue)
        self.feed = feed
        self.cut = threading.Event()

    def publish(self, events: Any) -> Any:
        outcomes = super().publish(events)
        if not self.cut.is_set() and any(e.payload.get("cut") for e in events):
            self.cut.set()
            drop_reader(self.feed)
        return outcomes


def test_a_lost_connection_resumes_at_the_confirmed_position_without_loss(feed: Feed) -> None:
    queue = MemoryQueue("wal-cut")
    relay = feed.start(CuttingBroker(queue, feed))
    ids = feed.enqueue(("a", {"n": 1}))
    wait_for(lambda: len(queue.snapshot()) == 1, 15, "the first event")
    ids += feed.enqueue(("a", {"n": 2, "cut": True}), ("b", {"n": 3}))
    ids += feed.enqueue(("a", {"n": 4}))
    wanted = set(ids)
    wait_for(lambda: wanted <= {e.event_id for e in queue.snapshot()}, 20, "every event")
    delivered = [e.event_id for e in queue.snapshot()]
    # The broker took it as the connection went: the relay resumes from its own
    # confirmed position (same server, same timeline), so it is not lost, and at
    # most sent twice.
    assert 1 <= delivered.count(ids[1]) <= 2 and delivered.count(ids[0]) >= 1
    first_a = [i for i in dict.fromkeys(delivered) if i in (ids[0], ids[1], ids[3])]
    assert first_a == [ids[0], ids[1], ids[3]]
    wait_for(lambda: relay.held == 0 and relay.reader is not None, 10, "caught up")


def test_a_postgresql_restart_under_load_loses_nothing(feed: Feed) -> None:
    queue = MemoryQueue("wal-restart")
    feed.start(MemoryBroker(queue))
    ids: list[str] = []
    for mode in ("fast", "immediate"):
        ids += feed.enqueue(*[(f"k{i % 3}", {"i": i}) for i in range(20)])
        feed.logical_server.restart(mode)
        ids += feed.enqueue(*[(f"k{i % 3}", {"i": i, "after": mode}) for i in range(20)])
    wanted = set(ids)
    wait_for(lambda: wanted <= {e.event_id for e in queue.snapshot()}, 30, "every event")
    delivered = [e.event_id for e in queue.snapshot()]
    print(f"\nwal relay restarts: {len(wanted)} events, {len(delivered) - len(wanted)} duplicates")
    for key in ("k0", "k1", "k2"):
        mine = [i for i in ids if i in {e.event_id for e in queue.snapshot() if e.key == key}]
        firsts = [i for i in dict.fromkeys(delivered) if i in mine]
        assert firsts == mine


# ------------------------------------------------------------------ kills and standby


def active_reader(feed: Feed) -> str | None:
    """The application_name (relay name) of the slot's reader, None when nobody reads."""
    with feed.outbox.engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT a.application_name FROM pg_replication_slots s "
                "JOIN pg_stat_replication a ON a.pid = s.active_pid WHERE s.slot_name = :slot"
            ),
            {"slot": feed.slot},
        ).scalar()


@pytest.mark.alone  # it times the standby's takeovers
def test_sigkilled_relays_with_a_standby_lose_nothing_and_keep_commit_order(
    feed: Feed, rabbit: RabbitState, tmp_path: Path
) -> None:
    url = require_rabbitmq()
    procs: dict[str, subprocess.Popen[str]] = {}
    logs: dict[str, Any] = {}

    def spawn() -> None:
        name = f"relay{len(procs)}"
        logs[name] = (tmp_path / f"{name}.log").open("w+")
        args = ["--db", feed.logical_server.url, "--table", feed.table, "--broker", url]
        args += ["--broker-option", f"exchange={rabbit.exchange}", "--name", name]
        # Delays of a second go through the table (hand-overs under the kills too).
        env = dict(os.environ, OUTBOX_DEFER_AFTER="0.5")
        # Every other one selects the mode by environment, as a deployment may.
        by_env = bool(len(procs) % 2)
        if by_env:
            env["OUTBOX_SOURCE"] = "wal"
        command = outbox_cmd("relay", *args) if by_env else outbox_cmd(*RELAY, *args)
        procs[name] = subprocess.Popen(
            command, stdout=logs[name], stderr=subprocess.STDOUT, text=True, env=env
        )

    committed: list[tuple[str, int, str]] = []  # (key, n, event_id) in commit order
    burst_committed: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def produce() -> None:
        rng = random.Random(25)
        counts: dict[str, int] = {}
        while not stop.is_set():
            batch = []
            for _ in range(rng.randint(1, 3)):
                key = f"k{rng.randrange(6)}"
                counts[key] = counts.get(key, 0) + 1
                batch.append((key, counts[key]))
            # One transaction in ten delays its first event past defer_after.
            delay = 1.0 if rng.random() < 0.1 else None
            with feed.outbox.engine.begin() as conn:
                ids = [
                    feed.outbox.enqueue(
                        conn, TOPIC, {"key": k, "n": n}, key=k, delay=delay if j == 0 else None
                    )
                    for j, (k, n) in enumerate(batch)
                ]
            committed.extend((k, n, i) for (k, n), i in zip(batch, ids, strict=True))
            time.sleep(0.01)

    spawn()
    spawn()
    producer = threading.Thread(target=produce)
    producer.start()
    takeovers: list[float] = []
    try:
        wait_for(lambda: active_reader(feed) is not None, 20, "a relay reading the slot")
        for round_ in range(4):
            time.sleep(2.5)
            victim = active_reader(feed)
            assert victim is not None
            # A burst of its own keys just before the kill: the relay is mid-publish.
            burst = [(f"burst{round_}-{i % 5}", i) for i in range(300)]
            ids = feed.enqueue(*[(k, {"key": k, "n": n}) for k, n in burst])
            burst_committed.extend((k, n, i) for (k, n), i in zip(burst, ids, strict=True))
            time.sleep(0.03 * (round_ + 1))
            procs[victim].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            procs[victim].wait(10)
            spawn()  # the next standby
            wait_for(
                lambda v=victim: active_reader(feed) not in (None, v),  # type: ignore[misc]
                TAKEOVER + 5,
                "a standby taking over",
            )
            takeovers.append(time.monotonic() - killed)
    finally:
        stop.set()
        producer.join(30)
    committed += burst_committed  # keys of their own: per-key commit order holds
    try:
        wanted = {i for _, _, i in committed}
        wait_for(lambda: wanted <= set(rabbit.arrived()), 60, "every committed event")
        time.sleep(1)
        rabbit.arrived()
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0, name
    order = [p.message_id for p, _ in rabbit.messages]
    first: dict[str, int] = {}
    for index, event_id in enumerate(order):
        first.setdefault(event_id, index)
    by_key: dict[str, list[int]] = {}
    for key, n, _ in sorted(committed, key=lambda c: first[c[2]]):
        by_key.setdefault(key, []).append(n)
    duplicates = len(order) - len(first)
    with feed.outbox.engine.connect() as conn:
        t = feed.outbox.table
        handed = conn.execute(
            sa.select(sa.func.count()).where(t.c.state == int(State.SENT))
        ).scalar_one()
    assert handed > 0  # some events went through the table
    print(
        f"\nwal relay kills: {len(committed)} events ({handed} through the table), "
        f"{len(takeovers)} kills, "
        f"{duplicates} duplicates, takeover max {max(takeovers):.2f}s "
        f"mean {sum(takeovers) / len(takeovers):.2f}s"
    )
    assert set(first) == wanted  # 0 lost, nothing else
    assert all(ns == sorted(ns) for ns in by_key.values()), by_key
    assert max(takeovers) < TAKEOVER
    for handle in logs.values():
        handle.close()


# ------------------------------------------------------------------ install and refusals


def test_install_and_uninstall_source_wal(logical_server: PrivatePostgres) -> None:
    table = f"wi_{uuid.uuid4().hex[:8]}"
    slot = f"outbox_{table}"
    url = logical_server.url
    try:
        for word in ("created", "exists"):
            result = run("install", "--db", url, "--table", table, "--source", "wal")
            assert result.returncode == 0, result.stderr
            assert f"replication slot '{slot}' {word}" in result.stdout
        outbox = Outbox(url, table=table)
        with outbox.engine.connect() as conn:
            facts = slot_facts(conn, slot)
            published = conn.execute(
                sa.text("SELECT pubinsert, pubupdate, pubdelete FROM pg_publication "
                        "WHERE pubname = :p"), {"p": slot}
            ).one()  # fmt: skip
        assert facts is not None and facts.plugin == "pgoutput"
        assert tuple(published) == (True, True, False)
        custom = ("--slot", "other_slot", "--publication", "other_pub")
        result = run("install", "--db", url, "--table", table, "--source", "wal", *custom)
        assert "publication 'other_pub' created, replication slot 'other_slot' created" in (
            result.stdout
        ), result.stderr
        # A relay on the named slot reads it; SIGTERM: exit 0.
        relay = subprocess.Popen(
            outbox_cmd(*RELAY, "--db", url, "--table", table, "--broker", "memory://", *custom),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with outbox.engine.connect() as conn:
            wait_for(lambda: bool((f := slot_facts(conn, "other_slot")) and f.active), 20, "read")
        relay.send_signal(signal.SIGTERM)
        _, err = relay.communicate(timeout=30)
        assert relay.returncode == 0, err
        for extra in ((), custom):
            result = run("uninstall", "--db", url, "--table", table, "--source", "wal", *extra)
            assert result.returncode == 0 and "dropped" in result.stdout, result.stderr
        with outbox.engine.connect() as conn:
            assert slot_facts(conn, slot) is None and slot_facts(conn, "other_slot") is None
            assert sa.inspect(conn).has_table(table)  # the table stays
        refused = run("uninstall", "--db", url, "--table", table)
        assert refused.returncode == 2 and "--source wal" in refused.stderr
    finally:
        outbox = Outbox(url, table=table)
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


def one_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    return result.stderr


def test_source_wal_is_refused_where_it_cannot_work(
    logical_server: PrivatePostgres, tmp_path: Any
) -> None:
    sqlite = f"sqlite:///{tmp_path}/o.db"
    for name in ("install", "relay"):
        extra = ("--broker", "memory://") if name == "relay" else ()
        error = one_error(run(name, "--db", sqlite, "--source", "wal", *extra))
        assert "PostgreSQL" in error and "--source table" in error
    # A role without REPLICATION, its password never shown.
    role = f"norepl_{uuid.uuid4().hex[:6]}"
    engine = sa.create_engine(logical_server.url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD 'Secret-pw-1'"))
    try:
        url = logical_server.url.replace("postgres@", f"{role}:Secret-pw-1@")
        error = one_error(run("install", "--db", url, "--table", "nope", "--source", "wal"))
        assert "REPLICATION" in error and "Secret-pw-1" not in error
        with engine.connect() as conn:
            assert not sa.inspect(conn).has_table("nope")  # refused before the table
        error = one_error(
            run("relay", "--db", logical_server.url, "--table", "nope", "--source", "wal",
                "--broker", "memory://")
        )  # fmt: skip
        assert "not found" in error or "does not exist" in error
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP ROLE {role}"))
        engine.dispose()
    # A server at wal_level=replica.
    replica = private_postgres({"wal_level": "replica"})
    try:
        replica.start()
        url = replica.url.replace("postgres@", "postgres:Secret-pw-2@")
        for command in (
            ["install", "--db", url, "--source", "wal"],
            ["relay", "--db", url, "--source", "wal", "--broker", "memory://"],
        ):
            error = one_error(run(*command))
            assert "wal_level" in error and "logical" in error and "Secret-pw-2" not in error
    finally:
        replica.remove()


#: The ``outbox`` commands this module runs, with the flags each is run with.
RUN_HERE = {
    "install": {"--db", "--table", "--source", "--slot", "--publication"},
    # test_the_doctor_reports_the_slot_unread_then_read_and_errs_past_the_retained_limit
    "doctor": {"--db", "--table", "--source", "--slot", "--json", "--strict"},
    "relay": {
        "--db",
        "--table",
        "--source",
        "--broker",
        "--broker-option",
        "--name",
        "--slot",
        "--publication",
        "--metrics-port",
    },
    "uninstall": {"--db", "--table", "--source", "--slot", "--publication"},
    "replay": {"--db", "--table", "--key"},
    # test_status_and_metrics_show_the_slot_lag_and_the_oldest_unpublished_event
    "status": {"--db", "--table", "--source", "--json"},
}


def test_the_log_tailing_page_commands_are_the_ones_run_here() -> None:
    """Every command line of docs/log-tailing.md is run by a test above."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "log-tailing.md").read_text()
    commands = [line.split("#")[0].split() for line in text.splitlines()]
    commands = [words for words in commands if words[:1] == ["outbox"]]
    assert len(commands) >= 4, "the page shows the commands as a user runs them"
    for words in commands:
        flags = {w.split("=")[0] for w in words if w.startswith("--")}
        assert words[1] in RUN_HERE and flags <= RUN_HERE[words[1]], " ".join(words)


def test_the_doctor_reports_the_slot_unread_then_read_and_errs_past_the_retained_limit(
    feed: Feed,
) -> None:
    from outbox_core.dialects.postgresql.doctor import log_tailing
    from outbox_core.doctor.model import DoctorContext, Severity, Thresholds

    args = ("doctor", "--db", feed.logical_server.url, "--table", feed.outbox.table.name, "--json")

    def finding(*extra: str) -> tuple[int, dict[str, Any]]:
        result = run(*args, *extra)
        report = json.loads(result.stdout)
        [found] = [f for f in report["findings"] if f["check"] == "log_tailing"]
        return result.returncode, found

    # Polling (the default source) with no slot of its own name would be fine;
    # this table has one and nobody reads it.
    code, found = finding("--source", "wal")
    assert found["severity"] == "warning" and "no relay reads" in found["message"], found
    assert "outbox uninstall --source wal" in found["fix"]
    assert run(*args, "--source", "wal", "--strict").returncode == 1
    feed.start(MemoryBroker(MemoryQueue("wal-doctor")))
    wait_for(lambda: finding("--source", "wal")[1]["severity"] == "ok", 30, "slot read")
    code, found = finding("--source", "wal")
    assert found["details"]["active"] is True and "is read" in found["message"]
    # Past the error threshold: an error, whatever else is right.
    with feed.outbox.engine.connect() as conn:
        ctx = DoctorContext(feed.outbox, conn, Thresholds(slot_retained_error=1))
        feed.outbox.settings = feed.outbox.settings.replace(source="wal")
        [error] = list(log_tailing(ctx))
    assert error.severity is Severity.ERROR and "the disk fills" in error.message
    # A table relayed by polling, with no slot: nothing to report.
    code, found = finding("--source", "table", "--slot", "outbox_no_such_slot")
    assert found["severity"] == "ok" and "relayed by polling" in found["message"]
    code, found = finding("--source", "wal", "--slot", "outbox_no_such_slot")
    assert found["severity"] == "error" and code == 1


def test_a_publication_without_updates_or_the_table_is_refused(feed: Feed) -> None:
    """Replays reach the relay as updates: a publication of inserts only would lose them.

    (The publication is named as the slot, ``outbox_<table>``.)
    """
    args = ("relay", "--db", feed.logical_server.url, "--table", feed.outbox.table.name)
    with feed.outbox.engine.begin() as conn:
        conn.execute(sa.text(f"ALTER PUBLICATION {feed.slot} SET (publish = 'insert')"))
    error = one_error(run(*args, "--source", "wal", "--broker", "memory://"))
    assert "does not publish updates" in error, error
    with feed.outbox.engine.begin() as conn:
        conn.execute(sa.text(f"ALTER PUBLICATION {feed.slot} SET (publish = 'insert, update')"))
        conn.execute(sa.text(f"ALTER PUBLICATION {feed.slot} DROP TABLE {feed.outbox.table.name}"))
    error = one_error(run(*args, "--source", "wal", "--broker", "memory://"))
    assert f"does not publish table {feed.outbox.table.name!r}" in error, error


# ------------------------------------------------------------------ status and metrics


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split(" ")[1])
    return None


def tailing_status(feed: Feed, source: str) -> dict[str, Any]:
    """``outbox status --source <source> --json``: its log-tailing part."""
    url, table = feed.logical_server.url, feed.table
    result = run("status", "--db", url, "--table", table, "--source", source, "--json")
    assert result.returncode == 0, result.stderr
    tailing: dict[str, Any] = json.loads(result.stdout)["log_tailing"]
    return tailing


@dataclass
class Watched:
    """A relay process with ``--metrics-port`` holding one delayed event in memory, and
    what ``status`` showed once the event was two seconds old."""

    port: int
    seen: dict[str, Any]
    #: Filled once the relay stopped (SIGTERM): ``status`` with nobody reading.
    gone: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def watched_relay(feed: Feed, source: str, name: str) -> Iterator[Watched]:
    """``outbox relay --source <source> --metrics-port`` on ``feed`` (memory broker), an
    event delayed 600 s held in memory and one published; stopped after, exit code 0,
    and ``status`` read again after one more event."""
    url, table = feed.logical_server.url, feed.table
    port = free_port()
    relay = subprocess.Popen(
        outbox_cmd("relay", "--source", source, "--db", url, "--table", table,
                   "--broker", "memory://", "--name", name, "--metrics-port", str(port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # The delayed event stays in memory (not handed to the table) for this test.
        env={**os.environ, "OUTBOX_DEFER_AFTER": "1h"},
    )  # fmt: skip
    try:
        # An event held in memory by its delay: the oldest unpublished one.
        with feed.outbox.engine.begin() as conn:
            feed.outbox.enqueue(conn, TOPIC, {"n": 1}, key="late", delay=600)
        feed.enqueue(("now", {"n": 2}))
        wait_for(
            lambda: tailing_status(feed, source)["held"] == 1, 30,
            "the relay reports the delayed event held",
        )  # fmt: skip
        time.sleep(2)  # the held event ages: its age is what is measured
        watched = Watched(port, tailing_status(feed, source))
        seen = watched.seen
        assert seen["active"] and seen["relay"] == name and not seen["estimated"]
        assert seen["exists"] and seen["reader_pid"]
        assert 2 <= seen["oldest_unpublished_age"] < 60
        yield watched
        # /metrics: the relay's gauges, no pending gauges (rows stay pending).
        code, metrics = scrape(port)
        assert code == 200
        assert gauge(metrics, "outbox_wal_held_events") == 1
        assert (gauge(metrics, "outbox_wal_oldest_unpublished_seconds") or 0) >= 2
        assert (gauge(metrics, "outbox_wal_retained_bytes") or 0) > 0
        assert gauge(metrics, f'outbox_events_published_total{{topic="{TOPIC}"}}') == 1
        assert gauge(metrics, "outbox_pending_events") is None
        assert gauge(metrics, "outbox_dead_events") == 0
        code, health = scrape(port, "/healthz")
        assert code == 200 and json.loads(health)["status"] == "ok", health
    finally:
        relay.send_signal(signal.SIGTERM)
        _, err = relay.communicate(timeout=30)
    assert relay.returncode == 0, err
    # Nobody reads: the age is estimated from the last report, and keeps growing.
    feed.enqueue(("after", {"n": 3}))
    gone = watched.gone
    gone.update(tailing_status(feed, source))
    assert not gone["active"] and gone["estimated"] and gone["reader_pid"] is None
    assert gone["oldest_unpublished_age"] >= seen["oldest_unpublished_age"]


def test_status_and_metrics_show_the_slot_lag_and_the_oldest_unpublished_event(
    feed: Feed,
) -> None:
    url, table = feed.logical_server.url, feed.table
    with watched_relay(feed, "wal", "wal-watched") as watched:
        seen = watched.seen
        assert seen["confirmed_lsn"]
        assert seen["lag_bytes"] > 0  # the delayed event's transaction holds the slot back
        text = run("status", "--db", url, "--table", table, "--source", "wal").stdout
        assert "read by pid" in text and "held by relay wal-watched" in text
        _, metrics = scrape(watched.port)
        assert (gauge(metrics, "outbox_wal_lag_bytes") or 0) > 0
    assert watched.gone["lag_bytes"] > seen["lag_bytes"]
    text = run("status", "--db", url, "--table", table, "--source", "wal").stdout
    assert "NOT READ" in text and "estimated" in text
