"""enqueue on the connection a service already has: DB-API drivers, asyncpg, psycopg async (#22).

Each driver runs on its real database (PostgreSQL: psycopg 3, psycopg2;
MariaDB: PyMySQL, mysqlclient; SQLite: sqlite3), in the caller's
transaction: committed with it, rolled back with it, refused in autocommit.
pyodbc (no SQL Server here) is checked by the SQL the port hands its cursor.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sqlite3
import sys
import threading
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_core import Outbox
from outbox_core.brokers.memory import get_queue
from outbox_core.errors import ConfigurationError, PayloadError, TableMissing
from outbox_core.message import build_new_event
from outbox_core.ports import COMMIT_WATCH, DBAPITransaction, transaction_port
from tests.conftest import (
    BACKENDS,
    OPTIONAL_DRIVERS,
    _probe,
    in_ci,
    require_optional_driver,
    server_url,
    unavailable,
)

#: driver -> (its module, the database it runs on here)
DRIVERS = {
    "psycopg": ("psycopg", "postgresql"),
    "psycopg2": ("psycopg2", "postgresql"),
    "pymysql": ("pymysql", "mysql"),
    "mysqlclient": ("MySQLdb", "mysql"),
    "sqlite3": ("sqlite3", "sqlite"),
}
#: Drivers the dev extra installs: missing under CI=true is a failure.
IN_DEV_EXTRA = {"psycopg", "psycopg2", "pymysql", "sqlite3", "asyncpg"}


def _import(driver: str, module: str) -> Any:
    if driver in OPTIONAL_DRIVERS:
        require_optional_driver(driver)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if in_ci() and driver in IN_DEV_EXTRA:
            pytest.fail(f"{driver} is in the dev extra but not importable: {exc}")
        pytest.skip(f"{driver} not installed ({exc})")


def _url(backend: str, tmp_path: Path) -> sa.URL:
    if backend not in BACKENDS:
        pytest.skip(f"{backend} not in OUTBOX_TEST_BACKENDS")
    url = server_url(backend, tmp_path)
    if url is None:
        pytest.skip(f"{backend}: no test URL")
    if backend != "sqlite":
        reason = _probe(url)
        if reason is not None:
            unavailable(backend, reason)
    return sa.make_url(url)


def connect(driver: str, url: sa.URL, **options: Any) -> Any:
    """A raw DB-API connection of ``driver`` to the database at ``url``."""
    module = _import(driver, DRIVERS[driver][0])
    if driver == "sqlite3":
        return sqlite3.connect(url.database or "", **options)
    args: dict[str, Any] = {"host": url.host, "user": url.username, "password": url.password or ""}
    if url.port:
        args["port"] = url.port
    if driver in ("psycopg", "psycopg2"):
        args["dbname"] = url.database
    else:
        args["database"] = url.database
    return module.connect(**args, **options)


@dataclass
class Raw:
    """One driver on its database, an installed outbox, a business table."""

    driver: str
    url: sa.URL
    outbox: Outbox
    orders: str

    def connect(self, **options: Any) -> Any:
        return connect(self.driver, self.url, **options)

    def order(self, conn: Any, order_id: int) -> None:
        """The business write, on the caller's connection."""
        cur = conn.cursor()
        cur.execute(f"INSERT INTO {self.orders} (id) VALUES ({int(order_id)})")
        cur.close()

    def count(self, table: str | None = None) -> int:
        with self.outbox.engine.connect() as conn:
            name = table or self.outbox.table.name
            return int(conn.execute(sa.text(f"SELECT COUNT(*) FROM {name}")).scalar_one())

    def events(self) -> list[sa.Row[Any]]:
        t = self.outbox.table
        with self.outbox.engine.connect() as conn:
            return list(conn.execute(sa.select(t).order_by(t.c.id)))


@pytest.fixture(params=list(DRIVERS))
def raw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Raw]:
    driver = str(request.param)
    _import(driver, DRIVERS[driver][0])
    url = _url(DRIVERS[driver][1], tmp_path)
    table = f"p22_{uuid.uuid4().hex[:10]}"
    outbox = Outbox(url, table=table)
    outbox.install()
    meta = sa.MetaData()
    orders = sa.Table(f"{table}_orders", meta, sa.Column("id", sa.Integer, primary_key=True))
    meta.create_all(outbox.engine)
    try:
        yield Raw(driver, url, outbox, orders.name)
    finally:
        meta.drop_all(outbox.engine)
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


def relay_all(outbox: Outbox) -> list[Any]:
    """Publish everything pending through a relay to a memory queue of the test's own."""
    name = f"p22-{uuid.uuid4().hex[:8]}"
    relay = outbox.relay(f"memory://{name}")
    try:
        while relay.run_once().claimed:
            pass
    finally:
        relay.close()
    return get_queue(name).snapshot()


# -- commit, rollback, first statement --------------------------------------------------------


def test_committed_with_the_business_row_and_published_by_a_relay(raw: Raw) -> None:
    conn = raw.connect()
    try:
        raw.order(conn, 1)
        event_id = raw.outbox.enqueue(
            conn, "order.created", {"order": 1}, key="order-1", headers={"h": "v"}
        )
        assert raw.count() == 0  # not visible before the caller's commit
        conn.commit()
    finally:
        conn.close()
    assert raw.count(raw.orders) == 1
    published = relay_all(raw.outbox)
    assert [e.event_id for e in published] == [event_id]
    event = published[0]
    assert (event.topic, event.key, event.payload) == ("order.created", "order-1", {"order": 1})
    assert event.headers["h"] == "v"


def test_rolled_back_with_the_business_row(raw: Raw) -> None:
    conn = raw.connect()
    try:
        raw.order(conn, 1)
        raw.outbox.enqueue(conn, "order.created", {"order": 1})
        conn.rollback()
    finally:
        conn.close()
    assert (raw.count(raw.orders), raw.count()) == (0, 0)
    assert relay_all(raw.outbox) == []


def test_enqueue_may_be_the_first_statement_of_the_transaction(raw: Raw) -> None:
    conn = raw.connect()
    try:
        raw.outbox.enqueue(conn, "first", {"n": 1})  # begins the transaction
        raw.order(conn, 1)
        conn.rollback()
        assert (raw.count(raw.orders), raw.count()) == (0, 0)
        raw.outbox.enqueue(conn, "first", {"n": 2})  # and the next one
        raw.order(conn, 2)
        conn.commit()
    finally:
        conn.close()
    assert [e.payload for e in relay_all(raw.outbox)] == [{"n": 2}]
    assert raw.count(raw.orders) == 1


def test_enqueue_many_in_order_with_every_shape(raw: Raw) -> None:
    specs: list[dict[str, Any]] = []
    for i in range(1_200):
        spec: dict[str, Any] = {"topic": "bulk", "payload": {"i": i}, "key": f"k{i % 7}"}
        if i % 3 == 0:
            spec["headers"] = {"n": str(i)}
        if i % 500 == 1:
            spec["delay"] = 3600
        specs.append(spec)
    conn = raw.connect()
    try:
        raw.order(conn, 1)
        ids = raw.outbox.enqueue_many(conn, specs)
        conn.commit()
    finally:
        conn.close()
    rows = raw.events()
    assert [r.event_id for r in rows] == ids
    assert [r.payload for r in rows] == [s["payload"] for s in specs]
    assert [r.headers for r in rows][:4] == [{"n": "0"}, None, None, {"n": "3"}]
    published = relay_all(raw.outbox)
    assert len(published) == len(specs) - len([s for s in specs if "delay" in s])


def test_a_delayed_event_waits_and_text_survives(raw: Raw) -> None:
    conn = raw.connect()
    try:
        delayed = raw.outbox.enqueue(conn, "later", {"n": 1}, delay=3600)
        now = raw.outbox.enqueue(conn, "now", {"text": "Grüße, 100% ✓ 'quoted' %s ?"}, key="ü")
        conn.commit()
    finally:
        conn.close()
    rows = {r.event_id: r for r in raw.events()}
    later = rows[delayed]
    assert (later.available_at - later.created_at).total_seconds() == pytest.approx(3600, abs=5)
    published = relay_all(raw.outbox)
    assert [e.event_id for e in published] == [now]
    assert published[0].payload == {"text": "Grüße, 100% ✓ 'quoted' %s ?"}
    assert published[0].key == "ü"


# -- refused: autocommit, bad input, a missing table -------------------------------------------


def _autocommit(raw: Raw) -> Any:
    if raw.driver == "sqlite3":
        return raw.connect(isolation_level=None)
    conn = raw.connect()
    if raw.driver in ("pymysql", "mysqlclient"):
        conn.autocommit(True)
    else:
        conn.autocommit = True
    return conn


def test_autocommit_is_refused_before_anything_is_written(raw: Raw) -> None:
    conn = _autocommit(raw)
    try:
        with pytest.raises(ConfigurationError, match="autocommit mode") as err:
            raw.outbox.enqueue(conn, "t", {"n": 1})
        label = {"psycopg": "psycopg 3", "pymysql": "PyMySQL"}.get(raw.driver, raw.driver)
        assert f"this {label} connection" in str(err.value)
        with pytest.raises(ConfigurationError, match="autocommit mode"):
            raw.outbox.enqueue_many(conn, [{"topic": "t", "payload": 1}])
    finally:
        conn.close()
    assert raw.count() == 0


def test_autocommit_mode_inside_an_explicit_transaction_is_accepted(raw: Raw) -> None:
    if raw.driver == "mysqlclient":
        pytest.skip("mysqlclient reports no transaction state: autocommit mode is always refused")
    conn = _autocommit(raw)
    try:
        if raw.driver == "psycopg":
            with conn.transaction():
                raw.outbox.enqueue(conn, "t", {"n": 1})
                raw.order(conn, 1)
        else:
            if raw.driver == "pymysql":
                conn.begin()
            else:
                conn.cursor().execute("BEGIN")
            raw.outbox.enqueue(conn, "t", {"n": 1})
            conn.cursor().execute("ROLLBACK")
            assert raw.count() == 0
            conn.cursor().execute("BEGIN")
            raw.outbox.enqueue(conn, "t", {"n": 1})
            conn.cursor().execute("COMMIT")
    finally:
        conn.close()
    assert raw.count() == 1


def test_a_missing_table_raises_table_missing_and_the_transaction_stays_usable(
    raw: Raw,
) -> None:
    missing = Outbox(raw.url, table=f"p22_missing_{uuid.uuid4().hex[:6]}")
    conn = raw.connect()
    try:
        raw.order(conn, 1)
        with pytest.raises(TableMissing, match="outbox install"):
            missing.enqueue(conn, "t", {})
        with pytest.raises(TableMissing):
            missing.enqueue_many(conn, [{"topic": "t", "payload": 1}])
        raw.order(conn, 2)  # the caller's transaction goes on
        raw.outbox.enqueue(conn, "t", {"n": 1})
        conn.commit()
    finally:
        conn.close()
        missing.dispose()
    assert (raw.count(raw.orders), raw.count()) == (2, 1)


def test_bad_payloads_are_refused_and_the_transaction_stays_usable(raw: Raw) -> None:
    small = Outbox(raw.url, table=raw.outbox.table.name, max_payload_bytes=100)
    conn = raw.connect()
    try:
        raw.order(conn, 1)
        with pytest.raises(PayloadError, match="payload"):
            raw.outbox.enqueue(conn, "t", {"bad": object()})
        with pytest.raises(PayloadError, match="max_payload_bytes"):
            small.enqueue(conn, "t", {"big": "x" * 200})
        nested: Any = 1
        for _ in range(120):
            nested = [nested]
        with pytest.raises(PayloadError, match="nested"):
            raw.outbox.enqueue(conn, "t", {"deep": nested})
        with pytest.raises(PayloadError, match=r"events\[1\]"):
            raw.outbox.enqueue_many(
                conn, [{"topic": "t", "payload": 1}, {"topic": "t", "payload": {1j}}]
            )
        raw.outbox.enqueue(conn, "t", {"ok": True})
        conn.commit()
    finally:
        conn.close()
        small.dispose()
    assert [r.payload for r in raw.events()] == [{"ok": True}]
    assert raw.count(raw.orders) == 1


# -- wake-ups ----------------------------------------------------------------------------------


def test_in_process_relays_are_woken_after_the_commit_not_before(raw: Raw) -> None:
    if raw.driver == "mysqlclient":
        pytest.skip("mysqlclient reports no transaction state: its events are found by polling")
    relay = raw.outbox.relay("memory://p22-woken")
    woken = threading.Event()
    relay.wake = woken.set  # type: ignore[method-assign]
    conn = raw.connect()
    try:
        raw.outbox.enqueue(conn, "t", {"n": 1})
        raw.outbox.enqueue(conn, "t", {"n": 2})
        assert not woken.wait(0.2)  # the event is not visible yet
        conn.commit()
        assert woken.wait(2)
    finally:
        conn.close()
        relay.close()


@pytest.mark.parametrize("raw", ["psycopg", "psycopg2"], indirect=True)
def test_postgresql_notify_reaches_listeners_once_per_transaction(raw: Raw) -> None:
    import psycopg

    listener = psycopg.connect(
        host=raw.url.host, user=raw.url.username, dbname=raw.url.database, autocommit=True
    )
    channel = raw.outbox.dialect.enqueue.notify_channel()
    listener.execute(f'LISTEN "{channel}"')
    conn = raw.connect()
    try:
        for n in range(3):
            raw.outbox.enqueue(conn, "t", {"n": n})
        raw.outbox.enqueue_many(conn, [{"topic": "t", "payload": 1}] * 3)
        assert list(listener.notifies(timeout=0.2)) == []  # nothing before the commit
        conn.commit()
        got = list(listener.notifies(timeout=1, stop_after=5))
        assert [n.channel for n in got] == [channel]  # folded into one
    finally:
        conn.close()
        listener.close()


def test_the_commit_watch_forgets_a_closed_connection() -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x INT)")
    conn.execute("INSERT INTO t VALUES (1)")
    assert conn.in_transaction
    called = threading.Event()
    COMMIT_WATCH.watch(conn, lambda c: not c.in_transaction, called.set, owner=object())
    conn.close()  # in_transaction then raises: nothing left to wait for
    assert called.wait(2)


# -- what is accepted, what is not ------------------------------------------------------------


def test_errors_name_what_was_passed_and_what_is_accepted(tmp_path: Path) -> None:
    outbox = Outbox(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(ConfigurationError) as err:
        outbox.enqueue(object(), "t", {})
    message = str(err.value)
    assert "builtins.object" in message
    for accepted in ("SQLAlchemy Connection or Session", "psycopg 3", "psycopg2", "PyMySQL"):
        assert accepted in message
    assert "mysqlclient, sqlite3, pyodbc" in message
    with pytest.raises(ConfigurationError, match=r"builtins\.object.*asyncpg"):
        asyncio.run(outbox.enqueue_async(object(), "t", {}))


@pytest.mark.parametrize("raw", ["psycopg"], indirect=True)
def test_an_async_connection_given_to_enqueue_points_to_enqueue_async(raw: Raw) -> None:
    import psycopg

    async def main() -> None:
        conn = await psycopg.AsyncConnection.connect(
            host=raw.url.host, user=raw.url.username, dbname=raw.url.database
        )
        try:
            with pytest.raises(ConfigurationError, match=r"await enqueue_async\(conn"):
                raw.outbox.enqueue(conn, "t", {})
            with pytest.raises(ConfigurationError, match=r"await enqueue_many_async\(conn"):
                raw.outbox.enqueue_many(conn, [])
        finally:
            await conn.close()

    asyncio.run(main())


@pytest.mark.parametrize("raw", ["psycopg", "psycopg2", "pymysql", "mysqlclient"], indirect=True)
def test_a_connection_to_another_database_is_refused(raw: Raw, tmp_path: Path) -> None:
    other = Outbox(f"sqlite:///{tmp_path / 'other.db'}")
    conn = raw.connect()
    try:
        with pytest.raises(ConfigurationError, match="this outbox is on sqlite"):
            other.enqueue(conn, "t", {})
    finally:
        conn.close()


# -- asyncpg and psycopg async ----------------------------------------------------------------


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Raw]:
    url = _url("postgresql", tmp_path)
    table = f"p22_{uuid.uuid4().hex[:10]}"
    outbox = Outbox(url, table=table)
    outbox.install()
    meta = sa.MetaData()
    orders = sa.Table(f"{table}_orders", meta, sa.Column("id", sa.Integer, primary_key=True))
    meta.create_all(outbox.engine)
    try:
        yield Raw("psycopg", url, outbox, orders.name)
    finally:
        meta.drop_all(outbox.engine)
        outbox.tables.metadata.drop_all(outbox.engine)
        outbox.dispose()


def _asyncpg_dsn(url: sa.URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def test_asyncpg_inside_a_transaction(pg: Raw) -> None:
    asyncpg = _import("asyncpg", "asyncpg")
    relay = pg.outbox.relay("memory://p22-asyncpg-woken")
    woken = threading.Event()
    relay.wake = woken.set  # type: ignore[method-assign]

    async def main() -> list[str]:
        conn = await asyncpg.connect(_asyncpg_dsn(pg.url))
        try:
            async with conn.transaction():
                await conn.execute(f"INSERT INTO {pg.orders} (id) VALUES (1)")
                first = await pg.outbox.enqueue_async(conn, "t", {"n": 1}, key="k", headers={})
                more = await pg.outbox.enqueue_many_async(
                    conn, [{"topic": "t", "payload": {"n": i}, "delay": i} for i in (2, 3)]
                )
                await asyncio.sleep(0.1)
                assert not woken.is_set()
            with pytest.raises(RuntimeError, match="rolled back"):
                async with conn.transaction():
                    await pg.outbox.enqueue_async(conn, "t", {"n": 4})
                    raise RuntimeError("rolled back")
            return [first, *more]
        finally:
            await conn.close()

    try:
        ids = asyncio.run(main())
        assert woken.wait(2)
    finally:
        relay.close()
    assert [r.event_id for r in pg.events()] == ids
    assert [r.payload for r in pg.events()] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert pg.count(pg.orders) == 1


def test_asyncpg_outside_a_transaction_is_refused(pg: Raw) -> None:
    asyncpg = _import("asyncpg", "asyncpg")

    async def main() -> None:
        conn = await asyncpg.connect(_asyncpg_dsn(pg.url))
        try:
            with pytest.raises(ConfigurationError, match="asyncpg connection is in autocommit"):
                await pg.outbox.enqueue_async(conn, "t", {})
            with pytest.raises(ConfigurationError, match=r"async with conn\.transaction\(\)"):
                await pg.outbox.enqueue_many_async(conn, [{"topic": "t", "payload": 1}])
            with pytest.raises(ConfigurationError, match=r"asyncpg.*await enqueue_async\(conn"):
                pg.outbox.enqueue(conn, "t", {})  # sync enqueue: refused, pointing to async
        finally:
            await conn.close()

    asyncio.run(main())
    assert pg.count() == 0


def test_asyncpg_pool_connections_are_accepted(pg: Raw) -> None:
    asyncpg = _import("asyncpg", "asyncpg")

    async def main() -> None:
        pool = await asyncpg.create_pool(_asyncpg_dsn(pg.url), min_size=1, max_size=1)
        try:
            async with pool.acquire() as conn, conn.transaction():
                await pg.outbox.enqueue_async(conn, "t", {"pool": True})
                await pg.outbox.enqueue_async(conn, "t", {"text": "100% ✓ $1"}, delay=60)
        finally:
            await pool.close()

    asyncio.run(main())
    assert [r.payload for r in pg.events()] == [{"pool": True}, {"text": "100% ✓ $1"}]
    later = pg.events()[1]
    assert (later.available_at - later.created_at).total_seconds() == pytest.approx(60, abs=5)


def test_psycopg_async_connection(pg: Raw) -> None:
    import psycopg

    async def main() -> None:
        conn = await psycopg.AsyncConnection.connect(
            host=pg.url.host, user=pg.url.username, dbname=pg.url.database
        )
        try:
            await pg.outbox.enqueue_async(conn, "t", {"n": 1})  # the transaction's first statement
            await pg.outbox.enqueue_many_async(conn, [{"topic": "t", "payload": {"n": 2}}])
            await conn.rollback()
            await pg.outbox.enqueue_async(conn, "t", {"n": 3})
            await conn.commit()
            await conn.set_autocommit(True)
            with pytest.raises(ConfigurationError, match="psycopg 3 async connection"):
                await pg.outbox.enqueue_async(conn, "t", {"n": 4})
            async with conn.transaction():
                await pg.outbox.enqueue_async(conn, "t", {"n": 5})
        finally:
            await conn.close()

    asyncio.run(main())
    assert [e.payload for e in relay_all(pg.outbox)] == [{"n": 3}, {"n": 5}]


# -- pyodbc, by the SQL its cursor gets ------------------------------------------------------


class _OdbcCursor:
    def __init__(self, calls: list[tuple[str, str, Any]]) -> None:
        self.calls = calls

    def execute(self, sql: str, params: Any) -> None:
        self.calls.append(("execute", sql, params))

    def executemany(self, sql: str, rows: Any) -> None:
        self.calls.append(("executemany", sql, rows))

    def close(self) -> None:
        pass


@pytest.fixture
def pyodbc_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in ``pyodbc`` module (no ODBC driver manager nor SQL Server here)."""

    class Connection:
        def __init__(self) -> None:
            self.autocommit = False
            self.calls: list[tuple[str, str, Any]] = []

        def cursor(self) -> _OdbcCursor:
            return _OdbcCursor(self.calls)

    module = types.ModuleType("pyodbc")
    module.Connection = Connection  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyodbc", module)
    return module


def test_pyodbc_gets_qmark_sql_and_positional_parameters(pyodbc_module: Any) -> None:
    outbox = Outbox("mssql+pyodbc://sa@nowhere/db?driver=x", table="p22_orders_outbox")
    conn = pyodbc_module.Connection()
    port = transaction_port(conn, "enqueue", outbox.dialect.name)
    assert isinstance(port, DBAPITransaction)
    event = build_new_event("t", {"a": 1}, key="k", headers={"h": "v"})
    statement, params = outbox.dialect.enqueue.call(event, notify=True)
    port.execute(statement, params)
    kind, sql, args = conn.calls[0]
    assert kind == "execute"
    assert sql.startswith("INSERT INTO p22_orders_outbox (event_id, topic, [key], payload")
    assert "?" in sql and ":o_" not in sql and "%s" not in sql
    assert args[:3] == [event.event_id, "t", "k"]
    assert json.loads(args[3]) == {"a": 1} and json.loads(args[4]) == {"h": "v"}
    events = [build_new_event("t", {"i": i}) for i in range(3)]
    for statement, params in outbox.dialect.enqueue.many_calls(
        events, notify=False, driver=port.driver
    ):
        port.execute(statement, params)
    assert [c[0] for c in conn.calls[1:]] == ["execute", "executemany"]
    assert "OUTPUT" not in conn.calls[2][1]  # a plain executemany, no SQLAlchemy folding
    assert [json.loads(row[3]) for row in conn.calls[2][2]] == [{"i": 1}, {"i": 2}]
    conn.autocommit = True
    with pytest.raises(ConfigurationError, match="pyodbc connection is in autocommit"):
        transaction_port(conn, "enqueue", outbox.dialect.name)
    outbox.dispose()


def test_ports_never_import_a_driver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Telling connections apart imports no driver module that was not already imported."""
    for name in ("psycopg2", "psycopg2.extensions", "MySQLdb", "MySQLdb.connections", "pyodbc"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = set(sys.modules)
    outbox = Outbox(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(ConfigurationError):
        outbox.enqueue(object(), "t", {})
    assert not {"psycopg2", "MySQLdb", "pyodbc"} & (set(sys.modules) - before)


# -- as the README shows it --------------------------------------------------------------------


def test_readme_psycopg_connection_block(pg: Raw) -> None:
    import psycopg

    dsn = f"host={pg.url.host} user={pg.url.username} dbname={pg.url.database}"
    with psycopg.connect(dsn) as conn:  # commits on success
        conn.execute(f"INSERT INTO {pg.orders} (id) VALUES (42)")
        pg.outbox.enqueue(conn, "order.created", {"order_id": 42}, key="order-42")
    with pytest.raises(RuntimeError), psycopg.connect(dsn) as conn:  # rolls back on error
        conn.execute(f"INSERT INTO {pg.orders} (id) VALUES (43)")
        pg.outbox.enqueue(conn, "order.created", {"order_id": 43}, key="order-43")
        raise RuntimeError("business error")
    assert [r.payload for r in pg.events()] == [{"order_id": 42}]
    assert pg.count(pg.orders) == 1


def test_a_port_with_a_framework_commit_hook(raw: Raw) -> None:
    """``DBAPITransaction(conn, after_commit=hook)`` in place of the connection."""
    relay = raw.outbox.relay("memory://p22-hook")
    woken = threading.Event()
    relay.wake = woken.set  # type: ignore[method-assign]
    hooked: list[Any] = []
    conn = raw.connect()
    try:
        port = DBAPITransaction(conn, after_commit=hooked.append)
        raw.outbox.enqueue(port, "t", {"n": 1})
        raw.outbox.enqueue_many(port, [{"topic": "t", "payload": 2}])
        conn.commit()
        assert len(hooked) == 2  # the framework's hook, not the commit watch
        assert not woken.wait(0.1)
        hooked[-1]()  # what the framework does at commit
        assert woken.is_set()
    finally:
        conn.close()
        relay.close()
    assert raw.count() == 2


def test_mysqlclient_gets_format_sql_and_positional_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """mysqlclient by its SQL, where it is not installed (it builds from source)."""

    class Connection:
        def __init__(self) -> None:
            self.autocommit_on = False
            self.calls: list[tuple[str, str, Any]] = []

        def get_autocommit(self) -> bool:
            return self.autocommit_on

        def cursor(self) -> _OdbcCursor:
            return _OdbcCursor(self.calls)

    module = types.ModuleType("MySQLdb.connections")
    module.Connection = Connection  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "MySQLdb.connections", module)
    outbox = Outbox("mysql+pymysql://root@nowhere/db", table="p22_my")
    conn = Connection()
    port = transaction_port(conn, "enqueue", outbox.dialect.name)
    event = build_new_event("t", {"a": "100%"}, key="k")
    statement, params = outbox.dialect.enqueue.call(event, notify=True)
    port.execute(statement, params)
    _, sql, args = conn.calls[0]
    assert sql.startswith("INSERT INTO p22_my (event_id, topic, `key`, payload, headers")
    assert "%s" in sql and "%(" not in sql
    assert args[:3] == [event.event_id, "t", "k"] and json.loads(args[3]) == {"a": "100%"}
    conn.autocommit_on = True
    with pytest.raises(ConfigurationError, match="mysqlclient connection is in autocommit"):
        transaction_port(conn, "enqueue", outbox.dialect.name)
    outbox.dispose()


def test_a_sqlalchemy_async_connection_given_to_enqueue_points_to_enqueue_async(
    tmp_path: Path,
) -> None:
    pytest.importorskip("aiosqlite")
    from sqlalchemy.ext.asyncio import create_async_engine

    outbox = Outbox(f"sqlite:///{tmp_path / 'x.db'}")
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")

    async def main() -> None:
        async with engine.connect() as conn:
            with pytest.raises(ConfigurationError, match=r"AsyncConnection\): await enqueue_async"):
                outbox.enqueue(conn, "t", {})
        await engine.dispose()

    asyncio.run(main())


def test_sqlite_autocommit_attribute_of_python_3_12(tmp_path: Path) -> None:
    """``autocommit=True`` / ``False`` (Python 3.12+) decide over ``isolation_level``."""

    class Connection(sqlite3.Connection):
        autocommit: Any

    outbox = Outbox(f"sqlite:///{tmp_path / 'x.db'}")
    conn = sqlite3.connect(":memory:", factory=Connection)
    try:
        conn.autocommit = True
        with pytest.raises(ConfigurationError, match="sqlite3 connection is in autocommit"):
            transaction_port(conn, "enqueue", "sqlite")
        conn.autocommit = False  # PEP 249 mode: always in a transaction
        conn.isolation_level = None
        assert isinstance(transaction_port(conn, "enqueue", "sqlite"), DBAPITransaction)
    finally:
        conn.close()
        outbox.dispose()


def test_enqueue_many_async_on_a_sqlalchemy_async_session(tmp_path: Path) -> None:
    pytest.importorskip("aiosqlite")
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    outbox = Outbox(f"sqlite:///{tmp_path / 'x.db'}")
    outbox.install()
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")

    async def main() -> list[str]:
        async with AsyncSession(engine) as session:
            async with session.begin():
                ids = await outbox.enqueue_many_async(
                    session, [{"topic": "t", "payload": i} for i in range(3)]
                )
            async with session.begin():
                await outbox.enqueue_many_async(session, [{"topic": "t", "payload": 9}])
                await session.rollback()
        await engine.dispose()
        return ids

    ids = asyncio.run(main())
    assert [e.event_id for e in relay_all(outbox)] == ids
    outbox.dispose()


def test_psycopg_pipeline_mode_on_an_autocommit_connection_is_refused(pg: Raw) -> None:
    """In pipeline mode a statement in flight shows ACTIVE, not a transaction: at the next
    sync it would commit on its own, whatever the business write does after it."""
    conn = connect("psycopg", pg.url, autocommit=True)
    try:
        with conn.pipeline() as pipeline:
            conn.execute(f"INSERT INTO {pg.orders} (id) VALUES (1)")
            with pytest.raises(ConfigurationError, match="autocommit"):
                pg.outbox.enqueue(conn, "order.created", {"id": 1})
            pipeline.sync()
        with conn.transaction():  # an explicit transaction block is still accepted
            pg.outbox.enqueue(conn, "order.created", {"id": 2})
    finally:
        conn.close()
    assert [e.payload for e in pg.events()] == [{"id": 2}]
