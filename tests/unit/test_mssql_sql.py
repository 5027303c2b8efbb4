"""SQL Server, hardened from Microsoft's documentation (cited in ``dialects/mssql``).

No SQL Server runs here: each decision is checked on the SQL the dialect
compiles and sends, through a connection that records it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql

from outbox_core.dialects.base import SessionLimits, get_dialect
from outbox_core.dialects.mssql import (
    FILTERED_INDEX_OPTIONS,
    MssqlDialect,
    read_committed_snapshot,
)
from outbox_core.errors import UnsupportedDatabase
from outbox_core.schema import OutboxTables

DRIVER = mssql.dialect()


def sql_of(stmt: Any) -> str:
    if isinstance(stmt, str):
        return stmt
    return " ".join(str(stmt.compile(dialect=DRIVER)).split())


def make(schema: str | None = None) -> MssqlDialect:
    dialect = get_dialect("mssql")(OutboxTables.create(schema=schema))
    assert isinstance(dialect, MssqlDialect)
    return dialect


class _Result:
    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = rows
        self.rowcount = len(rows)

    def all(self) -> list[tuple[Any, ...]]:
        return self.rows

    def one(self) -> tuple[Any, ...]:
        [row] = self.rows
        return row

    def scalar(self) -> Any:
        return self.rows[0][0] if self.rows else None

    def scalars(self) -> Iterator[Any]:
        return iter(r[0] for r in self.rows)

    def first(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.rows)


class Recorder:
    """A connection that records the SQL it is given and answers from a script."""

    def __init__(self, *answers: list[tuple[Any, ...]]) -> None:
        self.sent: list[str] = []
        self.answers = list(answers)
        self.dialect = DRIVER

    def in_transaction(self) -> bool:
        return False

    def begin(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def execute(self, stmt: Any, params: Any = None) -> _Result:
        self.sent.append(sql_of(stmt))
        return _Result(self.answers.pop(0) if self.answers else [])


# -- READPAST under READ_COMMITTED_SNAPSHOT needs READCOMMITTEDLOCK ---------------------------


def test_every_readpast_read_also_reads_with_readcommittedlock() -> None:
    d = make()
    t = d.table
    recorder = Recorder()
    conn: Any = recorder
    d.reap(conn, max_attempts=3)
    d.cleanup(conn, older_than=60, batch=100)
    d.claim(conn, limit=10, lease=30, token="t", ordered=False)
    sent = [*recorder.sent, sql_of(d.lock_rows(sa.select(t.c.id)))]
    hinted = [s for s in sent if "READPAST" in s]
    assert len(hinted) >= 4, sent  # reap, cleanup, claim, read-back
    for statement in hinted:
        assert "READCOMMITTEDLOCK" in statement, statement


# -- lock escalation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "name"), [(None, "outbox"), ("jobs", "jobs.outbox")], ids=["plain", "schema"]
)
def test_install_turns_lock_escalation_off_for_the_outbox_table(
    schema: str | None, name: str
) -> None:
    d = make(schema)
    assert sql_of(d.disable_lock_escalation()) == (
        f"ALTER TABLE {name} SET (LOCK_ESCALATION = DISABLE)"
    )


def test_install_runs_the_alter_after_creating_the_tables_when_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = make()
    created: list[str] = []
    monkeypatch.setattr(
        type(d).__mro__[1], "install", lambda self, conn, **_: created.append("tables")
    )
    recorder = Recorder([("TABLE",)])
    conn: Any = recorder
    d.install(conn)
    assert created == ["tables"]
    assert recorder.sent[0] == (
        "SELECT sys.tables.lock_escalation_desc FROM sys.tables "
        "WHERE sys.tables.object_id = object_id(:object_id_1)"
    )
    assert recorder.sent[1:] == ["ALTER TABLE outbox SET (LOCK_ESCALATION = DISABLE)"]
    # Already off: no ALTER (it would take a schema lock on every deploy).
    again = Recorder([("DISABLE",)])
    conn = again
    d.install(conn)
    assert len(again.sent) == 1 and "ALTER" not in again.sent[0]


def test_claims_lock_at_most_a_thousand_rows() -> None:
    d = make()
    stmt = d.claim_statement(limit=100_000, lease=30, token="t", ordered=False)
    compiled = str(stmt.compile(dialect=DRIVER, compile_kwargs={"literal_binds": True}))
    assert "TOP 1000" in compiled


# -- plain reads in ordered claims: RCSI required ---------------------------------------------


def test_ordered_relays_refuse_a_database_without_read_committed_snapshot() -> None:
    d = make()
    off: Any = Recorder([(0,)], [("shop",)])
    with pytest.raises(UnsupportedDatabase, match=r"READ_COMMITTED_SNAPSHOT ON") as info:
        d.check_ordered(off)
    assert "ALTER DATABASE [shop] SET READ_COMMITTED_SNAPSHOT ON" in str(info.value)
    assert off.sent[0] == (
        "SELECT sys.databases.is_read_committed_snapshot_on FROM sys.databases "
        "WHERE sys.databases.name = db_name()"
    )
    on: Any = Recorder([(1,)])
    d.check_ordered(on)
    assert read_committed_snapshot(Recorder([(1,)]))  # type: ignore[arg-type]


def test_the_head_of_key_check_reads_without_skipping_or_locking() -> None:
    """Its reads must see held rows (no READPAST) and, under RCSI, read versions (no UPDLOCK)."""
    d = make()
    sql = sql_of(d.claim_statement(limit=10, lease=30, token="t", ordered=True))
    assert sql.count("READPAST") == 1 and sql.count("UPDLOCK") == 1
    assert "FROM outbox AS p WHERE" in sql


# -- filtered indexes: literals, and the SET options ------------------------------------------


def test_relay_connections_set_the_options_filtered_indexes_need() -> None:
    recorder = Recorder()
    conn: Any = recorder
    make().session.configure(conn, SessionLimits(idle_in_transaction=30, lock_wait=2))
    assert recorder.sent == ["SET LOCK_TIMEOUT 2000", FILTERED_INDEX_OPTIONS]
    for option in (
        "ANSI_NULLS",
        "ANSI_PADDING",
        "ANSI_WARNINGS",
        "ARITHABORT",
        "CONCAT_NULL_YIELDS_NULL",
        "QUOTED_IDENTIFIER",
    ):
        assert option in FILTERED_INDEX_OPTIONS.split("ON;")[0]
    assert FILTERED_INDEX_OPTIONS.endswith("SET NUMERIC_ROUNDABORT OFF")


def test_the_pending_index_is_filtered_on_a_literal_state() -> None:
    d = make()
    ddl = OutboxTables.create().ddl("mssql")
    assert "CREATE INDEX ix_outbox_pending ON outbox (id) WHERE state = 0" in " ".join(ddl.split())
    sql = sql_of(d.claim_statement(limit=10, lease=30, token="t", ordered=False))
    assert "outbox.state = 0" in sql


# -- triggers: no OUTPUT anywhere ---------------------------------------------------------------


def test_a_claim_leases_with_a_plain_update_then_reads_its_rows_back_by_token() -> None:
    d = make()
    row = (7, "e-7", "t.x", None, {"a": 1}, None, 1, datetime(2026, 1, 1))
    recorder = Recorder([], [row])
    conn: Any = recorder
    events = d.claim(conn, limit=10, lease=30, token="tok", ordered=False)
    update, read_back = recorder.sent
    assert update.startswith("WITH c AS (SELECT TOP") and "UPDATE c SET" in update
    assert "OUTPUT" not in update
    assert read_back.startswith("SELECT outbox.id")
    assert "FROM outbox WITH (READPAST, READCOMMITTEDLOCK)" in read_back
    assert "outbox.state = 1 AND outbox.lease_owner = :o_token" in read_back
    assert read_back.endswith("ORDER BY outbox.id")
    assert [e.id for e in events] == [7]
    assert events[0].token == "tok"


# -- outbox doctor on SQL Server ---------------------------------------------------------------


def doctor_findings(check: str, *answers: list[tuple[Any, ...]]) -> tuple[list[Any], Recorder]:
    from outbox_core import Outbox
    from outbox_core.dialects.mssql.doctor import CHECKS
    from outbox_core.doctor.model import DoctorContext, Thresholds

    outbox = Outbox("mssql+pyodbc://app:pw@db/app?driver=ODBC+Driver+18+for+SQL+Server")
    recorder = Recorder(*answers)
    conn: Any = recorder
    ctx = DoctorContext(outbox, conn, Thresholds(), present={"outbox", "inbox"})
    return list(dict(CHECKS)[check](ctx)), recorder


def test_doctor_warns_without_rcsi_and_prints_the_alter_database() -> None:
    [finding], _ = doctor_findings("isolation", [(0, "OFF", "shop")])
    assert finding.severity == "warning" and "ordered relays refuse to start" in finding.message
    assert (
        finding.fix
        == "ALTER DATABASE [shop] SET READ_COMMITTED_SNAPSHOT ON WITH ROLLBACK IMMEDIATE"
    )
    [finding], _ = doctor_findings("isolation", [(1, "OFF", "shop")])
    assert finding.severity == "ok" and finding.fix is None


def test_doctor_reports_lock_escalation_left_on_with_the_fix_install_runs() -> None:
    [finding], recorder = doctor_findings("lock_escalation", [("TABLE",)])
    assert finding.severity == "warning" and "5,000 row locks" in finding.message
    assert finding.fix == "ALTER TABLE outbox SET (LOCK_ESCALATION = DISABLE)"
    assert "sys.tables.lock_escalation_desc" in recorder.sent[0]
    [finding], _ = doctor_findings("lock_escalation", [("DISABLE",)])
    assert finding.severity == "ok"


def test_doctor_names_the_set_options_that_break_filtered_indexes() -> None:
    # ANSI_NULLS, ANSI_PADDING, ANSI_WARNINGS, CONCAT_NULL_YIELDS_NULL,
    # QUOTED_IDENTIFIER, NUMERIC_ROUNDABORT: two wrong.
    [finding], recorder = doctor_findings("set_options", [(1, 1, 0, 1, 1, 1)])
    assert finding.severity == "error"
    assert "ANSI_WARNINGS=OFF, NUMERIC_ROUNDABORT=ON" in finding.message
    assert "error 1934" in finding.message
    # sql_variant cast to int: pyodbc before 5.2 cannot fetch sql_variant.
    assert "CAST(sessionproperty(:sessionproperty_1) AS INTEGER)" in recorder.sent[0]
    # An ODBC session's defaults (ARITHABORT reported OFF, implied ON) are fine.
    [finding], _ = doctor_findings("set_options", [(1, 1, 1, 1, 1, 0)])
    assert finding.severity == "ok"


# -- partitioned ordered claims: the membership locks and the owned-partition claim ---------


def test_partitioned_claims_lock_the_membership_rows_with_table_hints() -> None:
    """FOR UPDATE compiles to nothing on SQL Server: the fence needs its hints."""
    d = make()
    recorder = Recorder([("0-255", 3)], [])
    conn: Any = recorder
    assert d.partitions.own_share(conn, "relay-a") == ("0-255", 3)
    d.partitions.lock_members(conn)
    share, lock = recorder.sent
    assert "FROM outbox_relays WITH (HOLDLOCK, ROWLOCK, READCOMMITTEDLOCK)" in share
    assert "FROM outbox_relays WITH (XLOCK, HOLDLOCK, ROWLOCK)" in lock


def test_the_partitioned_claim_reads_a_window_and_leases_without_output() -> None:
    d = make()
    recorder = Recorder(
        [],  # leased keys
        [],  # dead keys
        [(1, "a", 7, None, 1, 40), (2, "a", 7, None, 1, 40), (3, "b", 9, None, 0, 2)],
        [],  # the read-back by token
    )
    conn: Any = recorder
    parts = d.partitions
    assert parts.leased_keys(conn, [7, 9]) == []
    assert parts.dead_heads(conn, [7, 9]) == {}
    window = parts.pending_window(conn, [7, 9], after=0, limit=10, skip_keys=["z"])
    assert [(r.id, r.key, r.due, r.size) for r in window] == [
        (1, "a", True, 40),
        (2, "a", True, 40),
        (3, "b", False, 2),
    ]
    parts.lease(conn, [1, 2], lease=30, token="t")
    leased, dead, page, update, read_back = recorder.sent
    # Partitions 7 and 9: one arithmetic run, spelt as a range and a modulo.
    assert "key_partition BETWEEN" in leased and "key_partition %" in leased
    assert "key_partition IS NULL" in leased
    assert "GROUP BY outbox.[key]" in dead
    assert page.startswith("SELECT TOP") and "ORDER BY outbox.id" in page
    assert "NOT IN" in page
    # Each row's stored bytes for the byte budget, not its payload.
    assert "datalength(outbox.payload)" in page and "outbox.payload," not in page
    assert update.startswith("UPDATE outbox SET state=") and "OUTPUT" not in update
    assert update.endswith("AND outbox.state = 0")
    assert "lease_owner = :lease_owner_1" in read_back
