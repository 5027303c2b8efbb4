"""The dashboard's named reads (``dialect.console``) on every database.

Rows are written with chosen states and times (plain INSERTs on the
database's own clock), and each read must return what was put in. Beyond
the results: ``first_id_since`` must probe the primary key about log2(ids)
times, never scan; on PostgreSQL and MariaDB the plans of the reads a
million-row table makes expensive must go through the existing indexes; and
no read may wait on the row locks a relay holds.
"""

from __future__ import annotations

import itertools
import math
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox, State
from outbox_core.dialects.base.console import utc
from outbox_core.dialects.base.values import FlowBucket, HeldKey
from tests.conftest import BACKENDS
from tests.support import set_lock_timeout

S = timedelta(seconds=1)
ALL_STATES = [State.PENDING, State.LEASED, State.SENT, State.DEAD]


def db_now(outbox: Outbox) -> datetime:
    """The database's clock, as it returns it (naive UTC except on PostgreSQL)."""
    with outbox.engine.connect() as conn:
        value: datetime = conn.execute(sa.select(outbox.dialect.now())).scalar_one()
    return value


def put(
    conn: sa.Connection,
    outbox: Outbox,
    created: datetime,
    state: State = State.PENDING,
    *,
    topic: str = "console.t",
    key: str | None = None,
    sent: datetime | None = None,
    error: str | None = None,
    partition: int | None = None,
    lease_until: datetime | None = None,
    headers: dict[str, Any] | None = None,
) -> int:
    """Insert one row as given; return its id."""
    row = {
        "event_id": str(uuid.uuid4()),
        "topic": topic,
        "key": key,
        "payload": {"topic": topic, "created": created.isoformat()},
        "headers": headers,
        "state": int(state),
        "attempts": 2 if state is State.DEAD else 0,
        "available_at": created,
        "created_at": created,
        "sent_at": sent,
        "lease_owner": "token-1" if state is State.LEASED else None,
        "lease_until": lease_until,
        "last_error": error,
        "key_partition": partition,
    }
    return int(conn.execute(sa.insert(outbox.table).values(row)).inserted_primary_key[0])


@contextmanager
def recorded(engine: sa.Engine) -> Iterator[list[tuple[str, Any]]]:
    """The statements (and parameters) sent on ``engine`` meanwhile."""
    sent: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        sent.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


# -- results ----------------------------------------------------------------------


def test_an_empty_table_reads_as_nothing(outbox: Outbox) -> None:
    console = outbox.dialect.console
    with outbox.engine.connect() as conn:
        overview = console.overview(conn)
        assert (overview.pending, overview.leased, overview.dead) == (0, 0, 0)
        assert overview.oldest_pending_created is None
        assert overview.oldest_pending_id is None and overview.newest_id is None
        assert abs(overview.now - utc(db_now(outbox))) < timedelta(minutes=1)
        assert console.first_id_since(conn, 3600) is None
        for from_id in (None, 1):
            flow = console.flow(conn, seconds=300, bucket=60, from_id=from_id)
            assert len(flow) in (5, 6) and all(b.created == b.sent == 0 for b in flow)
        assert console.events(conn, states=ALL_STATES) == []
        assert console.event(conn, 1) is None
        assert console.held_keys(conn) == []
        assert console.sent_by_partition(conn, seconds=60, from_id=1) == {}
        assert console.sent_by_partition(conn, seconds=60, from_id=None) == {}


def test_the_overview_counts_each_state_and_finds_the_lowest_pending_id(outbox: Outbox) -> None:
    now = db_now(outbox)
    with outbox.engine.begin() as conn:
        for _ in range(3):
            put(conn, outbox, now - 500 * S, State.SENT, sent=now - 400 * S)
        # The lowest pending id was created after the next one: the overview names the
        # lowest id (the relay's next), not the earliest created_at.
        first = put(conn, outbox, now - 10 * S)
        put(conn, outbox, now - 100 * S)
        put(conn, outbox, now - 5 * S, State.LEASED, lease_until=now + 30 * S)
        put(conn, outbox, now - 50 * S, State.DEAD, error="x")
        put(conn, outbox, now - 40 * S, State.DEAD, error="y")
        last = put(conn, outbox, now - 1 * S, State.SENT, sent=now)
    with outbox.engine.connect() as conn:
        overview = outbox.dialect.console.overview(conn)
    assert (overview.pending, overview.leased, overview.dead) == (2, 1, 2)
    assert overview.oldest_pending_id == first
    assert overview.oldest_pending_created == utc(now - 10 * S)
    assert overview.newest_id == last
    assert utc(now) <= overview.now < utc(now) + timedelta(minutes=1)


def test_first_id_since_searches_the_primary_key(outbox: Outbox) -> None:
    now = db_now(outbox)
    step = 10 * S
    base = now - 3000 * step
    rows = [
        {"event_id": str(uuid.uuid4()), "topic": "console.t", "payload": {"i": i},
         "state": int(State.SENT), "attempts": 1, "available_at": base + i * step,
         "created_at": base + i * step, "sent_at": base + i * step}
        for i in range(3000)
    ]  # fmt: skip
    t = outbox.table
    with outbox.engine.begin() as conn:
        conn.execute(sa.insert(t), rows)
    with outbox.engine.connect() as conn:
        listed = conn.execute(sa.select(t.c.id, t.c.created_at).order_by(t.c.id)).all()
    assert [r[1] for r in listed] == sorted(r[1] for r in listed)  # ids rise with time
    ids = {utc(created): id_ for id_, created in listed}
    console = outbox.dialect.console
    # A row every ten seconds (the newest ten seconds old); five seconds over each
    # boundary leave room for the clock to move while the test runs.
    expected = {
        10_005: ids[utc(now - 1000 * step)],
        15: ids[utc(now - step)],
        50_000: listed[0][0],
        5: None,
    }
    for seconds, want in expected.items():
        with recorded(outbox.engine) as sent, outbox.engine.connect() as conn:
            assert console.first_id_since(conn, seconds) == want, seconds
        probes = [s for s, _ in sent if t.name in s]
        # One statement for the bounds, then about log2(ids) probes of one row each.
        assert len(probes) <= math.ceil(math.log2(len(listed))) + 2, (seconds, len(probes))
        for statement in probes[1:]:
            assert re.search(r"LIMIT|TOP", statement), statement
        assert not any(re.search(r"created_at\s*[<>]", s) for s in probes), probes
        if want is None:
            assert len(probes) == 1  # the newest row is older: no search
    # Rows deleted in the middle (cleanup): the first id left after the boundary.
    with outbox.engine.begin() as conn:
        gone = [r[0] for r in listed[1500:2500]]
        conn.execute(sa.delete(t).where(t.c.id.in_(gone)))
    with outbox.engine.connect() as conn:
        assert console.first_id_since(conn, 10_005) == listed[2500][0]


def minute_of(value: datetime) -> datetime:
    return utc(value).replace(second=0, microsecond=0)


def expected_flow(
    buckets: list[FlowBucket], rows: list[tuple[int, datetime, datetime | None]], from_id: int
) -> list[tuple[int, int]]:
    """(created, sent) per bucket start, counted from the rows put in."""
    first = buckets[0].start
    counts = {b.start: [0, 0] for b in buckets}
    for id_, created, sent in rows:
        for i, at in enumerate((created, sent)):
            if id_ >= from_id and at is not None and utc(at) >= first:
                counts[minute_of(at)][i] += 1
    return [(c, s) for c, s in counts.values()]


def test_flow_counts_created_and_sent_rows_per_bucket(outbox: Outbox) -> None:
    now = db_now(outbox)
    # Whole minutes on the database's clock, and each row half a minute into one,
    # so no row sits on a bucket's edge.
    minute = now - timedelta(seconds=now.second, microseconds=now.microsecond)

    def at(minutes_back: float) -> datetime:
        return minute - timedelta(minutes=minutes_back) + 30 * S

    plan = [
        (at(120), at(2)),  # created long ago, sent within the window (a backlog)
        (at(8), at(5)),
        (at(6), at(1)),
        (at(6), None),
        (at(3), at(3)),
        (at(1), None),
    ]
    with outbox.engine.begin() as conn:
        put(conn, outbox, at(130), State.SENT, sent=at(125))  # before the window
        rows = []
        for created, sent in plan:
            state = State.SENT if sent is not None else State.PENDING
            rows.append((put(conn, outbox, created, state, sent=sent), created, sent))
    console = outbox.dialect.console
    with outbox.engine.connect() as conn:
        for from_id in (rows[0][0], rows[1][0], rows[4][0]):
            before = utc(db_now(outbox))
            buckets = console.flow(conn, seconds=600, bucket=60, from_id=from_id)
            after = utc(db_now(outbox))
            starts = [b.start for b in buckets]
            assert all(s == minute_of(s) for s in starts)
            assert all(b - a == 60 * S for a, b in itertools.pairwise(starts))
            # The window ends at the call's clock, between the two readings.
            assert starts[0] <= after - 600 * S and before - 600 * S < starts[0] + 60 * S
            assert starts[-1] <= after and before < starts[-1] + 60 * S
            got = [(b.created, b.sent) for b in buckets]
            assert got == expected_flow(buckets, rows, from_id), from_id
        assert sum(b.created + b.sent for b in buckets) == 3  # rows[4:]: not all zeros
        empty = console.flow(conn, seconds=600, bucket=60, from_id=None)
        assert len(empty) in (10, 11) and all((b.created, b.sent) == (0, 0) for b in empty)
        halves = console.flow(conn, seconds=600, bucket=30, from_id=rows[0][0])
        assert len(halves) in (20, 21)
        assert sum(b.created for b in halves) == 5 and sum(b.sent for b in halves) == 4
        with pytest.raises(ValueError):
            console.flow(conn, seconds=600, bucket=0, from_id=None)


def test_events_filters_pages_newest_first_without_payloads(outbox: Outbox) -> None:
    now = db_now(outbox)
    with outbox.engine.begin() as conn:
        e1 = put(conn, outbox, now - 70 * S, topic="a.x", key="k1", partition=4)
        e2 = put(
            conn, outbox, now - 60 * S, State.DEAD, topic="a.y", key="k1",
            error="Broker said 50% of QUOTA_used", headers={"trace": "t2"},
        )  # fmt: skip
        e3 = put(conn, outbox, now - 50 * S, State.DEAD, topic="a.x", key="k2", error="timeout")
        e4 = put(conn, outbox, now - 40 * S, State.SENT, topic="a.x", key="k1", sent=now)
        e5 = put(
            conn, outbox, now - 30 * S, State.LEASED, topic="a.y", key="k2",
            lease_until=now + 60 * S,
        )  # fmt: skip
        e6 = put(
            conn, outbox, now - 20 * S, State.DEAD, topic="a.x", key="k1",
            error="broker said 50x of quotaXused",
        )  # fmt: skip
        e7 = put(conn, outbox, now - 10 * S, topic="a.x")
    console = outbox.dialect.console

    def ids(**filters: Any) -> list[int]:
        with outbox.engine.connect() as conn:
            return [e.id for e in console.events(conn, **filters)]

    assert ids(states=[State.DEAD]) == [e6, e3, e2]
    assert ids(states=ALL_STATES) == [e7, e6, e5, e4, e3, e2, e1]
    assert ids(states=ALL_STATES, limit=3) == [e7, e6, e5]
    assert ids(states=[State.PENDING, State.DEAD], before_id=e6) == [e3, e2, e1]
    pages, before = [], None
    while page := ids(states=[State.PENDING, State.DEAD], before_id=before, limit=2):
        pages.append(page)
        before = page[-1]
    assert pages == [[e7, e6], [e3, e2], [e1]]
    assert ids(states=ALL_STATES, topic="a.x") == [e7, e6, e4, e3, e1]
    assert ids(states=ALL_STATES, key="k1") == [e6, e4, e2, e1]
    assert ids(states=ALL_STATES, topic="a.y", key="k2") == [e5]
    # Case-insensitive substring; % and _ typed by the user are plain characters.
    assert ids(states=[State.DEAD], error="BROKER SAID") == [e6, e2]
    assert ids(states=[State.DEAD], error="50%") == [e2]
    assert ids(states=[State.DEAD], error="quota_used") == [e2]
    assert ids(states=[State.DEAD], error="%") == [e2]
    assert ids(states=ALL_STATES, error="TimeOut") == [e3]
    assert ids(states=[]) == []
    with outbox.engine.connect() as conn:
        listed = {e.id: e for e in console.events(conn, states=ALL_STATES)}
        full = console.event(conn, e2)
        assert console.event(conn, e7 + 1000) is None
    assert all(e.payload is None and e.headers is None for e in listed.values())
    sent, leased, first = listed[e4], listed[e5], listed[e1]
    assert (sent.state, sent.topic, sent.key, sent.sent_at) == (State.SENT, "a.x", "k1", utc(now))
    assert (leased.state, leased.lease_until) == (State.LEASED, utc(now + 60 * S))
    assert (first.key_partition, first.created_at, first.available_at) == (
        4, utc(now - 70 * S), utc(now - 70 * S),
    )  # fmt: skip
    assert full is not None and full.id == e2 and full.state == State.DEAD
    assert full.payload == {"topic": "a.y", "created": (now - 60 * S).isoformat()}
    assert full.headers == {"trace": "t2"}
    assert (full.attempts, full.last_error) == (2, "Broker said 50% of QUOTA_used")
    assert full.event_id == listed[e2].event_id and full.sent_at is None


def test_held_keys_are_dead_heads_with_pending_events_behind(outbox: Outbox) -> None:
    now = db_now(outbox)
    when = iter(now - (100 - i) * S for i in range(100))
    made: dict[str, list[int]] = {}

    def row(key: str | None, state: State, error: str | None = None) -> int:
        with outbox.engine.begin() as conn:
            id_ = put(conn, outbox, next(when), state, key=key, error=error)
        made.setdefault(str(key), []).append(id_)
        return id_

    a_dead = row("a", State.DEAD, "boom a")
    row("a", State.PENDING)
    row("a", State.PENDING)
    row("b", State.PENDING)  # b's head is pending: not held
    row("b", State.DEAD, "boom b")
    row("b", State.PENDING)
    row("c", State.DEAD, "boom c")  # nothing waits behind it
    d_dead = row("d", State.DEAD, "boom d")
    row("d", State.DEAD, "boom d again")
    for _ in range(3):
        row("d", State.PENDING)
    row("e", State.LEASED)  # e's head is in flight: not held
    row("e", State.DEAD, "boom e")
    row("e", State.PENDING)
    row("f", State.SENT)  # sent rows are behind the head, not in front of it
    f_dead = row("f", State.DEAD, None)
    row("f", State.PENDING)
    row(None, State.DEAD, "no key")
    row(None, State.PENDING)
    created = {}
    with outbox.engine.connect() as conn:
        t = outbox.table
        created = dict(conn.execute(sa.select(t.c.id, t.c.created_at)).all())
        held = outbox.dialect.console.held_keys(conn)
        assert outbox.dialect.console.held_keys(conn, limit=2) == held[:2]
    assert held == [
        HeldKey("d", d_dead, "boom d", 3, utc(created[made["d"][2]])),
        HeldKey("a", a_dead, "boom a", 2, utc(created[made["a"][1]])),
        HeldKey("f", f_dead, None, 1, utc(created[made["f"][2]])),
    ]


def test_sent_by_partition_counts_recent_sends_from_an_id(outbox: Outbox) -> None:
    now = db_now(outbox)
    with outbox.engine.begin() as conn:
        early = put(conn, outbox, now - 90 * S, State.SENT, sent=now - 5 * S, partition=7)
        after = put(conn, outbox, now - 80 * S, State.SENT, sent=now - 5 * S, partition=1)
        put(conn, outbox, now - 70 * S, State.SENT, sent=now - 4 * S, partition=1)
        put(conn, outbox, now - 60 * S, State.SENT, sent=now - 3 * S, partition=2)
        put(conn, outbox, now - 50 * S, State.SENT, sent=now - 2 * S, partition=None)
        put(conn, outbox, now - 40 * S, State.SENT, sent=now - 500 * S, partition=1)
        put(conn, outbox, now - 30 * S, State.PENDING, partition=3)
    console = outbox.dialect.console
    with outbox.engine.connect() as conn:
        assert console.sent_by_partition(conn, seconds=60, from_id=early) == {7: 1, 1: 2, 2: 1}
        assert console.sent_by_partition(conn, seconds=60, from_id=after) == {1: 2, 2: 1}
        assert console.sent_by_partition(conn, seconds=3600, from_id=after) == {1: 3, 2: 1}
        assert console.sent_by_partition(conn, seconds=60, from_id=None) == {}


# -- no waiting on relays --------------------------------------------------------


def fill_some(outbox: Outbox) -> dict[str, int]:
    now = db_now(outbox)
    with outbox.engine.begin() as conn:
        return {
            "sent": put(conn, outbox, now - 60 * S, State.SENT, sent=now - 50 * S, partition=1),
            "dead": put(conn, outbox, now - 50 * S, State.DEAD, key="k", error="boom"),
            "held": put(conn, outbox, now - 40 * S, key="k"),
            "leased": put(conn, outbox, now - 30 * S, State.LEASED, lease_until=now + 60 * S),
            "pending": put(conn, outbox, now - 20 * S),
        }


def test_no_read_waits_on_the_row_locks_a_relay_holds(
    outbox: Outbox, backend: str, db_url: str
) -> None:
    made = fill_some(outbox)
    t = outbox.table
    dialect = outbox.dialect
    # The reader gives up on a lock after a moment: a read that waited fails here.
    options = {"connect_args": {"timeout": 0.5}} if backend == "sqlite" else {}
    reader_engine = sa.create_engine(db_url, **options)
    holder = outbox.engine.connect()
    try:
        with dialect.transaction(holder):  # as a claim does (SQLite: the write lock)
            unsent = in_states(t, State.PENDING, State.LEASED, State.DEAD)
            pick = dialect.lock_rows(sa.select(t.c.id).where(unsent).order_by(t.c.id))
            assert len(holder.execute(pick).all()) == 4
            if backend != "mssql":
                # A lease renewed, uncommitted. (SQL Server's plain reads wait on
                # uncommitted writes unless READ_COMMITTED_SNAPSHOT is on.)
                renew = sa.update(t).where(t.c.id == made["leased"]).values(attempts=5)
                assert holder.execute(renew).rowcount == 1
            with reader_engine.connect() as reader:
                set_lock_timeout(reader, backend, 1)
                read_everything(reader, outbox, made)
                # The control: a write on the same connection does wait, and fails.
                with pytest.raises(sa.exc.DBAPIError), reader.begin():
                    reader.execute(sa.update(t).where(t.c.id == made["leased"]).values(attempts=9))
    finally:
        holder.close()
        reader_engine.dispose()


def in_states(t: sa.Table, *states: State) -> sa.ColumnElement[bool]:
    return t.c.state.in_([int(s) for s in states])


def read_everything(reader: sa.Connection, outbox: Outbox, made: dict[str, int]) -> None:
    """Every read of the console, each checked against the committed rows."""
    console = outbox.dialect.console
    overview = console.overview(reader)
    assert (overview.pending, overview.leased, overview.dead) == (2, 1, 1)
    assert overview.oldest_pending_id == made["held"]
    first = console.first_id_since(reader, 3600)
    assert first == made["sent"]
    flow = console.flow(reader, seconds=600, bucket=60, from_id=first)
    assert sum(b.created for b in flow) == 5 and sum(b.sent for b in flow) == 1
    listed = console.events(reader, states=ALL_STATES)
    assert [e.id for e in listed] == sorted(made.values(), reverse=True)
    assert next(e for e in listed if e.id == made["leased"]).attempts == 0  # committed
    assert console.events(reader, states=[State.DEAD], error="BOO")[0].id == made["dead"]
    event = console.event(reader, made["leased"])
    assert event is not None and event.state == State.LEASED
    [held] = console.held_keys(reader)
    assert (held.key, held.dead_id, held.waiting) == ("k", made["dead"], 1)
    assert console.sent_by_partition(reader, seconds=3600, from_id=first) == {1: 1}


# -- plans --------------------------------------------------------------------------

FILL = 20_000


def only_on(backend: str) -> None:
    if backend not in BACKENDS:
        pytest.skip(f"{backend} not in OUTBOX_TEST_BACKENDS")


def planned(outbox: Outbox) -> dict[str, list[tuple[str, Any]]]:
    """The statements of each read, on a table of mostly sent rows (its history)."""
    t = outbox.table
    statements = {}
    with outbox.engine.connect() as conn:
        newest = conn.execute(sa.select(sa.func.max(t.c.id))).scalar_one()
    console = outbox.dialect.console
    reads = {
        "overview": lambda c: console.overview(c),
        "events_dead": lambda c: console.events(c, states=[State.DEAD]),
        "events_pending_key": lambda c: console.events(c, states=[State.PENDING], key="k1"),
        "held_keys": lambda c: console.held_keys(c),
        "flow": lambda c: console.flow(c, seconds=600, bucket=60, from_id=newest - 100),
        "sent_by_partition": lambda c: console.sent_by_partition(
            c, seconds=600, from_id=newest - 100
        ),
    }
    for name, read in reads.items():
        with recorded(outbox.engine) as sent, outbox.engine.connect() as conn:
            read(conn)
        statements[name] = [(s, p) for s, p in sent if t.name in s]
        assert statements[name], name
    return statements


def fill_history(outbox: Outbox, fill_sql: str) -> None:
    """``FILL`` sent rows by one INSERT ... SELECT, then a few rows still to deliver."""
    now = db_now(outbox)
    with outbox.engine.begin() as conn:
        conn.execute(sa.text(fill_sql.format(t=outbox.table.name, n=FILL)))
        put(conn, outbox, now - 9 * S, State.DEAD, key="k1", error="boom")
        for key in ("k1", "k1", "k2"):
            put(conn, outbox, now - 8 * S, key=key)
        put(conn, outbox, now - 7 * S, State.LEASED, key="k3", lease_until=now + 60 * S)
        put(conn, outbox, now - 6 * S, State.DEAD, key="k4", error="boom")
    with outbox.engine.connect() as conn:
        outbox.dialect.analyze(conn)
        conn.commit()


@pytest.mark.parametrize("backend", ["postgresql"])
def test_postgresql_plans_use_the_indexes_not_a_sequential_scan(outbox: Outbox) -> None:
    only_on("postgresql")
    fill_history(
        outbox,
        "INSERT INTO {t} (event_id, topic, key, payload, state, attempts, available_at,"
        " created_at, sent_at, key_partition)"
        " SELECT md5(g::text)::uuid, 'console.fill', 'k' || (g % 100), '{{}}'::jsonb, 2, 1,"
        " ts, ts, ts + interval '1 second', g % 256"
        " FROM generate_series(1, {n}) g,"
        " LATERAL (SELECT now() - ({n} + 100 - g) * interval '1 second' AS ts) x",
    )
    name = outbox.table.name
    plans = {}
    with outbox.engine.connect() as conn:
        for read, statements in planned(outbox).items():
            plans[read] = "\n".join(
                str(line)
                for statement, params in statements
                for line in conn.exec_driver_sql("EXPLAIN " + statement, params).scalars()
            )
    for read, plan in plans.items():
        assert "Seq Scan" not in plan, f"{read}:\n{plan}"
    for index in ("pending", "leased", "dead"):
        assert f"ix_{name}_{index}" in plans["overview"], plans["overview"]
    assert f"ix_{name}_dead" in plans["events_dead"], plans["events_dead"]
    assert f"ix_{name}_pending_key" in plans["events_pending_key"], plans["events_pending_key"]


@pytest.mark.parametrize("backend", ["mysql"])
def test_mariadb_plans_use_the_state_indexes(outbox: Outbox) -> None:
    only_on("mysql")
    fill_history(
        outbox,
        "INSERT INTO {t} (event_id, topic, `key`, payload, state, attempts, available_at,"
        " created_at, sent_at, key_partition)"
        " SELECT uuid(), 'console.fill', concat('k', seq % 100), '{{}}', 2, 1,"
        " utc_timestamp(6) - interval ({n} + 100 - seq) second,"
        " utc_timestamp(6) - interval ({n} + 100 - seq) second,"
        " utc_timestamp(6) - interval ({n} + 99 - seq) second, seq % 256"
        " FROM seq_1_to_{n}",
    )
    name = outbox.table.name
    state_keys = {f"ix_{name}_state_id", f"ix_{name}_state_key_id"}
    with outbox.engine.connect() as conn:
        for read, statements in planned(outbox).items():
            keys: set[str] = set()
            for statement, params in statements:
                result = conn.exec_driver_sql("EXPLAIN " + statement, params).mappings().all()
                for row in result:
                    if row["table"] is None or str(row["table"]).startswith("<"):
                        continue  # no table read, or a derived table built above
                    assert row["type"] != "ALL", f"{read}: full scan {dict(row)}"
                    assert row["key"] is not None, f"{read}: no index {dict(row)}"
                    keys.add(str(row["key"]))
            assert keys <= state_keys | {"PRIMARY"}, f"{read}: {keys}"
            if read in ("flow", "sent_by_partition"):
                assert keys == {"PRIMARY"}, f"{read}: {keys}"  # a range of ids
            else:
                assert keys & state_keys, f"{read}: {keys}"
