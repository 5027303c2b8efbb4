"""Schema DDL per dialect, identifier validation, registries, versions."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from outbox_core import InvalidIdentifier, Outbox, UnknownBroker, UnknownDialect
from outbox_core.brokers.base import create_broker, known_schemes
from outbox_core.dialects.base import get_dialect, known_dialects
from outbox_core.dialects.mysql import check_version
from outbox_core.errors import UnsupportedDatabase
from outbox_core.schema import OutboxTables
from outbox_core.urls import install_command, sync_url


@pytest.mark.parametrize(
    "dialect, expected",
    [
        (
            "postgresql",
            ["event_id UUID", "payload JSONB", "TIMESTAMP WITH TIME ZONE", "WHERE state = 0"],
        ),
        ("mysql", ["event_id CHAR(36)", "payload JSON", "DATETIME(6)", "`key` VARCHAR(255)"]),
        ("mssql", ["IDENTITY", "NVARCHAR(max)", "DATETIME2(6)", "WHERE state = 0"]),
        ("sqlite", ["AUTOINCREMENT", "WHERE state = 0"]),
    ],
)
def test_ddl_per_dialect(dialect: str, expected: list[str]) -> None:
    ddl = OutboxTables.create().ddl(dialect)
    for fragment in expected:
        assert fragment in ddl
    assert "CREATE UNIQUE INDEX ux_outbox_event_id" in ddl
    assert "CREATE TABLE outbox_inbox" in ddl
    assert "lease_until)" not in ddl  # no index on leases: the reaper reads the few leased rows


@pytest.mark.parametrize("dialect", ["postgresql", "mssql", "sqlite"])
def test_partial_indexes_keep_sent_rows_out_of_every_work_index(dialect: str) -> None:
    ddl = OutboxTables.create().ddl(dialect)
    quoted = {"postgresql": "key", "mssql": "[key]", "sqlite": '"key"'}[dialect]
    assert "CREATE INDEX ix_outbox_pending ON outbox (id) WHERE state = 0" in ddl
    assert f"CREATE INDEX ix_outbox_pending_key ON outbox ({quoted}, id) WHERE state = 0" in ddl
    assert f"CREATE INDEX ix_outbox_leased ON outbox ({quoted}, id) WHERE state = 1" in ddl
    assert f"CREATE INDEX ix_outbox_dead ON outbox ({quoted}, id) WHERE state = 3" in ddl
    assert "(state, id)" not in ddl and "(state, key, id)" not in ddl


def test_mysql_work_indexes_lead_with_state_and_no_partial_ones() -> None:
    ddl = OutboxTables.create().ddl("mysql")
    assert "CREATE INDEX ix_outbox_state_id ON outbox (state, id)" in ddl
    assert "CREATE INDEX ix_outbox_state_key_id ON outbox (state, `key`, id)" in ddl
    assert "ix_outbox_pending" not in ddl and "WHERE" not in ddl


@pytest.mark.parametrize("name", ["x; drop table y", "1abc", "a-b", "", "a" * 49, "outbox\n"])
def test_bad_table_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidIdentifier, match="invalid table name"):
        OutboxTables.create(name)


def test_custom_table_and_schema_names() -> None:
    tables = OutboxTables.create("events", schema="app")
    assert tables.outbox.fullname == "app.events"
    assert tables.inbox.fullname == "app.events_inbox"


def test_unknown_dialect_lists_the_known_ones() -> None:
    with pytest.raises(UnknownDialect) as err:
        get_dialect("oracle")
    for name in ("postgresql", "mysql", "mssql", "sqlite"):
        assert name in str(err.value)
    assert set(known_dialects()) >= {"postgresql", "mysql", "mariadb", "mssql", "sqlite"}


def test_unknown_broker_scheme_lists_the_known_ones() -> None:
    with pytest.raises(UnknownBroker) as err:
        create_broker("sqs://user:secret@host/")
    message = str(err.value)
    assert "sqs://" in message
    assert "secret" not in message
    for scheme in ("amqp", "http", "kafka", "memory", "python"):
        assert f"{scheme}://" in message
    assert "memory" in known_schemes()


def test_dialect_comes_from_the_url_and_can_be_overridden() -> None:
    assert Outbox("postgresql+psycopg://u@h/db").dialect.name == "postgresql"
    assert Outbox("mariadb+pymysql://u@h/db").dialect.name == "mysql"
    assert Outbox("mssql+pyodbc://u:p@dsn").dialect.name == "mssql"
    assert Outbox("sqlite:///x.db").dialect.name == "sqlite"
    assert Outbox("sqlite:///x.db", dialect="postgresql").dialect.name == "postgresql"
    with pytest.raises(UnknownDialect):
        Outbox("sqlite:///x.db", dialect="db2")


def test_async_and_bare_urls_map_to_the_shipped_sync_drivers() -> None:
    assert sync_url("postgresql://h/db").drivername == "postgresql+psycopg"
    assert sync_url("postgresql+asyncpg://h/db").drivername == "postgresql+psycopg"
    assert sync_url("mysql://h/db").drivername == "mysql+pymysql"
    assert sync_url("sqlite+aiosqlite:///x.db").drivername == "sqlite"


def test_install_command_names_the_extra_of_a_driver_or_a_broker_scheme() -> None:
    assert install_command("psycopg") == "pip install 'outbox-toolkit[postgresql]'"
    assert install_command("aiosqlite") == "pip install 'outbox-toolkit[sqlite-async]'"
    assert install_command("amqps") == "pip install 'outbox-toolkit[rabbitmq]'"
    assert install_command("db2") is None


def test_the_producer_says_once_it_read_the_server_on_the_fallback_engine(
    tmp_path: Path,
) -> None:
    db = tmp_path / "x.db"
    outbox = Outbox(f"sqlite:///{db}")
    outbox.install()
    assert not outbox.producer.fallback_checked
    conn = sqlite3.connect(db)  # a DB-API connection: no SQLAlchemy engine of its own
    try:
        outbox.enqueue(conn, "order.created", {"id": 1})
        conn.commit()
    finally:
        conn.close()
    assert outbox.producer.fallback_checked
    outbox.dispose()


def test_repr_masks_the_password() -> None:
    assert "hunter2" not in repr(Outbox("postgresql+psycopg://app:hunter2@db/app"))


@pytest.mark.parametrize(
    "mariadb, version, needed",
    [(True, (10, 5, 22), "10.6"), (False, (5, 7, 44), "8.0.1"), (False, (8, 0, 0), "8.0.1")],
)
def test_mysql_family_without_skip_locked_is_refused(
    mariadb: bool, version: tuple[int, ...], needed: str
) -> None:
    with pytest.raises(UnsupportedDatabase) as err:
        check_version(mariadb, version)
    found = ".".join(map(str, version))
    assert found in str(err.value)
    assert needed in str(err.value)
    assert "SKIP LOCKED" in str(err.value)


@pytest.mark.parametrize(
    "mariadb, version", [(True, (10, 6, 0)), (True, (11, 4)), (False, (8, 0, 1))]
)
def test_mysql_family_with_skip_locked_is_accepted(mariadb: bool, version: tuple[int, ...]) -> None:
    check_version(mariadb, version)
