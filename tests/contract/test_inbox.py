"""The inbox (idempotent consumer) contract, on every reachable database.

First delivery recorded, duplicates refused, rollbacks record nothing,
concurrent consumers of one id: exactly one wins. Cleanup by age in bounded
batches. The documented consumers (docs/examples/consumers/) run end to end in
``tests/contract/test_consumer_examples.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox_core import Outbox
from outbox_core.errors import TableMissing
from outbox_core.inbox import Inbox, cleanup_inbox
from tests.conftest import async_url
from tests.support import set_lock_timeout


@pytest.fixture
def inbox(outbox: Outbox) -> Inbox:
    return Inbox.for_outbox(outbox)


def new_id() -> str:
    return str(uuid.uuid4())


def inbox_rows(inbox: Inbox) -> list[tuple[str, str]]:
    t = inbox.table
    with inbox.outbox.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.consumer, t.c.event_id).order_by(t.c.processed_at))
        return [(c, str(e)) for c, e in rows]


# -- record -----------------------------------------------------------------------------


def test_first_record_is_new_then_duplicate(inbox: Inbox) -> None:
    event_id = new_id()
    with inbox.outbox.engine.begin() as conn:
        assert inbox.record(conn, "billing", event_id) is True
        assert inbox.record(conn, "billing", event_id) is False
    with inbox.outbox.engine.begin() as conn:
        assert inbox.record(conn, "billing", event_id.upper()) is False  # same id, any case
        assert inbox.seen(conn, "billing", event_id) is True
        # Every consumer processes the event once of its own.
        assert inbox.seen(conn, "shipping", uuid.UUID(event_id)) is False
        assert inbox.seen(conn, "shipping", event_id) is True
    assert sorted(inbox_rows(inbox)) == [("billing", event_id), ("shipping", event_id)]


def test_record_with_a_session(inbox: Inbox) -> None:
    event_id = new_id()
    with Session(inbox.outbox.engine) as session:
        assert inbox.record(session, "billing", event_id) is True
        session.rollback()
        assert inbox.record(session, "billing", event_id) is True
        session.commit()
        assert inbox.record(session, "billing", event_id) is False
        session.commit()
    assert inbox_rows(inbox) == [("billing", event_id)]


def test_a_rolled_back_transaction_records_nothing(inbox: Inbox, outbox: Outbox) -> None:
    """The record and the effect commit together: a failed effect leaves the id unrecorded."""
    meta = sa.MetaData()
    effects = sa.Table(
        f"{outbox.table.name}_fx", meta, sa.Column("event_id", sa.String(36), nullable=False)
    )
    meta.create_all(outbox.engine)
    event_id = new_id()
    try:
        with pytest.raises(RuntimeError), outbox.engine.begin() as conn:
            assert inbox.record(conn, "billing", event_id)
            conn.execute(effects.insert().values(event_id=event_id))
            raise RuntimeError("the business effect failed")
        assert inbox_rows(inbox) == []
        # The redelivery is processed again, and this time it commits.
        with outbox.engine.begin() as conn:
            assert inbox.record(conn, "billing", event_id)
            conn.execute(effects.insert().values(event_id=event_id))
        with outbox.engine.begin() as conn:
            assert not inbox.record(conn, "billing", event_id)
        with outbox.engine.connect() as conn:
            assert conn.execute(sa.select(effects.c.event_id)).scalars().all() == [event_id]
    finally:
        meta.drop_all(outbox.engine)


def test_record_async(backend: str, inbox: Inbox, db_url: str) -> None:
    url = async_url(backend, db_url)
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    first, second = new_id(), new_id()

    async def scenario() -> list[bool]:
        engine = create_async_engine(url)
        try:
            results = []
            async with engine.begin() as conn:
                results.append(await inbox.record_async(conn, "billing", first))
                results.append(await inbox.record_async(conn, "billing", first))
            async with AsyncSession(engine) as session:
                results.append(await inbox.seen_async(session, "billing", first))
                await session.rollback()
                results.append(await inbox.record_async(session, "billing", second))
                await session.commit()
            return results
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) == [True, False, True, True]
    assert sorted(e for _, e in inbox_rows(inbox)) == sorted([first, second])


# -- concurrent consumers -----------------------------------------------------------------


class Recorder(threading.Thread):
    """Records one id on a connection of its own, in its own transaction."""

    def __init__(self, inbox: Inbox, backend: str, event_id: str) -> None:
        super().__init__(daemon=True)
        self.inbox, self.backend, self.event_id = inbox, backend, event_id
        self.started_insert = threading.Event()
        self.result: bool | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.inbox.outbox.engine.connect() as conn:
                set_lock_timeout(conn, self.backend, 20)  # a stuck wait fails, not hangs
                with conn.begin():
                    self.started_insert.set()
                    self.result = self.inbox.record(conn, "billing", self.event_id)
        except BaseException as exc:
            self.error = exc


@pytest.mark.parametrize("first_outcome", ["commit", "rollback"])
def test_a_concurrent_duplicate_waits_for_the_first_then_loses(
    backend: str, inbox: Inbox, first_outcome: str
) -> None:
    """Two consumers get the same message: the second waits; it wins only if the first fails.

    PostgreSQL and MariaDB/MySQL wait on the first transaction's uncommitted
    key, SQL Server on its key-range lock, SQLite on the database write lock.
    """
    event_id = new_id()
    with inbox.outbox.engine.connect() as first:
        tx = first.begin()
        assert inbox.record(first, "billing", event_id) is True
        second = Recorder(inbox, backend, event_id)
        second.start()
        assert second.started_insert.wait(5)
        time.sleep(0.5)
        assert second.is_alive(), f"second consumer did not wait: {second.result, second.error}"
        if first_outcome == "commit":
            tx.commit()
        else:
            tx.rollback()
        second.join(15)
    assert not second.is_alive(), "second consumer still blocked after the first finished"
    assert second.error is None, repr(second.error)
    # Committed first: the second sees a duplicate. Rolled back: the second processes it.
    assert second.result is (first_outcome == "rollback")
    assert inbox_rows(inbox) == [("billing", event_id)]


def test_three_waiting_on_a_first_that_rolls_back_one_wins_none_errs(
    backend: str, inbox: Inbox
) -> None:
    """The InnoDB case: waiters of a rolled-back insert must not deadlock each other."""
    for _ in range(3):
        event_id = new_id()
        with inbox.outbox.engine.connect() as first:
            tx = first.begin()
            assert inbox.record(first, "billing", event_id) is True
            waiters = [Recorder(inbox, backend, event_id) for _ in range(3)]
            for w in waiters:
                w.start()
            for w in waiters:
                assert w.started_insert.wait(5)
            time.sleep(0.5)
            tx.rollback()
            for w in waiters:
                w.join(30)
        assert [w.error for w in waiters] == [None] * 3, [repr(w.error) for w in waiters]
        assert sorted(w.result for w in waiters) == [False, False, True]
        assert inbox_rows(inbox)[-1:] == [("billing", event_id)]


def race(inbox: Inbox, backend: str, event_id: str, consumers: int) -> list[bool | BaseException]:
    """``consumers`` threads record ``event_id`` at once, each in its own transaction."""
    gate = threading.Barrier(consumers)
    results: list[bool | BaseException] = []

    def consume() -> None:
        try:
            with inbox.outbox.engine.connect() as conn:
                set_lock_timeout(conn, backend, 20)
                gate.wait(10)
                with conn.begin():
                    results.append(inbox.record(conn, "billing", event_id))
                    time.sleep(0.05)  # hold the transaction so the others pile up
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=consume, daemon=True) for _ in range(consumers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_many_concurrent_consumers_of_one_id_exactly_one_wins(backend: str, inbox: Inbox) -> None:
    for _ in range(3):
        results = race(inbox, backend, new_id(), 6)
        assert sorted(results, key=repr) == [False] * 5 + [True], results


# -- retention --------------------------------------------------------------------------


def age_rows(inbox: Inbox, event_ids: list[str], seconds: float) -> None:
    """Pretend these rows were processed ``seconds`` ago."""
    t = inbox.table
    with inbox.outbox.engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.event_id.in_(event_ids))
            .values(processed_at=inbox.dialect.after(-seconds))
        )


def test_cleanup_removes_only_old_rows_in_bounded_batches(inbox: Inbox) -> None:
    old = [new_id() for _ in range(11)]
    recent = [new_id() for _ in range(5)]
    consumer = {e: f"consumer-{i % 3}" for i, e in enumerate(old + recent)}
    with inbox.outbox.engine.begin() as conn:
        for event_id in old + recent:
            inbox.record(conn, consumer[event_id], event_id)  # several consumers per batch
    age_rows(inbox, old, 3 * 86400)
    age_rows(inbox, recent[:2], 3600)  # recent enough to keep

    # Bounded: two transactions of at most 4 rows each.
    assert inbox.cleanup(older_than=86400, batch=4, max_batches=2) == 8
    left = {e for _, e in inbox_rows(inbox)}
    assert len(left & set(old)) == 3 and set(recent) <= left
    # The rest, with the function `outbox cleanup --inbox-older-than` calls.
    assert cleanup_inbox(inbox.outbox, 86400, batch=4) == 3
    assert {e for _, e in inbox_rows(inbox)} == set(recent)
    assert inbox.cleanup(older_than=86400) == 0
    # A removed id counts as new again: keep rows longer than any redelivery takes.
    with inbox.outbox.engine.begin() as conn:
        assert inbox.record(conn, consumer[old[0]], old[0]) is True
        assert inbox.record(conn, consumer[recent[0]], recent[0]) is False


def test_install_creates_only_the_inbox_table(db_url: str, table_name: str) -> None:
    inbox = Inbox(db_url, table=table_name)
    try:
        inbox.install()
        inbox.install()  # idempotent
        inspector = sa.inspect(inbox.outbox.engine)
        assert inspector.has_table(f"{table_name}_inbox")
        assert not inspector.has_table(table_name)
        with inbox.outbox.engine.begin() as conn:
            assert inbox.record(conn, "billing", new_id())
    finally:
        inbox.table.drop(inbox.outbox.engine, checkfirst=True)
        inbox.dispose()


def test_a_missing_inbox_table_is_table_missing_and_the_transaction_stays_usable(
    db_url: str, table_name: str
) -> None:
    inbox = Inbox(db_url, table=table_name)  # never installed
    try:
        with inbox.outbox.engine.connect() as conn, conn.begin():
            with pytest.raises(TableMissing, match=r"Inbox.install\(\)"):
                inbox.record(conn, "billing", new_id())
            # A refused INSERT would have aborted the transaction on PostgreSQL.
            assert conn.execute(sa.select(sa.literal(1))).scalar_one() == 1
        inbox.install()
        with inbox.outbox.engine.begin() as conn:
            assert inbox.record(conn, "billing", new_id()) is True
    finally:
        with inbox.outbox.engine.begin() as conn:
            inbox.table.drop(conn, checkfirst=True)
        inbox.dispose()
