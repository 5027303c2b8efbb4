"""The inbox's native insert-if-absent per dialect, compiled without a server; validation."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql, mysql, postgresql, sqlite

from outbox_core import ConfigurationError, EventError, Outbox
from outbox_core.dialects.base import Dialect, get_dialect
from outbox_core.inbox import MAX_CONSUMER, Inbox, normalize_event_id, validate_consumer
from outbox_core.schema import OutboxTables

EVENT_ID = "0b7c6f2e-5a1d-4c1e-9a57-3f1d2c4b5a69"


def compiled(stmt: sa.ClauseElement, dialect: sa.Dialect) -> str:
    return " ".join(str(stmt.compile(dialect=dialect)).split())


def make(name: str) -> Dialect:
    return get_dialect(name)(OutboxTables.create("events"))


def test_postgresql_inserts_on_conflict_do_nothing() -> None:
    sql = compiled(make("postgresql").inbox.insert("billing", EVENT_ID), postgresql.dialect())
    assert sql.startswith("INSERT INTO events_inbox (consumer, event_id, processed_at) VALUES")
    assert sql.endswith("ON CONFLICT (consumer, event_id) DO NOTHING")
    assert "statement_timestamp()" in sql


@pytest.mark.parametrize("name", ["mysql", "mariadb"])
def test_mysql_and_mariadb_insert_ignore(name: str) -> None:
    sql = compiled(make(name).inbox.insert("billing", EVENT_ID), mysql.dialect())
    assert sql.startswith("INSERT IGNORE INTO events_inbox (consumer, event_id, processed_at)")
    assert "utc_timestamp" in sql.lower()
    assert "ON DUPLICATE KEY" not in sql


def test_mssql_inserts_if_absent_under_updlock_holdlock() -> None:
    sql = compiled(make("mssql").inbox.insert("billing", EVENT_ID), mssql.dialect())
    assert sql.startswith("INSERT INTO events_inbox (consumer, event_id, processed_at) SELECT")
    # The existence check holds a key-range update lock until commit: race-safe.
    assert (
        "WHERE NOT (EXISTS (SELECT 1 FROM events_inbox WITH (UPDLOCK, HOLDLOCK) "
        "WHERE events_inbox.consumer = :consumer_1 AND events_inbox.event_id = :event_id_1))"
    ) in sql
    assert "sysutcdatetime()" in sql


def test_sqlite_inserts_on_conflict_do_nothing() -> None:
    sql = compiled(make("sqlite").inbox.insert("billing", EVENT_ID), sqlite.dialect())
    assert sql.startswith("INSERT INTO events_inbox (consumer, event_id, processed_at) VALUES")
    assert sql.endswith("ON CONFLICT (consumer, event_id) DO NOTHING")


def test_the_statement_keeps_the_rowcount_and_the_schema() -> None:
    inbox = Inbox("sqlite://", table="events", schema="app")
    stmt = inbox.insert_statement("billing", EVENT_ID.upper())
    assert stmt.get_execution_options()["preserve_rowcount"] is True
    assert "INTO app.events_inbox" in compiled(stmt, sqlite.dialect())
    params = stmt.compile(dialect=sqlite.dialect()).params
    assert params["event_id"] == EVENT_ID  # normalised


@pytest.mark.parametrize(
    "consumer", ["", "   ", " billing", "billing ", "bill\ning", "x" * (MAX_CONSUMER + 1), None, 7]
)
def test_bad_consumer_names_are_refused(consumer: object) -> None:
    with pytest.raises(ConfigurationError, match="inbox consumer"):
        validate_consumer(consumer)  # type: ignore[arg-type]


def test_good_consumer_names() -> None:
    for name in ["billing", "x" * MAX_CONSUMER, "billing-service.v2/eu", "facturación"]:
        assert validate_consumer(name) == name


@pytest.mark.parametrize(
    ("event_id", "match"),
    [
        (None, "missing"),
        ("", "not a UUID"),
        ("order-42", "not a UUID"),
        ("0b7c6f2e-5a1d-4c1e-9a57-3f1d2c4b5a6", "not a UUID"),
        ("x" * 500, r"\.\.\.' is not a UUID"),
        (42, "must be a UUID string"),
        (b"0b7c6f2e5a1d4c1e9a573f1d2c4b5a69", "must be a UUID string"),
    ],
)
def test_bad_event_ids_are_refused(event_id: object, match: str) -> None:
    with pytest.raises(EventError, match=match):
        normalize_event_id(event_id)  # type: ignore[arg-type]


def test_event_ids_are_normalised() -> None:
    u = uuid.UUID(EVENT_ID)
    for form in [EVENT_ID, EVENT_ID.upper(), u.hex, "{" + EVENT_ID + "}", f"urn:uuid:{EVENT_ID}"]:
        assert normalize_event_id(form) == EVENT_ID
    assert normalize_event_id(u) == EVENT_ID


def test_bad_input_writes_nothing_and_needs_a_connection(tmp_path: Path) -> None:
    outbox = Outbox(f"sqlite:///{tmp_path}/inbox.db", table="t")
    outbox.install()
    inbox = Inbox(outbox)
    try:
        with outbox.engine.begin() as conn:
            with pytest.raises(EventError):
                inbox.record(conn, "billing", "nope")
            with pytest.raises(ConfigurationError):
                inbox.record(conn, "", EVENT_ID)
            assert conn.execute(sa.select(sa.func.count()).select_from(inbox.table)).scalar() == 0
        with pytest.raises(ConfigurationError, match="Connection or Session"):
            inbox.record(outbox.engine, "billing", EVENT_ID)  # type: ignore[arg-type]
    finally:
        outbox.dispose()


def test_an_inbox_of_an_outbox_shares_its_tables() -> None:
    outbox = Outbox("sqlite://", table="events", schema="app")
    inbox = Inbox.for_outbox(outbox)
    assert inbox.outbox is outbox and inbox.table is outbox.tables.inbox
    assert Inbox(outbox).table.fullname == "app.events_inbox"
    with pytest.raises(ConfigurationError, match="outbox's table"):
        Inbox(outbox, table="other")
    assert Inbox("sqlite://").table.name == "outbox_inbox"


def test_cleanup_arguments_are_checked() -> None:
    inbox = Inbox("sqlite://")
    with pytest.raises(ConfigurationError):
        inbox.cleanup(older_than=-1)
    with pytest.raises(ConfigurationError):
        inbox.cleanup(older_than=10, batch=0)


class RecordingConnection:
    """Stands in for a Connection inside a caller's transaction: records statements."""

    def __init__(self, rows: list[tuple[str, str]]) -> None:
        self.rows = rows
        self.statements: list[sa.Executable] = []

    def in_transaction(self) -> bool:
        return True  # the dialect joins it instead of opening one

    def execute(self, stmt: sa.Executable) -> object:
        self.statements.append(stmt)
        if len(self.statements) == 1:
            return iter(self.rows)
        return type("Result", (), {"rowcount": len(self.rows)})()


@pytest.mark.parametrize(
    ("name", "dialect", "top"),
    [
        ("mssql", mssql.dialect(), "SELECT TOP __[POSTCOMPILE_param_1]"),
        ("mysql", mysql.dialect(), "LIMIT %s"),
        ("postgresql", postgresql.dialect(), "LIMIT %(param_2)s"),
        ("sqlite", sqlite.dialect(), "LIMIT ?"),
    ],
)
def test_inbox_cleanup_picks_keys_then_deletes_by_primary_key(
    name: str, dialect: sa.Dialect, top: str
) -> None:
    other = str(uuid.uuid4())
    conn = RecordingConnection([("billing", EVENT_ID), ("billing", other), ("shipping", other)])
    deleted = make(name).inbox.cleanup(conn, older_than=86400, batch=3)  # type: ignore[arg-type]
    assert deleted == 3
    pick, delete = (compiled(s, dialect) for s in conn.statements)
    assert pick.startswith("SELECT ") and top in pick
    assert "ORDER BY events_inbox.processed_at" in pick
    # No row-value IN (SQL Server has none), no LIMIT in a subquery (MySQL refuses it):
    # one (consumer = ? AND event_id IN (...)) per consumer.
    assert delete.startswith("DELETE FROM events_inbox WHERE events_inbox.consumer = ")
    assert delete.count("events_inbox.event_id IN") == 2 and " OR " in delete
    assert "SELECT" not in delete
