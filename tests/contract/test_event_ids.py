"""The caller's own event ids (issue #38), on the real databases and brokers.

``enqueue(..., event_id=...)`` and ``enqueue_many``'s ``event_id``: stored as
given (lower-case, hyphenated), refused before any SQL when not a UUID, a
duplicate refused with :class:`DuplicateEventId` while the caller's
transaction stays usable (PostgreSQL aborts a transaction on a unique
violation; the insert runs in a savepoint), on SQLite, PostgreSQL and
MariaDB through SQLAlchemy connections and sessions, the DB-API drivers and
the async ones. What a consumer reads as the message id is the caller's id
on RabbitMQ, Redis, NATS, a webhook and Kafka, through the polling relay and
PostgreSQL's log tailing.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox_core import Outbox
from outbox_core.brokers.base import Broker, create_broker
from outbox_core.brokers.memory import MemoryBroker, MemoryQueue
from outbox_core.errors import DuplicateEventId, EventError, InvalidEventId
from outbox_core.inbox import Inbox
from tests.contract.broker_fixtures import SECRET, RabbitState, WebhookServer
from tests.contract.stream_fixtures import NatsStream, RedisStreams, require_nats, require_redis
from tests.contract.test_connections import Raw, _import, _url, raw  # noqa: F401 (the fixture)
from tests.contract.test_wal_relay import Feed, installed_feed, wait_for
from tests.faults.private_servers import PrivatePostgres

if TYPE_CHECKING:
    from tests.kafka_mock import Cluster


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def orders(outbox: Outbox) -> Iterator[sa.Table]:
    """A business table beside the outbox, in the same database."""
    meta = sa.MetaData()
    table = sa.Table(
        f"{outbox.table.name}_orders", meta, sa.Column("id", sa.Integer, primary_key=True)
    )
    meta.create_all(outbox.engine)
    yield table
    meta.drop_all(outbox.engine)


def stored(outbox: Outbox) -> list[tuple[str, Any]]:
    """(event_id as text, payload) of every row, in id order."""
    t = outbox.table
    with outbox.engine.connect() as conn:
        return [
            (str(r.event_id), r.payload)
            for r in conn.execute(sa.select(t.c.event_id, t.c.payload).order_by(t.c.id))
        ]


def order_ids(outbox: Outbox, orders: sa.Table) -> list[int]:
    with outbox.engine.connect() as conn:
        return sorted(conn.execute(sa.select(orders.c.id)).scalars())


def relay_all(outbox: Outbox, broker: str | Broker) -> None:
    """Relay every pending event once, then close the relay (and the broker)."""
    relay = outbox.relay(broker)
    try:
        while relay.run_once().claimed:
            pass
    finally:
        relay.close()


def new_id() -> uuid.UUID:
    return uuid.uuid4()


# -- stored as given, refused before any SQL -----------------------------------------------


def test_the_callers_id_is_returned_stored_and_relayed_as_the_event_id(outbox: Outbox) -> None:
    one, two, three = new_id(), new_id(), new_id()
    with outbox.engine.begin() as conn:
        got = [
            outbox.enqueue(conn, "t", {"n": 1}, event_id=one),
            outbox.enqueue(conn, "t", {"n": 2}, event_id=two.hex.upper()),  # no hyphens, upper
            outbox.enqueue(conn, "t", {"n": 3}),
        ]
        got += outbox.enqueue_many(
            conn,
            [
                {"topic": "t", "payload": {"n": 4}, "event_id": str(three).upper()},
                {"topic": "t", "payload": {"n": 5}},
            ],
        )
    assert got[:2] == [str(one), str(two)] and got[3] == str(three)
    assert [i for i, _ in stored(outbox)] == got
    queue = MemoryQueue(f"eid-{uuid.uuid4().hex[:8]}")
    relay_all(outbox, MemoryBroker(queue))
    assert [e.event_id for e in queue.snapshot()] == got


BAD_IDS = ["order-17", "{" + str(uuid.UUID(int=7)) + "}", 17, uuid.UUID(int=7).bytes, ""]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_an_id_that_is_not_a_uuid_is_refused_before_any_sql(outbox: Outbox, bad: Any) -> None:
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    with outbox.engine.connect() as conn:
        outbox.enqueue(conn, "t", {"n": 0})  # the first look at the table is behind us
        conn.commit()
        sa.event.listen(outbox.engine, "before_cursor_execute", seen)
        try:
            with pytest.raises(InvalidEventId, match=r"not a UUID|uuid\.UUID or its text"):
                outbox.enqueue(conn, "t", {"n": 1}, event_id=bad)
            with pytest.raises(InvalidEventId, match=r"events\[1\]"):
                outbox.enqueue_many(
                    conn,
                    [{"topic": "t", "payload": {}}, {"topic": "t", "payload": {}, "event_id": bad}],
                )
        finally:
            sa.event.remove(outbox.engine, "before_cursor_execute", seen)
        assert statements == []
        outbox.enqueue(conn, "t", {"n": 2})  # the transaction is usable
        conn.commit()
    assert [p for _, p in stored(outbox)] == [{"n": 0}, {"n": 2}]


# -- duplicates: refused, the caller's transaction usable ------------------------------------


def test_a_duplicate_raises_and_the_callers_transaction_goes_on(
    outbox: Outbox, orders: sa.Table
) -> None:
    taken = new_id()
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", {"n": 1}, event_id=taken)
    with outbox.engine.begin() as conn:
        conn.execute(orders.insert().values(id=1))
        outbox.enqueue(conn, "t", {"n": 2})
        with pytest.raises(DuplicateEventId) as caught:
            outbox.enqueue(conn, "t", {"n": "again"}, event_id=str(taken).upper())
        assert str(taken) in str(caught.value) and caught.value.event_ids == (str(taken),)
        assert isinstance(caught.value, EventError)
        # On PostgreSQL a unique violation would have aborted the whole transaction.
        conn.execute(orders.insert().values(id=2))
        outbox.enqueue(conn, "t", {"n": 3}, event_id=new_id())
    assert [p["n"] for _, p in stored(outbox)] == [1, 2, 3]
    assert order_ids(outbox, orders) == [1, 2]


def test_a_duplicate_of_an_event_of_the_same_transaction_is_refused(outbox: Outbox) -> None:
    same = new_id()
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", {"n": 1}, event_id=same)
        with pytest.raises(DuplicateEventId):
            outbox.enqueue(conn, "t", {"n": 2}, event_id=same)
        outbox.enqueue(conn, "t", {"n": 3})
    assert [(i, p["n"]) for i, p in stored(outbox)][::2] == [(str(same), 1)]
    assert [p["n"] for _, p in stored(outbox)] == [1, 3]


def test_a_duplicate_in_a_session_leaves_the_session_usable(
    outbox: Outbox, orders: sa.Table
) -> None:
    taken = new_id()
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", {"n": 1}, event_id=taken)
    with Session(outbox.engine) as session, session.begin():
        session.execute(orders.insert().values(id=1))
        with pytest.raises(DuplicateEventId):
            outbox.enqueue(session, "t", {"n": 2}, event_id=taken)
        outbox.enqueue(session, "t", {"n": 3})
        session.execute(orders.insert().values(id=2))
    assert [p["n"] for _, p in stored(outbox)] == [1, 3]
    assert order_ids(outbox, orders) == [1, 2]


def test_enqueue_many_with_a_taken_id_writes_none_of_its_events(
    outbox: Outbox, orders: sa.Table
) -> None:
    """The batch goes in several statements (the first event alone, then runs): the
    savepoint takes back the ones before the duplicate too."""
    taken = new_id()
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", {"n": "first"}, event_id=taken)
    specs: list[dict[str, Any]] = [{"topic": "t", "payload": {"n": n}} for n in range(40)]
    specs[5]["event_id"] = new_id()
    specs[20]["headers"] = {"h": "v"}  # another run, another statement
    specs[33]["event_id"] = taken
    with outbox.engine.begin() as conn:
        conn.execute(orders.insert().values(id=1))
        with pytest.raises(DuplicateEventId) as caught:
            outbox.enqueue_many(conn, specs)
        assert str(taken) in caught.value.event_ids
        specs[33]["event_id"] = new_id()
        ids = outbox.enqueue_many(conn, specs)  # the same batch, its id fixed, goes in
    assert [i for i, _ in stored(outbox)] == [str(taken), *ids]
    assert order_ids(outbox, orders) == [1]


def test_an_id_repeated_in_one_enqueue_many_is_refused_before_any_sql(outbox: Outbox) -> None:
    same = new_id()
    with outbox.engine.begin() as conn:
        with pytest.raises(DuplicateEventId, match=r"events\[2\].*events\[0\]"):
            outbox.enqueue_many(
                conn,
                [
                    {"topic": "t", "payload": {}, "event_id": same},
                    {"topic": "t", "payload": {}},
                    {"topic": "t", "payload": {}, "event_id": same.hex},
                ],
            )
        outbox.enqueue(conn, "t", {"n": 1}, event_id=same)
    assert stored(outbox) == [(str(same), {"n": 1})]


def test_a_rolled_back_transaction_takes_its_callers_ids_along(outbox: Outbox) -> None:
    """The savepoint is released, never committed: SQLite's RELEASE of a savepoint that
    opened the transaction would commit it (the guard opens it first)."""
    mine = new_id()
    with outbox.engine.connect() as conn:
        outbox.enqueue(conn, "t", {"n": 1}, event_id=mine)  # the first statement
        outbox.enqueue_many(conn, [{"topic": "t", "payload": {"n": 2}, "event_id": new_id()}])
        conn.rollback()
    assert stored(outbox) == []
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", {"n": 3}, event_id=mine)  # free again
    assert stored(outbox) == [(str(mine), {"n": 3})]


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Outbox]:
    url = _url("postgresql", tmp_path)
    outbox = Outbox(url, table=f"eid_{uuid.uuid4().hex[:10]}")
    outbox.install()
    try:
        yield outbox
    finally:
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


def test_a_duplicate_racing_an_uncommitted_insert_waits_and_is_refused(pg: Outbox) -> None:
    """Two transactions give one id (PostgreSQL): the second waits for the first's commit,
    then hears DuplicateEventId, and its transaction still commits its other events."""
    outbox = pg
    same = new_id()
    outcome: dict[str, Any] = {}
    with outbox.engine.connect() as first:
        outbox.enqueue(first, "t", {"n": 1}, event_id=same)
        pid = first.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()

        def second() -> None:
            try:
                with outbox.engine.begin() as conn:
                    outcome["pid"] = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
                    try:
                        outbox.enqueue(conn, "t", {"n": 2}, event_id=same)
                    except DuplicateEventId as exc:
                        outcome["error"] = exc
                    outbox.enqueue(conn, "t", {"n": 3})
            except Exception as exc:  # reported below
                outcome["failed"] = exc

        thread = threading.Thread(target=second)
        thread.start()
        with outbox.engine.connect() as watch:

            def waiting() -> bool:
                blocked = watch.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE :pid = ANY(pg_blocking_pids(pid))"
                    ),
                    {"pid": pid},
                ).scalar_one()
                watch.rollback()
                return bool(blocked)

            wait_for(waiting, 20, "the second transaction waiting on the first")
        first.commit()
        thread.join(30)
    assert "failed" not in outcome, outcome.get("failed")
    assert isinstance(outcome.get("error"), DuplicateEventId)
    assert [p["n"] for _, p in stored(outbox)] == [1, 3]


# -- DB-API and async drivers -------------------------------------------------------------------


def test_dbapi_drivers_refuse_a_duplicate_and_keep_the_transaction(raw: Raw) -> None:  # noqa: F811
    taken = new_id()
    conn = raw.connect()
    try:
        raw.outbox.enqueue(conn, "t", {"n": 1}, event_id=taken)
        conn.commit()
        raw.order(conn, 1)
        with pytest.raises(DuplicateEventId):
            raw.outbox.enqueue(conn, "t", {"n": 2}, event_id=taken)
        with pytest.raises(DuplicateEventId):
            raw.outbox.enqueue_many(
                conn,
                [
                    {"topic": "t", "payload": {"n": 3}},
                    {"topic": "t", "payload": {}, "event_id": taken},
                ],
            )
        raw.order(conn, 2)
        mine = raw.outbox.enqueue(conn, "t", {"n": 4}, event_id=new_id())
        conn.commit()
    finally:
        conn.close()
    assert raw.count(raw.orders) == 2
    assert [(str(r.event_id), r.payload["n"]) for r in raw.events()] == [
        (str(taken), 1),
        (mine, 4),
    ]


def test_asyncpg_refuses_a_duplicate_and_keeps_the_transaction(pg: Outbox) -> None:
    asyncpg = _import("asyncpg", "asyncpg")
    taken, mine = new_id(), new_id()
    dsn = pg.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)

    async def main() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            async with conn.transaction():
                await pg.enqueue_async(conn, "t", {"n": 1}, event_id=taken)
            async with conn.transaction():
                with pytest.raises(DuplicateEventId) as caught:
                    await pg.enqueue_async(conn, "t", {"n": 2}, event_id=taken)
                assert caught.value.event_ids == (str(taken),)
                with pytest.raises(DuplicateEventId):
                    await pg.enqueue_many_async(
                        conn,
                        [
                            {"topic": "t", "payload": {"n": 3}},
                            {"topic": "t", "payload": {}, "event_id": taken},
                        ],
                    )
                await pg.enqueue_async(conn, "t", {"n": 4}, event_id=mine)
        finally:
            await conn.close()

    asyncio.run(main())
    assert stored(pg) == [(str(taken), {"n": 1}), (str(mine), {"n": 4})]


def test_psycopg_async_refuses_a_duplicate_and_keeps_the_transaction(pg: Outbox) -> None:
    import psycopg

    taken = new_id()
    url = pg.engine.url

    async def main() -> None:
        conn = await psycopg.AsyncConnection.connect(
            host=url.host, user=url.username, dbname=url.database
        )
        try:
            await pg.enqueue_async(conn, "t", {"n": 1}, event_id=taken)
            await conn.commit()
            with pytest.raises(DuplicateEventId):
                await pg.enqueue_async(conn, "t", {"n": 2}, event_id=taken)
            await pg.enqueue_many_async(conn, [{"topic": "t", "payload": {"n": 3}}])
            await conn.commit()
        finally:
            await conn.close()

    asyncio.run(main())
    assert [(i, p["n"]) for i, p in stored(pg)][::2] == [(str(taken), 1)]
    assert [p["n"] for _, p in stored(pg)] == [1, 3]


def test_sqlalchemy_async_sessions_refuse_a_duplicate(pg: Outbox) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    taken = new_id()
    engine = create_async_engine(pg.engine.url.set(drivername="postgresql+psycopg_async"))

    async def main() -> None:
        async with AsyncSession(engine) as session, session.begin():
            await pg.enqueue_async(session, "t", {"n": 1}, event_id=taken)
        async with AsyncSession(engine) as session, session.begin():
            with pytest.raises(DuplicateEventId):
                await pg.enqueue_async(session, "t", {"n": 2}, event_id=taken)
            await pg.enqueue_async(session, "t", {"n": 3})
        await engine.dispose()

    asyncio.run(main())
    assert [p["n"] for _, p in stored(pg)] == [1, 3]


# -- the message id every broker carries ------------------------------------------------------


@pytest.fixture
def sqlite_outbox(tmp_path: Path) -> Iterator[Outbox]:
    outbox = Outbox(f"sqlite:///{tmp_path / 'eid.db'}", table="eid")
    outbox.install()
    yield outbox
    outbox.dispose()


def enqueue_given(outbox: Outbox, topic: str) -> list[str]:
    """Three events with the caller's ids (one by enqueue_many), in one transaction."""
    ids = [new_id(), new_id(), new_id()]
    with outbox.engine.begin() as conn:
        got = [outbox.enqueue(conn, topic, {"n": 0}, key="k", event_id=ids[0].hex.upper())]
        got += outbox.enqueue_many(
            conn,
            [
                {"topic": topic, "payload": {"n": 1}, "key": "k", "event_id": ids[1]},
                {"topic": topic, "payload": {"n": 2}, "key": "k", "event_id": str(ids[2])},
            ],
        )
    assert got == [str(i) for i in ids]
    return got


def test_rabbitmq_consumers_read_the_callers_id_as_message_id_and_dedupe_on_it(
    sqlite_outbox: Outbox, rabbit: RabbitState
) -> None:
    ids = enqueue_given(sqlite_outbox, "contract.order.created")
    relay_all(sqlite_outbox, rabbit.broker())
    arrived = rabbit.arrived()
    assert sorted(arrived) == sorted(ids)
    # The consumer's inbox deduplicates on the id it read: the caller's.
    inbox = Inbox(sqlite_outbox)
    message_ids = [p.message_id for p, _ in rabbit.messages]
    with sqlite_outbox.engine.begin() as conn:
        assert [inbox.record(conn, "billing", m) for m in message_ids] == [True] * 3
        assert inbox.record(conn, "billing", ids[0]) is False


def test_redis_entries_carry_the_callers_id(sqlite_outbox: Outbox) -> None:
    streams = RedisStreams(require_redis())
    try:
        topic = streams.stream("orders")
        ids = enqueue_given(sqlite_outbox, topic)
        relay_all(sqlite_outbox, streams.broker())
        assert [f[b"event_id"].decode() for _, f in streams.entries(topic)] == ids
    finally:
        streams.cleanup()


def test_nats_messages_carry_the_callers_id_as_nats_msg_id(sqlite_outbox: Outbox) -> None:
    stream = NatsStream(require_nats(), duplicate_window=120)
    try:
        ids = enqueue_given(sqlite_outbox, stream.subject("orders"))
        relay_all(sqlite_outbox, stream.broker())
        assert [dict(m.headers or {})["Nats-Msg-Id"] for m in stream.messages()] == ids
    finally:
        stream.cleanup()


def test_webhook_requests_carry_the_callers_id(sqlite_outbox: Outbox) -> None:
    server = WebhookServer().start()
    try:
        ids = enqueue_given(sqlite_outbox, "orders.created")
        relay_all(sqlite_outbox, create_broker(server.url, secret=SECRET))
        accepted = server.accepted()  # signatures verified by the server
        assert sorted(accepted) == sorted(ids)
        assert all(accepted[i].headers["webhook-id"] == i for i in ids)
        assert all(accepted[i].json["id"] == i for i in ids)
        assert server.bad_signatures == []
    finally:
        server.stop()


@pytest.mark.parametrize(("shape", "header"), [(None, "event_id"), ("debezium", "id")])
def test_kafka_records_carry_the_callers_id(
    sqlite_outbox: Outbox, cluster: Cluster, shape: str | None, header: str
) -> None:
    from tests.kafka_mock import read_all

    topic = f"eid.{uuid.uuid4().hex[:8]}"
    ids = enqueue_given(sqlite_outbox, topic)
    options = {"shape": shape} if shape else {}
    relay_all(sqlite_outbox, create_broker(cluster.url, **options))
    records = [r for r in read_all(cluster.bootstrap) if header in r.headers]
    assert [r.headers[header].decode() for r in records] == ids


# -- log tailing ---------------------------------------------------------------------------------


@pytest.fixture
def feed(logical_server: PrivatePostgres) -> Iterator[Feed]:
    with installed_feed(Feed, logical_server, "eid") as made:
        yield made


def test_log_tailing_publishes_the_callers_id_and_not_the_refused_duplicate(feed: Feed) -> None:
    """The duplicate's insert was rolled back to its savepoint: it is not in the
    transaction the slot decodes."""
    outbox = feed.outbox
    ids = [new_id(), new_id()]
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "wal.t", {"n": 1}, key="k", event_id=ids[0])
        with pytest.raises(DuplicateEventId):
            outbox.enqueue(conn, "wal.t", {"n": "dup"}, key="k", event_id=ids[0])
        outbox.enqueue_many(conn, [{"topic": "wal.t", "payload": {"n": 2}, "event_id": ids[1]}])
        generated = outbox.enqueue(conn, "wal.t", {"n": 3}, key="k")
    queue = MemoryQueue(f"eid-wal-{uuid.uuid4().hex[:8]}")
    relay = feed.start(MemoryBroker(queue))
    wait_for(lambda: len(queue.snapshot()) >= 3, 20, "the three events")
    wait_for(lambda: relay.held == 0, 10, "nothing held")
    delivered = queue.snapshot()
    assert [e.event_id for e in delivered if e.key == "k"] == [str(ids[0]), generated]
    assert sorted(e.event_id for e in delivered) == sorted([str(ids[0]), str(ids[1]), generated])
    assert [e.payload for e in delivered if e.event_id == str(ids[0])] == [{"n": 1}]
