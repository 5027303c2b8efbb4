"""Bugs found while reshaping the seams, each pinned on every database where it applies.

- ``sent_at`` is the time of each mark, not of the relay's first mark (SQLite
  cached its clock inside a statement built once);
- the settings a caller passes to ``Outbox.relay`` are the ones the relay runs
  with (``block_on_dead``, ``notify``);
- a cleanup batch never carries more bound parameters than the database takes
  (SQL Server: 2,100);
- the wake-up goes out when ``enqueue`` is the first statement of a connection
  whose transaction begins on that statement (SQLAlchemy's autobegin);
- a LISTEN that fails on a fresh connection (the server going down) discards
  it: handed back to the pool, its reset logged a traceback.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql

from brokers.memory import MemoryBroker, MemoryQueue
from outbox_core import Outbox, Settings
from outbox_core.dialects.base import get_dialect
from outbox_core.message import Outcome
from outbox_core.schema import OutboxTables


def _sent_at(outbox: Outbox) -> dict[str, Any]:
    t = outbox.table
    with outbox.engine.connect() as conn:
        return {
            str(event_id): sent_at
            for event_id, sent_at in conn.execute(sa.select(t.c.event_id, t.c.sent_at))
        }


def test_sent_at_is_the_time_of_each_mark(outbox: Outbox) -> None:
    relay = outbox.relay(MemoryBroker(MemoryQueue("regressions")))
    try:
        with outbox.engine.begin() as conn:
            first = outbox.enqueue(conn, "t", {"n": 1})
        assert relay.run_once().sent == 1
        time.sleep(1.2)
        with outbox.engine.begin() as conn:
            second = outbox.enqueue(conn, "t", {"n": 2})
        assert relay.run_once().sent == 1
    finally:
        relay.close()
    sent = _sent_at(outbox)
    assert (sent[second] - sent[first]).total_seconds() >= 1.0, sent


# -- the settings passed are the settings used ------------------------------------------------


def test_settings_passed_to_relay_keep_block_on_dead_false(outbox: Outbox) -> None:
    """A dead head does not block its key when the caller's settings say so."""
    with outbox.engine.begin() as conn:
        outbox.enqueue(conn, "t", {"n": 1}, key="k")
        behind = outbox.enqueue(conn, "t", {"n": 2}, key="k")

    def reject_first(event: Any) -> Outcome | None:
        return Outcome.reject("poison") if event.payload == {"n": 1} else None

    queue = MemoryQueue("regressions")
    settings = Settings(
        table=outbox.table.name, ordering="partitions", block_on_dead=False, notify=False
    )
    relay = outbox.relay(MemoryBroker(queue, decide=reject_first), settings=settings)
    try:
        for _ in range(4):
            relay.run_once()
    finally:
        relay.close()
    assert relay.settings.block_on_dead is False
    assert behind in [e.event_id for e in queue.snapshot()]


def test_outbox_notify_false_reaches_its_relays(db_url: str, table_name: str) -> None:
    outbox = Outbox(db_url, table=table_name, notify=False)
    relay = outbox.relay("memory://notify-off")
    try:
        assert relay.settings.notify is False
    finally:
        relay.close()
        outbox.dispose()


# -- a cleanup batch fits the database's parameter limit -----------------------------------------


class _Recorder:
    """A SQL Server connection that records the bound parameters of what it is given."""

    def __init__(self, ids: int) -> None:
        self.dialect = mssql.dialect(paramstyle="qmark")
        self.params: list[int] = []
        self.ids = ids

    def in_transaction(self) -> bool:
        return False

    def begin(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def execute(self, stmt: Any, params: Any = None) -> Any:
        # Expanding IN lists rendered as the driver receives them: one "?" per value.
        compiled = stmt.compile(dialect=self.dialect, compile_kwargs={"render_postcompile": True})
        self.params.append(str(compiled).count("?"))
        picked = [(i,) for i in range(self.ids)]
        self.ids = 0

        class Result:
            rowcount = len(picked)

            def scalars(self) -> Iterator[Any]:
                return iter(r[0] for r in picked)

        return Result()


@pytest.mark.parametrize("batch", [3000, 4000])
def test_sql_server_cleanup_batches_fit_2100_parameters(batch: int) -> None:
    dialect = get_dialect("mssql")(OutboxTables.create())
    conn: Any = _Recorder(ids=batch)
    dialect.cleanup(conn, older_than=60, batch=batch)
    assert conn.params, "cleanup sent nothing"
    assert max(conn.params) <= 2100, conn.params


# -- the wake-up when enqueue begins the transaction --------------------------------------------


def _listening(outbox: Outbox) -> Any:
    listener = outbox.dialect.enqueue.listener(outbox.engine)
    if listener is None:
        pytest.skip(f"{outbox.dialect.name} has no notifications: relays poll")
    return listener


def test_enqueue_as_first_statement_of_connect_then_commit_sends_the_wake_up(
    outbox: Outbox,
) -> None:
    listener = _listening(outbox)
    try:
        with outbox.engine.connect() as conn:
            outbox.enqueue(conn, "t", {})
            conn.commit()
        assert listener.wait(2.0)
        # The connection's next transaction carries its own wake-up too.
        with outbox.engine.connect() as conn:
            outbox.enqueue(conn, "t", {})
            conn.commit()
            outbox.enqueue(conn, "t", {})
            conn.commit()
        assert listener.wait(2.0)
    finally:
        listener.close()


def test_a_listen_that_fails_discards_its_connection(
    outbox: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    _listening(outbox).close()  # skips where there are no notifications
    import psycopg

    def lost(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        raise psycopg.OperationalError("the connection is lost")

    invalidated: list[object] = []
    sa.event.listen(outbox.engine, "invalidate", lambda *args: invalidated.append(args))
    monkeypatch.setattr(psycopg.Connection, "execute", lost)
    with pytest.raises(psycopg.OperationalError):
        outbox.dialect.enqueue.listener(outbox.engine, ["some_channel"])
    assert len(invalidated) == 1
    assert outbox.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_enqueue_as_first_statement_wakes_in_process_relays(outbox: Outbox) -> None:
    relay = outbox.relay("memory://woken")
    woken: list[int] = []
    relay.wake = lambda: woken.append(1)  # type: ignore[method-assign]
    try:
        with outbox.engine.connect() as conn:
            outbox.enqueue(conn, "t", {})
            conn.commit()
        assert woken == [1]
        with outbox.engine.connect() as conn:
            outbox.enqueue(conn, "t", {})
            conn.commit()
            outbox.enqueue(conn, "t", {})
            conn.commit()
        assert woken == [1, 1, 1]
    finally:
        relay.close()


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_enqueue_async_as_first_statement_wakes_in_process_relays(
    backend: str, db_url: str, table_name: str
) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from tests.conftest import async_url

    outbox = Outbox(db_url, table=table_name)
    outbox.install()
    relay = outbox.relay("memory://woken-async")
    woken: list[int] = []
    relay.wake = lambda: woken.append(1)  # type: ignore[method-assign]
    engine = create_async_engine(async_url(backend, db_url))

    async def produce() -> None:
        async with engine.connect() as conn:
            await outbox.enqueue_async(conn, "t", {})
            await conn.commit()
        await engine.dispose()

    try:
        asyncio.run(produce())
        assert woken == [1]
    finally:
        relay.close()
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()
