"""Liveness on every database (docs/design.md, Liveness), in-process and fast.

* a broker outage spends no attempt: the batch goes back unspent, the relay
  stops claiming, probes with backoff, and resumes when the broker answers;
* a batch's lease can be renewed while the relay still holds it, and not once
  another relay took it;
* reap and cleanup skip rows another session holds instead of waiting;
* relay connections carry the server-side limits that end a frozen
  transaction.

The multi-process versions (minute-long outages, SIGSTOPped relays, a slow
broker) are in ``tests/faults``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox, Outcome, State
from outbox_core.brokers.base import Broker
from outbox_core.message import Event
from outbox_core.relay import BrokerState, RelayObserver
from tests.contract.test_dialect_contract import connection, enqueue_many, rows
from tests.support import set_lock_timeout


class SwitchBroker(Broker):
    """Up or down at the test's word; counts what it publishes and how often it was probed."""

    def __init__(self) -> None:
        self.down: str | None = None
        self.published: list[str] = []
        self.probes = 0

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        if self.down is not None:
            return [Outcome.unavailable(self.down)] * len(events)
        self.published += [e.event_id for e in events]
        return [Outcome.ok()] * len(events)

    def probe(self) -> str | None:
        self.probes += 1
        return self.down


class Changes(RelayObserver):
    def __init__(self) -> None:
        self.states: list[BrokerState] = []

    def broker_changed(self, state: BrokerState) -> None:
        self.states.append(state)


def test_broker_outage_spends_no_attempt_stops_claiming_and_resumes(outbox: Outbox) -> None:
    enqueue_many(outbox, 5)
    broker = SwitchBroker()
    relay = outbox.relay(broker, max_attempts=1, reap_interval=0, cleanup_after=0)
    changes = Changes()
    relay.observers.append(changes)
    broker.down = "connection refused"

    result = relay.run_once()
    assert (result.claimed, result.unavailable, result.released) == (5, 5, 5)
    assert (result.retried, result.dead) == (0, 0)
    assert [(r.state, r.attempts) for r in rows(outbox)] == [(State.PENDING, 0)] * 5
    assert relay.broker_state.up is False
    assert relay.broker_state.error == "connection refused"

    # While down it claims nothing; it probes once the backoff allows.
    assert relay.run_once().claimed == 0
    assert broker.probes == 0
    time.sleep(0.6)
    assert relay.run_once().claimed == 0
    assert broker.probes == 1
    assert [r.attempts for r in rows(outbox)] == [0] * 5

    broker.down = None
    time.sleep(1.1)  # the second probe comes after a doubled backoff
    result = relay.run_once()
    assert (result.claimed, result.sent) == (5, 5)
    assert broker.probes == 2
    assert relay.broker_state.up is True
    # max_attempts=1: had the outage spent an attempt, the events would be dead.
    assert [(r.state, r.attempts) for r in rows(outbox)] == [(State.SENT, 1)] * 5
    assert [s.up for s in changes.states] == [False, True]
    relay.close()


def test_partly_unavailable_batch_settles_what_the_broker_took(outbox: Outbox) -> None:
    """A connection lost mid-batch: confirmed events are sent, the rest go back unspent."""
    ids = enqueue_many(outbox, 4)

    class HalfBroker(SwitchBroker):
        def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
            return [Outcome.ok()] * 2 + [Outcome.unavailable("connection lost")] * 2

    relay = outbox.relay(HalfBroker(), reap_interval=0, cleanup_after=0)
    result = relay.run_once()
    assert (result.sent, result.unavailable, result.released) == (2, 2, 2)
    by_id = {r.event_id: (r.state, r.attempts) for r in rows(outbox)}
    assert [by_id[i] for i in ids] == [(State.SENT, 1)] * 2 + [(State.PENDING, 0)] * 2
    relay.close()


def test_a_lease_is_renewed_only_while_its_token_holds_it(outbox: Outbox) -> None:
    enqueue_many(outbox, 3)
    d = outbox.dialect
    with connection(outbox) as conn:
        events = d.claim(conn, limit=10, lease=0.2, token="a", ordered=False)
        ids = [e.id for e in events]
        time.sleep(0.3)  # expired, but nobody took them: still ours to renew
        assert d.extend(conn, ids, token="a", lease=30) == set(ids)
        assert d.reap(conn, max_attempts=10) == 0  # renewed: nothing expired
        assert d.extend(conn, ids, token="someone-else", lease=30) == set()
        # Expire and reap one; another relay re-claims it: "a" keeps only the rest.
        t = outbox.table
        with conn.begin():
            conn.execute(sa.update(t).where(t.c.id == ids[0]).values(lease_until=d.after(-5)))
        assert d.reap(conn, max_attempts=10) == 1
        [taken] = d.claim(conn, limit=10, lease=30, token="b", ordered=False)
        assert taken.id == ids[0]
        assert d.extend(conn, ids, token="a", lease=30) == set(ids[1:])


def _hold_rows(outbox: Outbox, conn: sa.Connection, ids: list[int]) -> None:
    """Lock ``ids`` in an open transaction on ``conn`` (as a frozen relay's settle would)."""
    t = outbox.table
    conn.begin()
    conn.execute(sa.update(t).where(t.c.id.in_(ids)).values(last_error="held by a test"))


@pytest.mark.needs_server
def test_reap_and_cleanup_skip_rows_another_session_holds(outbox: Outbox, backend: str) -> None:
    if not outbox.dialect.row_locks:
        pytest.skip("SQLite has no row locks: writers take turns")
    enqueue_many(outbox, 6)
    d = outbox.dialect
    t = outbox.table
    with connection(outbox) as conn, connection(outbox) as holder:
        set_lock_timeout(conn, backend, 20)  # a wait would show as a slow call, not an error
        events = d.claim(conn, limit=6, lease=30, token="a", ordered=False)
        ids = [e.id for e in events]
        with conn.begin():  # three expired leases, three sent long ago
            conn.execute(sa.update(t).where(t.c.id.in_(ids[:3])).values(lease_until=d.after(-5)))
            conn.execute(
                sa.update(t)
                .where(t.c.id.in_(ids[3:]))
                .values(state=int(State.SENT), sent_at=d.after(-3600), lease_owner=None)
            )
        _hold_rows(outbox, holder, [ids[0], ids[3]])
        started = time.monotonic()
        assert d.reap(conn, max_attempts=10) == 2
        assert d.cleanup(conn, older_than=60, batch=100) == 2
        assert time.monotonic() - started < 5, "maintenance waited on another session's locks"
        holder.rollback()
        assert d.reap(conn, max_attempts=10) == 1
        assert d.cleanup(conn, older_than=60, batch=100) == 1
    assert [r.state for r in rows(outbox)] == [State.PENDING] * 3


@pytest.mark.needs_server
def test_cleanup_passes_a_frozen_cleanups_batch(outbox: Outbox, backend: str) -> None:
    """A relay frozen inside its cleanup holds a batch of sent rows; another relay's cleanup
    deletes the next batch without waiting (MariaDB plans a long ``id IN (...)`` DELETE on a
    small table as a scan, which would wait on every held row)."""
    if not outbox.dialect.row_locks:
        pytest.skip("SQLite has no row locks: writers take turns")
    enqueue_many(outbox, 100)
    d = outbox.dialect
    t = outbox.table
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.id <= sa.select(sa.func.min(t.c.id)).scalar_subquery() + 59)
            .values(state=int(State.SENT), sent_at=d.after(-3600))
        )
    with connection(outbox) as frozen, connection(outbox) as other:
        set_lock_timeout(other, backend, 20)  # a wait shows as a slow call, not an error
        frozen.begin()
        assert d.cleanup(frozen, older_than=60, batch=30) == 30  # held, not committed
        started = time.monotonic()
        assert d.cleanup(other, older_than=60, batch=30) == 30
        assert time.monotonic() - started < 5, "cleanup waited on a frozen cleanup's rows"
        frozen.rollback()
    assert len(rows(outbox)) == 70


def _session_value(conn: sa.Connection, backend: str, name: str) -> Any:
    if backend == "postgresql":
        return conn.execute(sa.select(sa.func.current_setting(name))).scalar_one()
    return conn.execute(sa.text(f"SELECT @@SESSION.{name}")).scalar_one()


@pytest.mark.needs_server
def test_relay_connections_carry_server_side_limits(outbox: Outbox, backend: str) -> None:
    relay = outbox.relay(SwitchBroker(), lease=8)
    conn = relay.conn
    try:
        if backend == "postgresql":
            assert _session_value(conn, backend, "idle_in_transaction_session_timeout") == "8s"
            assert _session_value(conn, backend, "lock_timeout") == "2s"
        elif backend == "mysql":
            assert int(_session_value(conn, backend, "innodb_lock_wait_timeout")) == 2
            mariadb = bool(getattr(conn.dialect, "is_mariadb", False))
            idle = "idle_transaction_timeout" if mariadb else "wait_timeout"
            assert int(_session_value(conn, backend, idle)) == 8
        else:
            pytest.skip(f"{backend}: no server-side idle-in-transaction limit to check")
    finally:
        relay.close()


@pytest.mark.needs_server
def test_a_frozen_transaction_is_ended_by_the_server(outbox: Outbox, backend: str) -> None:
    """A relay connection idle inside a transaction loses it within about one lease."""
    if backend not in ("postgresql", "mysql"):
        pytest.skip(f"{backend}: no idle-in-transaction limit")
    enqueue_many(outbox, 3)
    relay = outbox.relay(SwitchBroker(), lease=1)
    conn = relay.conn
    d = outbox.dialect
    d.session.prepare(conn)
    conn.begin()
    held = d.claim(conn, limit=10, lease=30, token="frozen", ordered=False)  # not committed
    assert len(held) == 3
    time.sleep(3.5)  # the relay "freezes" for longer than its lease
    with connection(outbox) as other:
        taken = d.claim(other, limit=10, lease=30, token="b", ordered=False)
    assert sorted(e.id for e in taken) == sorted(e.id for e in held)
    with pytest.raises(sa.exc.DBAPIError):
        conn.execute(sa.select(1))
    relay.close()


def test_a_broker_that_answers_probes_but_fails_batches_is_tried_less_and_less(
    outbox: Outbox,
) -> None:
    """Half-open: a good probe lets one batch through; if it fails, the backoff keeps growing."""
    enqueue_many(outbox, 3)

    class Flaky(SwitchBroker):
        def __init__(self) -> None:
            super().__init__()
            self.tries: list[float] = []

        def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
            self.tries.append(time.monotonic())
            return [Outcome.unavailable("connection reset mid-request")] * len(events)

    broker = Flaky()
    relay = outbox.relay(broker, reap_interval=0, cleanup_after=0)
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        relay.run_once()
        time.sleep(0.02)
    gaps = [b - a for a, b in zip(broker.tries, broker.tries[1:], strict=False)]
    # 0.5 s, then about 1 s, then about 2 s: not a retry every 0.5 s.
    assert 3 <= len(broker.tries) <= 4, gaps
    assert gaps == sorted(gaps), gaps
    assert gaps[-1] > 0.75, gaps
    assert [r.attempts for r in rows(outbox)] == [0] * 3
    relay.close()


def test_a_lease_lost_after_delivery_costs_no_attempt(outbox: Outbox) -> None:
    """Relay A publishes; before it marks, its lease is reaped and B re-claims the event."""
    enqueue_many(outbox, 1)
    d = outbox.dialect
    t = outbox.table
    taken: list[Event] = []

    class Stolen(SwitchBroker):
        def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
            with connection(outbox) as other:
                with other.begin():
                    other.execute(sa.update(t).values(lease_until=d.after(-5)))
                d.reap(other, max_attempts=10)
                taken.extend(d.claim(other, limit=10, lease=30, token="b", ordered=False))
            return [Outcome.ok()] * len(events)

    relay = outbox.relay(Stolen(), reap_interval=0, cleanup_after=0)
    result = relay.run_once()
    relay.close()
    assert (result.sent, result.lease_lost) == (0, 1)
    assert [e.attempts for e in taken] == [2]  # B counted its own attempt on top of A's
    [row] = rows(outbox)
    assert (row.state, row.lease_owner, row.attempts) == (State.LEASED, "b", 1)


def test_a_confirmed_event_the_reaper_made_dead_is_marked_sent(outbox: Outbox) -> None:
    """Its last attempt's lease ran out while the broker was confirming it."""
    enqueue_many(outbox, 1)
    d = outbox.dialect
    t = outbox.table
    with connection(outbox) as conn:
        [event] = d.claim(conn, limit=1, lease=30, token="a", ordered=False)
        with conn.begin():
            conn.execute(sa.update(t).values(lease_until=d.after(-5)))
        assert d.reap(conn, max_attempts=1) == 1
        assert [r.state for r in rows(outbox)] == [State.DEAD]
        assert d.mark_sent(conn, [event.id], token="a", delete=False) == 1
        assert d.mark_sent(conn, [event.id], token="other", delete=False) == 0
    assert [r.state for r in rows(outbox)] == [State.SENT]


def _assert_ordered_run_refused(outbox: Outbox, check: Any) -> None:
    """An ordered relay whose dialect's ``check_ordered`` is ``check`` refuses in ``run()``."""
    from outbox_core.errors import UnsupportedDatabase

    relay = outbox.relay("memory://", ordered=True)
    relay.dialect.check_ordered = check  # type: ignore[method-assign]
    try:
        with pytest.raises(UnsupportedDatabase, match="READ_COMMITTED_SNAPSHOT"):
            relay.run(install_signal_handlers=False)
    finally:
        relay.close()


def test_an_ordered_relay_refuses_a_database_that_cannot_serve_ordered_claims(
    outbox: Outbox,
) -> None:
    """``Relay.run()`` itself refuses (SQL Server without RCSI), not only ``outbox relay``."""
    from outbox_core.errors import UnsupportedDatabase

    reason = "ordered relays need READ_COMMITTED_SNAPSHOT ON: run ALTER DATABASE ..."

    def refuse(conn: sa.Connection) -> None:
        raise UnsupportedDatabase(reason)

    _assert_ordered_run_refused(outbox, refuse)
    # The database not reachable when run() starts: the first connection checks.
    calls: list[str] = []

    def down_then_refuse(conn: sa.Connection) -> None:
        calls.append("check")
        if len(calls) == 1:
            raise sa.exc.OperationalError("connect", {}, Exception("connection refused"))
        raise UnsupportedDatabase(reason)

    _assert_ordered_run_refused(outbox, down_then_refuse)
    assert len(calls) >= 2
    unordered = outbox.relay("memory://")
    unordered.dialect.check_ordered = refuse  # type: ignore[method-assign]
    unordered.stop()
    unordered.run(install_signal_handlers=False)  # not asked: runs (and stops at once)
    unordered.close()


class KillingBroker(SwitchBroker):
    """Publishes, and meanwhile has the server end the relay's connection (a restart, seen
    by that one connection)."""

    def __init__(self, outbox: Outbox, backend: str) -> None:
        super().__init__()
        self.outbox = outbox
        self.backend = backend
        self.victim: int | None = None

    def publish(self, events: Sequence[Event]) -> Sequence[Outcome]:
        kill = "SELECT pg_terminate_backend(:pid)" if self.backend == "postgresql" else "KILL :pid"
        with self.outbox.engine.connect() as conn:
            conn.execute(sa.text(kill), {"pid": self.victim})
        return super().publish(events)


def _backend_pid(conn: sa.Connection, backend: str) -> int:
    query = "SELECT pg_backend_pid()" if backend == "postgresql" else "SELECT CONNECTION_ID()"
    pid = int(conn.execute(sa.text(query)).scalar_one())
    conn.rollback()  # leave the relay's connection as it was: no transaction open
    return pid


@pytest.mark.needs_server
def test_a_settle_whose_connection_died_is_retried_on_a_fresh_one(
    outbox: Outbox, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Published events are marked sent at once, not left leased until the lease expires."""
    if backend not in ("postgresql", "mysql"):
        pytest.skip("ends a server session from another one")
    enqueue_many(outbox, 5)
    broker = KillingBroker(outbox, backend)
    relay = outbox.relay(broker, lease=30, reap_interval=0, cleanup_after=0)
    changes = DatabaseChanges()
    relay.observers.append(changes)
    broker.victim = _backend_pid(relay.conn, backend)

    result = relay.run_once()  # claim, publish (the connection dies), settle

    assert (result.claimed, result.sent) == (5, 5)
    assert [r.state for r in rows(outbox)] == [State.SENT] * 5
    assert broker.published and len(broker.published) == 5
    # One session ended while the server answers is no outage: no 503, no pause in reaping.
    assert changes.states == []
    assert "reconnected (the database answers)" in caplog.text
    assert relay.database_state.up and relay.connections.may_reap()
    # The loop that met the lost session logs it without calling the database down.
    from outbox_core.errors import DatabaseError

    relay.connections.log_failure(DatabaseError("lost", unreachable=True), "presence: ", 1.0)
    assert "unavailable" not in caplog.text
    relay.close()


class DatabaseChanges(RelayObserver):
    def __init__(self) -> None:
        self.states: list[Any] = []

    def database_changed(self, state: Any) -> None:
        self.states.append(state)


def test_reaping_waits_after_the_database_returns(outbox: Outbox) -> None:
    """Leases that ran out during an outage belong to relays whose settles are landing."""
    from outbox_core.errors import DatabaseError
    from outbox_core.relay.connections import REAP_GRACE

    relay = outbox.relay(SwitchBroker(), reap_interval=0, cleanup_after=0)
    connections = relay.connections
    assert connections.may_reap()
    connections._went_down(DatabaseError("connect failed", unreachable=True))
    assert not relay.database_state.up and not connections.may_reap()
    # The first reap after the outage only probes: the database answers, the grace starts.
    assert relay.reap() == 0
    assert relay.database_state.up
    assert not connections.may_reap() and relay.reap() == 0
    time.sleep(REAP_GRACE + 0.1)
    assert connections.may_reap()
    relay.close()


def test_which_errors_are_of_the_moment_is_each_databases_knowledge(outbox: Outbox) -> None:
    """A misspelt column is no outage on any database (PyMySQL and sqlite3 file it under
    OperationalError); a lost connection, a deadlock or a busy file is."""
    from outbox_core.errors import DatabaseError

    relay = outbox.relay(SwitchBroker(), reap_interval=0, cleanup_after=0)

    def broken(conn: sa.Connection) -> None:
        with relay.dialect.transaction(conn):
            conn.execute(sa.text("SELECT no_such_column FROM " + outbox.table.name))

    with pytest.raises(DatabaseError) as caught:
        relay.connections.call("broken", broken)
    assert not caught.value.transient and not caught.value.unreachable
    assert relay.database_state.up
    relay.close()
