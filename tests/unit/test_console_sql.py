"""The dashboard's reads as each family compiles them, SQL Server above all.

No SQL Server runs here: the reads run on a connection that records the SQL
compiled for the family and answers from a script, as in
``test_mssql_sql.py``. What is checked: no read locks a row or a table
(the dashboard must never hold up a relay), states are written as literals
(SQL Server and SQLite match a filtered index only against constants), and
SQL Server's statements are the ones its filtered indexes and its rules on
``GROUP BY`` allow.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql, mysql, postgresql, sqlite

from outbox_core.dialects.base import dialect_families, get_dialect
from outbox_core.dialects.base.console import ConsoleReads
from outbox_core.message import State
from outbox_core.schema import OutboxTables

DRIVERS: dict[str, sa.Dialect] = {
    "mssql": mssql.dialect(),
    "mysql": mysql.dialect(),
    "postgresql": postgresql.dialect(),
    "sqlite": sqlite.dialect(),
}
#: What a read must never say: row or table locks of any family.
LOCKS = re.compile(
    r"FOR UPDATE|FOR SHARE|FOR NO KEY|LOCK IN SHARE|UPDLOCK|HOLDLOCK|XLOCK|TABLOCK|"
    r"ROWLOCK|READPAST|SERIALIZABLE|BEGIN IMMEDIATE|BEGIN EXCLUSIVE",
    re.IGNORECASE,
)
NOW = datetime(2024, 5, 1, 12, 0, 30)


class _Result:
    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = rows

    def one(self) -> tuple[Any, ...]:
        [row] = self.rows
        return row

    def first(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None

    def all(self) -> list[tuple[Any, ...]]:
        return self.rows

    def scalar_one(self) -> Any:
        return self.one()[0]

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.rows)


OLD = datetime(2020, 1, 1)
#: The scripted table: ids 1 to 100, those from 60 on created at ``NOW``.
RECENT_FROM = 60


def answer(sql: str, parameters: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What the scripted table answers to each read's statements."""
    if "o_from" in parameters:  # a probe of first_id_since
        found = max(int(parameters["o_from"]), 1)
        return [(found, NOW if found >= RECENT_FROM else OLD)] if found <= 100 else []
    if "min(lo.id)" in sql:  # its bounds: the cutoff, the lowest and highest ids, the newest
        return [(NOW, 1, 100, NOW)]
    if "count(*)" in sql and "max(outbox.id)" in sql:  # the overview
        return [(NOW, 1, 0, 1, NOW, 1, 9)]
    if " FROM " not in sql:  # the flow's clock
        return [(NOW,)]
    if " AS b " in sql:  # the flow's counts: created in bucket 2, sent in bucket 3
        return [(0, 2, 5), (1, 3, 4)]
    return []


class Recorder:
    """A connection that records the SQL compiled for ``driver`` and answers from a script."""

    def __init__(self, driver: sa.Dialect) -> None:
        self.dialect = driver
        self.sent: list[str] = []
        self.begun = 0

    def in_transaction(self) -> bool:
        return False

    def begin(self) -> contextlib.AbstractContextManager[None]:
        self.begun += 1
        return contextlib.nullcontext()

    def execute(self, statement: Any, parameters: dict[str, Any] | None = None) -> _Result:
        if parameters:
            statement = statement.params(parameters)
        compiled = statement.compile(
            dialect=self.dialect, compile_kwargs={"render_postcompile": True}
        )
        sql = " ".join(str(compiled).split())
        self.sent.append(sql)
        return _Result(answer(sql, parameters or {}))


def console_of(name: str) -> ConsoleReads:
    console: ConsoleReads = get_dialect(name)(OutboxTables.create()).console
    return console


def every_read(name: str) -> list[str]:
    """The SQL of every read of the console, on the scripted table."""
    console = console_of(name)
    conn: Any = Recorder(DRIVERS[name])
    overview = console.overview(conn)
    assert (overview.pending, overview.dead, overview.newest_id) == (1, 1, 9)
    assert overview.now == NOW.replace(tzinfo=UTC)
    assert console.first_id_since(conn, 60) == RECENT_FROM
    flow = console.flow(conn, seconds=300, bucket=60, from_id=7)
    assert flow[0].start == datetime(2024, 5, 1, 11, 55, tzinfo=UTC)
    assert [(b.created, b.sent) for b in flow] == [(0, 0), (0, 0), (5, 0), (0, 4), (0, 0), (0, 0)]
    console.events(conn, states=[State.PENDING, State.DEAD], error="50%")
    console.event(conn, 7)
    console.held_keys(conn)
    console.sent_by_partition(conn, seconds=60, from_id=7)
    assert conn.begun == 7  # one plain transaction per read, none of the dialect's own
    return list(conn.sent)


@pytest.mark.parametrize("name", dialect_families())
def test_no_read_locks_rows_or_takes_a_write_transaction(name: str) -> None:
    sent = every_read(name)
    assert len(sent) >= 10
    for statement in sent:
        assert not LOCKS.search(statement), statement
        assert not statement.lstrip().upper().startswith(("UPDATE", "DELETE", "INSERT"))


@pytest.mark.parametrize("name", dialect_families())
def test_states_are_literals_a_filtered_index_matches(name: str) -> None:
    joined = "\n".join(every_read(name))
    for state in (State.PENDING, State.LEASED, State.DEAD):
        assert re.search(rf"\.state = {int(state)}\b", joined), (state, joined)
    assert not re.search(r"state\s*(=|IN)\s*[(]?\s*[:?%@]", joined, re.IGNORECASE)


@pytest.mark.parametrize("name", dialect_families())
def test_each_family_subtracts_timestamps_in_its_own_sql(name: str) -> None:
    console = console_of(name)
    assert type(console) is not ConsoleReads
    t = console.table
    expression = console.microseconds_between(t.c.created_at, t.c.sent_at)
    sql = str(sa.select(expression).compile(dialect=DRIVERS[name]))
    expected = {
        "mssql": "datediff_big(microsecond, outbox.created_at, outbox.sent_at)",
        "mysql": "timestampdiff(MICROSECOND, outbox.created_at, outbox.sent_at)",
        "postgresql": "EXTRACT(epoch FROM outbox.sent_at - outbox.created_at)",
        "sqlite": "julianday(outbox.sent_at) - julianday(outbox.created_at)",
    }
    assert expected[name] in sql, sql


def test_the_base_part_names_what_a_new_family_must_give() -> None:
    base = ConsoleReads(get_dialect("sqlite")(OutboxTables.create()).primitives())
    t = base.table
    with pytest.raises(NotImplementedError, match="a family gives its own"):
        base.microseconds_between(t.c.created_at, t.c.sent_at)


def test_sql_server_probes_one_row_of_the_primary_key() -> None:
    sent = every_read("mssql")
    probes = [s for s in sent if "o_from" in s]
    assert 1 <= len(probes) <= 8  # ids 1 to 100: about log2(100)
    for probe in probes:
        assert probe == (
            "SELECT TOP 1 outbox.id, outbox.created_at FROM outbox "
            "WHERE outbox.id >= :o_from ORDER BY outbox.id"
        )


def test_sql_server_groups_the_flow_by_a_column_not_a_bound_expression() -> None:
    [counts] = [s for s in every_read("mssql") if "datediff_big" in s]
    assert "datediff_big(microsecond," in counts
    # SQL Server refuses GROUP BY over an expression whose parameters are bound apart
    # from the select list's (error 8120): the buckets are a subquery's column.
    groups = re.findall(r"GROUP BY (\S+)", counts)
    assert groups == ["anon_1.b", "anon_2.b"], counts
    assert counts.count("UNION ALL") == 1


def test_sql_server_lists_each_state_through_its_filtered_index() -> None:
    [listed] = [s for s in every_read("mssql") if "UNION ALL" in s and "last_error" in s]
    for state in (State.PENDING, State.DEAD):
        assert f"WHERE outbox.state = {int(state)} AND" in listed
    assert listed.startswith("SELECT TOP 50 ")
    assert listed.count("TOP 50") == 3  # each state's newest, then the newest of them
    assert "ESCAPE '/'" in listed


def test_sql_server_held_keys_read_the_dead_pending_and_leased_rows_by_key() -> None:
    [held] = [s for s in every_read("mssql") if "dead_id" in s]
    assert "WHERE d.state = 3 AND d.[key] IS NOT NULL GROUP BY d.[key]" in held
    assert "ep.state = 0 AND ep.[key] = heads.[key] AND ep.id < heads.dead_id" in held
    assert "el.state = 1 AND el.[key] = heads.[key] AND el.id < heads.dead_id" in held
    assert "w.state = 0 AND w.[key] = heads.[key] AND w.id > heads.dead_id" in held
    assert held.startswith("SELECT TOP 100 ")
