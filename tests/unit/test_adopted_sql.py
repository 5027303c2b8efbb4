"""Every statement of a relay names an adopted table's own columns, on every database.

The table's fields are all renamed here; a statement that still names a
field's default column (``event_id``, ``topic``, ``key``...) would fail on the
team's table. SQL Server has no server here: this is its check.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql, mysql, postgresql, sqlite

from outbox_core.dialects.base.registry import get_dialect
from outbox_core.message import Failure
from outbox_core.schema import OutboxTables

RENAMED = (
    "id=ev_seq,event_id=ev_uuid,topic=ev_type,key=ev_aggregate,payload=ev_body,"
    "headers=ev_meta,created_at=ev_written"
)
FAMILIES = {
    "postgresql": postgresql.dialect(),
    "mysql": mysql.dialect(),
    "mssql": mssql.dialect(),
    "sqlite": sqlite.dialect(),
}
FIELDS = r"(id|event_id|topic|key|payload|headers|created_at)"
#: ``team_outbox`` and the aliases a statement gives it (``team_outbox AS p``).
ALIAS = re.compile(r"team_outbox(?: AS (\w+))?")


def strays(sql: str) -> list[str]:
    """Default column names used on the team's table: ``p.key``, ``SET key =``, inserts."""
    aliases = {"team_outbox"} | {a for a in ALIAS.findall(sql) if a}
    found = [
        m.group(0) for alias in aliases for m in re.finditer(rf"(?<![\w.]){alias}\.{FIELDS}\b", sql)
    ]
    for columns in re.findall(r"INSERT INTO team_outbox \(([^)]*)\)", sql):
        found += [c.strip() for c in columns.split(",") if re.fullmatch(FIELDS, c.strip())]
    for sets in re.findall(
        r"UPDATE team_outbox(?: AS \w+)? SET (.*?)(?: WHERE| FROM| OUTPUT|$)", sql
    ):
        found += [
            name for name in re.findall(r"(?:^|, )(\w+)=", sets) if re.fullmatch(FIELDS, name)
        ]
    return found


def sql_of(stmt: Any, family: str) -> str:
    if isinstance(stmt, str):
        return stmt
    return " ".join(str(stmt.compile(dialect=FAMILIES[family])).split())


class Recorder:
    """A connection that records the SQL it is given and answers nothing."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.dialect = FAMILIES[family]
        self.sent: list[str] = []

    def in_transaction(self) -> bool:
        return False

    def begin(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def commit(self) -> None:
        pass

    def get_execution_options(self) -> dict[str, Any]:
        return {"isolation_level": "READ COMMITTED"}

    def execution_options(self, **_: Any) -> Recorder:
        return self

    def exec_driver_sql(self, sql: str) -> None:
        self.sent.append(sql)

    @property
    def connection(self) -> Any:
        return type("Raw", (), {"dbapi_connection": None})()

    def execute(self, stmt: Any, params: Any = None) -> Any:
        self.sent.append(sql_of(stmt, self.family))
        return _Empty()


class _Empty:
    rowcount = 0

    def all(self) -> list[Any]:
        return []

    def first(self) -> None:
        return None

    def scalar(self) -> None:
        return None

    def scalars(self) -> Iterator[Any]:
        return iter(())

    def __iter__(self) -> Iterator[Any]:
        return iter(())


def run_everything(family: str) -> list[str]:
    """The relay's statements on an adopted table: claims, settles, reaper, cleanup, replay."""
    d = get_dialect(family)(OutboxTables.create("team_outbox", columns=RENAMED))
    recorder = Recorder(family)
    conn: Any = recorder
    for ordered in (False, True):
        d.claim(conn, limit=10, lease=30, token="t", ordered=ordered)
        d.claim(conn, limit=10, lease=30, token="t", ordered=ordered, max_bytes=1000)
    d.mark_sent(conn, [1, 2], token="t", delete=False)
    d.mark_sent(conn, [1, 2], token="t", delete=True)
    d.mark_failed(conn, [Failure(1, "boom", 5.0), Failure(2, "dead", None)], token="t")
    d.release(conn, [1], token="t")
    d.extend(conn, [1], token="t", lease=30)
    d.reap(conn, max_attempts=3)
    d.cleanup(conn, older_than=60, batch=100)
    recorder.sent.append(sql_of(d.enqueue.prepared_insert(headers=True), family))
    return recorder.sent


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_relays_statements_name_the_tables_own_columns(family: str) -> None:
    sent = run_everything(family)
    assert any("ev_seq" in sql for sql in sent)
    for sql in sent:
        wrong = strays(sql)
        assert not wrong, f"{wrong} in:\n{sql}"


def test_the_check_finds_a_default_name_where_there_is_one() -> None:
    # The broken variant: a statement on the default layout is caught.
    d = get_dialect("postgresql")(OutboxTables.create("team_outbox"))
    sql = sql_of(d.claim_statement(limit=10, lease=30, token="t", ordered=True), "postgresql")
    assert strays(sql)
    assert sa  # SQLAlchemy Core built every statement above
