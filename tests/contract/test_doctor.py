"""``outbox doctor`` on every reachable database: healthy, broken, and what it tells you.

The command object is run in-process with click's runner (``outbox doctor``
is the same command once registered on the ``outbox`` group).
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from outbox_core import Outbox, State
from outbox_core.cli import doctor_command
from outbox_core.doctor import Finding, Severity, diagnose, expected_indexes, render_report
from outbox_core.schema import OutboxTables


def doctor(*args: str) -> Result:
    return CliRunner().invoke(doctor_command, list(args), catch_exceptions=False)


def doctor_json(*args: str) -> tuple[int, dict[str, Any]]:
    result = doctor(*args, "--json")
    return result.exit_code, json.loads(result.output)


def by_check(report: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["check"] == check]


def test_a_fresh_install_is_healthy(backend: str, outbox: Outbox, db_url: str) -> None:
    table = outbox.table.name
    result = doctor("--db", db_url, "--table", table)
    if backend in ("postgresql", "mysql") and "WARNING  long_transactions" in result.output:
        # Database-wide, not about this install: another client of the shared test server.
        result = doctor("--db", db_url, "--table", table, "--long-transaction", "1h")
    assert result.exit_code == 0, result.output
    assert "0 error(s), 0 warning(s)" in result.output
    assert result.output.startswith(f"outbox doctor: {db_url}, table {table} (")
    code, report = doctor_json(
        "--db", db_url, "--table", table, "--strict", "--long-transaction", "1h"
    )
    assert code == 0 and report["healthy"] is True, report
    assert {f["severity"] for f in report["findings"]} == {"ok"}
    checks = {f["check"] for f in report["findings"]}
    assert {"version", "isolation", "tables", "index", "backlog", "dead_events"} <= checks
    if backend == "postgresql":
        assert {"dead_tuples", "long_transactions"} <= checks
    if backend == "mysql":
        assert "long_transactions" in checks
    if backend == "sqlite":
        assert by_check(report, "journal_mode")[0]["details"]["journal_mode"] == "wal"
    if backend == "mysql":
        [isolation] = by_check(report, "isolation")
        assert isolation["details"]["relay"] == "READ COMMITTED"
        assert "the relay sets READ COMMITTED" in isolation["message"]


def test_a_missing_index_is_an_error_with_its_create_index(
    backend: str, outbox: Outbox, db_url: str
) -> None:
    table = outbox.table.name
    partial = outbox.dialect.partial_indexes
    name, columns = (
        (f"ix_{table}_pending", "(id)") if partial else (f"ix_{table}_state_id", "(state, id)")
    )
    index = next(i for i in outbox.table.indexes if i.name == name)
    with outbox.engine.begin() as conn:
        index.drop(conn)
    result = doctor("--db", db_url, "--table", table)
    assert result.exit_code == 1, result.output
    assert f"ERROR    index              missing index {name}" in result.output
    code, report = doctor_json("--db", db_url, "--table", table)
    assert code == 1 and report["healthy"] is False
    [finding] = [f for f in by_check(report, "index") if f["severity"] != "ok"]
    assert finding["severity"] == "error"
    assert finding["message"].startswith(f"missing index {name} on {table} {columns}")
    assert "`outbox install` creates it" in finding["message"]
    fix = finding["fix"]
    assert fix.startswith(f"CREATE INDEX {name} ON ") and fix.endswith(";")
    assert columns in fix and (("WHERE state = 0" in fix) is partial)
    # The fix is exact: run it and the doctor is satisfied.
    with outbox.engine.begin() as conn:
        conn.exec_driver_sql(fix.rstrip(";"))
    assert doctor("--db", db_url, "--table", table).exit_code == 0


def test_an_obsolete_index_is_a_warning_with_its_drop_index(
    backend: str, outbox: Outbox, db_url: str
) -> None:
    """A table from an earlier version: the doctor names the index to drop and how."""
    table = outbox.table.name
    name = f"ix_{table}_state_lease"
    copy = sa.Table(table, sa.MetaData(), sa.Column("state"), sa.Column("lease_until"))
    with outbox.engine.begin() as conn:
        sa.Index(name, copy.c.state, copy.c.lease_until).create(conn)
    _, report = doctor_json("--db", db_url, "--table", table)
    [finding] = [f for f in by_check(report, "index") if f["severity"] != "ok"]
    assert finding["severity"] == "warning"
    assert finding["message"].startswith(f"obsolete index {name} on {table}")
    assert "`outbox install` drops it" in finding["message"]
    fix = finding["fix"]
    assert fix.startswith(f"DROP INDEX {name}") and fix.endswith(";")
    with outbox.engine.begin() as conn:
        conn.exec_driver_sql(fix.rstrip(";"))
    _, report = doctor_json("--db", db_url, "--table", table)
    assert [f["severity"] for f in by_check(report, "index")] == ["ok"]


def test_a_missing_inbox_index_is_a_warning(backend: str, outbox: Outbox, db_url: str) -> None:
    inbox = outbox.tables.inbox
    [index] = inbox.indexes
    with outbox.engine.begin() as conn:
        index.drop(conn)
    code, report = doctor_json("--db", db_url, "--table", outbox.table.name)
    assert code == 0
    [finding] = [f for f in by_check(report, "index") if f["severity"] != "ok"]
    assert finding["severity"] == "warning" and "processed_at" in finding["fix"]
    assert doctor("--db", db_url, "--table", outbox.table.name, "--strict").exit_code == 1


def test_dead_events_and_an_old_backlog_are_reported(
    backend: str, outbox: Outbox, db_url: str
) -> None:
    t = outbox.table
    with outbox.engine.begin() as conn:
        ids = [outbox.enqueue(conn, "order.created", {"n": i}) for i in range(3)]
        ids += [outbox.enqueue(conn, "invoice.sent", {"n": 9})]
        outbox.enqueue(conn, "later", {"n": 1}, delay=3600)  # not due: not a backlog
        conn.execute(
            sa.update(t)
            .where(t.c.event_id.in_(ids[:2] + ids[3:]))
            .values(state=int(State.DEAD), last_error="broker rejected: NO_ROUTE")
        )
        conn.execute(
            sa.update(t)
            .where(t.c.event_id == ids[2])
            .values(available_at=outbox.dialect.after(-2 * 3600))
        )
    args = ("--db", db_url, "--table", t.name, "--max-backlog-age", "30m")
    code, report = doctor_json(*args)
    assert code == 0, report  # warnings only
    [backlog] = by_check(report, "backlog")
    assert backlog["severity"] == "warning"
    assert (
        "the oldest due event has waited 2.0h for a relay (threshold 30.0m)" in (backlog["message"])
    )
    assert backlog["details"]["pending"] == 2 and backlog["details"]["due"] == 1
    assert "outbox relay" in backlog["fix"]
    [dead] = by_check(report, "dead_events")
    assert dead["severity"] == "warning"
    assert dead["details"]["topics"][0] == {
        "topic": "order.created",
        "count": 2,
        "last_error": "broker rejected: NO_ROUTE",
    }
    assert "outbox replay --topic order.created" in dead["fix"]
    assert doctor(*args, "--strict").exit_code == 1
    text = doctor(*args).output
    assert "WARNING  backlog" in text and "WARNING  dead_events" in text
    # A generous threshold: the same backlog is fine.
    code, report = doctor_json("--db", db_url, "--table", t.name, "--max-backlog-age", "3h")
    assert by_check(report, "backlog")[0]["severity"] == "ok"


def test_a_long_transaction_is_reported(backend: str, outbox: Outbox, db_url: str) -> None:
    """PostgreSQL: pg_stat_activity (it holds back vacuum); MySQL: innodb_trx (purge)."""
    if backend not in ("postgresql", "mysql"):
        pytest.skip("pg_stat_activity / information_schema.innodb_trx")
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as holder:
            holder.begin()
            if backend == "postgresql":
                me = holder.execute(sa.select(sa.func.pg_backend_pid())).scalar_one()
                holder.execute(sa.select(sa.func.txid_current()))  # holds an xid: vacuum waits
            else:
                me = holder.execute(sa.select(sa.func.connection_id())).scalar_one()
                holder.execute(sa.select(sa.func.count()).select_from(outbox.table))
            time.sleep(2.2)
            code, report = doctor_json(
                "--db", db_url, "--table", outbox.table.name, "--long-transaction", "1s"
            )
            holder.rollback()
    finally:
        engine.dispose()
    [finding] = by_check(report, "long_transactions")
    assert finding["severity"] == "warning"
    assert code == 0  # a warning
    key = "pid" if backend == "postgresql" else "thread_id"
    [mine] = [tx for tx in finding["details"]["transactions"] if tx[key] == me]
    assert mine["seconds"] >= 1
    if backend == "postgresql":
        assert mine["holds_back_vacuum"] is True
        assert f"pid {me}" in finding["message"]
        assert f"SELECT pg_terminate_backend({me});" in finding["fix"]
    else:
        assert f"thread {me}" in finding["message"] and f"KILL {me};" in finding["fix"]
    # The doctor's own transactions never count.
    code, report = doctor_json("--db", db_url, "--table", outbox.table.name)
    assert by_check(report, "long_transactions")[0]["severity"] == "ok"


def test_postgresql_dead_tuples_are_reported(backend: str, outbox: Outbox) -> None:
    if backend != "postgresql":
        pytest.skip("pg_stat_user_tables is PostgreSQL's")
    t = outbox.table
    with outbox.engine.begin() as conn:
        for i in range(3):
            outbox.enqueue(conn, "t", {"i": i})
    with outbox.engine.begin() as conn:
        conn.execute(sa.update(t).values(attempts=t.c.attempts + 1))  # 3 dead versions
    deadline = time.monotonic() + 10
    while True:  # statistics reach pg_stat_user_tables shortly after commit
        findings = diagnose(outbox, min_dead_tuples=2, dead_tuple_ratio=0.5)
        [mine] = [f for f in findings if f.check == "dead_tuples" and f.details["table"] == t.name]
        if mine.severity == Severity.WARNING or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert mine.severity == Severity.WARNING, mine
    assert mine.details["dead"] >= 2
    assert mine.fix is not None and f"VACUUM (ANALYZE) {t.name}" in mine.fix


def test_sqlite_not_in_wal_mode_is_reported(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rollback-journal.db'}"
    engine = sa.create_engine(url)
    tables = OutboxTables.create("events")
    tables.create_all(engine)  # without outbox install: journal_mode stays "delete"
    engine.dispose()
    code, report = doctor_json("--db", url, "--table", "events")
    assert code == 0
    [finding] = by_check(report, "journal_mode")
    assert finding["severity"] == "warning" and "not WAL" in finding["message"]
    assert "PRAGMA journal_mode=WAL" in finding["fix"]
    assert doctor("--db", url, "--table", "events", "--strict").exit_code == 1


def test_a_missing_table_and_an_unreachable_database(tmp_path: Path) -> None:
    sqlite3.connect(tmp_path / "empty.db").close()
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    code, report = doctor_json("--db", url, "--table", "events")
    assert code == 1
    [missing] = [f for f in by_check(report, "tables") if f["severity"] == "error"]
    assert "events does not exist" in missing["message"]
    assert missing["fix"] == f"outbox install --db '{url}' --table events"
    # A mistyped SQLite path is reported, not created.
    code, report = doctor_json("--db", f"sqlite:///{tmp_path / 'typo.db'}")
    assert code == 1 and not (tmp_path / "typo.db").exists()
    [finding] = report["findings"]
    assert finding["check"] == "connection" and "does not exist" in finding["message"]
    # A server that does not answer.
    code, report = doctor_json("--db", "postgresql+psycopg://app@127.0.0.1:1/app")
    assert code == 1
    [finding] = report["findings"]
    assert finding["check"] == "connection" and finding["severity"] == "error"
    assert finding["message"].startswith("cannot connect to postgresql+psycopg://app@127.0.0.1:1")


def test_mysql_non_innodb_table_is_an_error(backend: str, outbox: Outbox, db_url: str) -> None:
    if backend != "mysql":
        pytest.skip("storage engines are MySQL's")
    with outbox.engine.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {outbox.tables.inbox.name} ENGINE=MyISAM")
    code, report = doctor_json("--db", db_url, "--table", outbox.table.name)
    assert code == 1
    [finding] = [f for f in by_check(report, "tables") if f["severity"] == "error"]
    assert "MyISAM" in finding["message"]
    assert finding["fix"] == f"ALTER TABLE {outbox.tables.inbox.name} ENGINE=InnoDB;"


def test_password_is_masked_and_usage_errors_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(doctor_command, [])
    assert result.exit_code == 2 and "no database URL" in result.output
    result = CliRunner().invoke(
        doctor_command, ["--db", "sqlite:///x.db", "--max-backlog-age", "soon"]
    )
    assert result.exit_code == 2 and "--max-backlog-age" in result.output
    code, report = doctor_json("--db", "postgresql+psycopg://app:s3cret@127.0.0.1:1/app")
    assert code == 1 and "s3cret" not in json.dumps(report)
    assert report["database"] == "postgresql+psycopg://app:***@127.0.0.1:1/app"


def test_render_report_puts_each_fix_under_its_finding() -> None:
    text = render_report(
        [
            Finding("index", Severity.ERROR, "missing index ix", fix="CREATE INDEX ix ON t (a);"),
            Finding("backlog", Severity.OK, "0 pending"),
        ],
        title="outbox doctor: sqlite://",
    )
    lines = text.splitlines()
    assert lines[0] == "outbox doctor: sqlite://"
    assert lines[2].startswith("ERROR    index") and "missing index ix" in lines[2]
    assert lines[3].strip() == "fix: CREATE INDEX ix ON t (a);"
    assert lines[-1] == "1 error(s), 0 warning(s), 1 ok"


@pytest.mark.parametrize(
    ("url", "partial"),
    [
        ("mssql+pyodbc://app:pw@db/app?driver=ODBC+Driver+18+for+SQL+Server", True),
        ("postgresql+psycopg://app@db/app", True),
        ("mysql+pymysql://app@db/app", False),
        ("sqlite:///app.db", True),
    ],
)
def test_expected_indexes_are_those_install_creates(url: str, partial: bool) -> None:
    """No server: the fixes are compiled from schema.py for the database at hand."""
    outbox = Outbox(url, table="events")
    dialect = sa.create_mock_engine(sa.engine.make_url(url), lambda *a, **k: None).dialect
    ddl = expected_indexes(outbox, dialect)
    assert ("ix_events_state_id" in ddl) is not partial
    if not partial:
        assert ddl["ix_events_state_id"] == "CREATE INDEX ix_events_state_id ON events (state, id);"
    assert ddl["ux_events_event_id"].startswith("CREATE UNIQUE INDEX ux_events_event_id ON events")
    assert "ix_events_inbox_processed_at" in ddl
    assert ("ix_events_pending" in ddl) is partial  # partial indexes where the database has them
    if partial:
        assert ddl["ix_events_pending"].endswith("WHERE state = 0;")
        assert ddl["ix_events_leased"].endswith("WHERE state = 1;")
        assert ddl["ix_events_dead"].endswith("WHERE state = 3;")


def test_an_inbox_without_its_primary_key_is_an_error(
    backend: str, outbox: Outbox, db_url: str
) -> None:
    inbox = outbox.tables.inbox
    bare = sa.Table(
        inbox.name,
        sa.MetaData(),
        *(sa.Column(c.name, c.type, nullable=False) for c in inbox.columns),
        sa.Index(f"ix_{inbox.name}_processed_at", "processed_at"),
    )
    with outbox.engine.begin() as conn:
        inbox.drop(conn)
        bare.create(conn)
    code, report = doctor_json("--db", db_url, "--table", outbox.table.name)
    assert code == 1
    [finding] = [f for f in by_check(report, "tables") if f["severity"] == "error"]
    assert "duplicates are not detected" in finding["message"]
    if backend == "sqlite":
        assert "SQLite cannot add a primary key" in finding["fix"]
        return
    assert finding["fix"] == f"ALTER TABLE {inbox.name} ADD PRIMARY KEY (consumer, event_id);"
    with outbox.engine.begin() as conn:
        conn.exec_driver_sql(finding["fix"].rstrip(";"))
    assert doctor("--db", db_url, "--table", outbox.table.name).exit_code == 0


def test_a_missing_presence_table_is_a_warning_that_install_fixes(
    outbox: Outbox, db_url: str
) -> None:
    """A table from before the presence table: relays run, the doctor says what it costs."""
    with outbox.engine.begin() as conn:
        outbox.tables.presence.drop(conn)
    _, report = doctor_json("--db", db_url, "--table", outbox.table.name)
    [finding] = [f for f in by_check(report, "tables") if "presence" in f["message"]]
    assert finding["severity"] == "warning"
    assert "outbox install" in finding["fix"]
    outbox.install()
    _, report = doctor_json("--db", db_url, "--table", outbox.table.name)
    assert not [f for f in by_check(report, "tables") if "presence" in f["message"]]
