"""Which driver errors are of the moment (retry soon, on a fresh connection) is each
database family's knowledge: PyMySQL and sqlite3 file a misspelt column under
``OperationalError`` as they do a lost connection."""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy as sa

from outbox_core.dialects.mssql.session import MssqlSession
from outbox_core.dialects.mysql.session import MysqlSession
from outbox_core.dialects.postgresql.session import PostgresqlSession
from outbox_core.dialects.sqlite.session import SqliteSession


def wrapped(
    orig: BaseException, cls: type[sa.exc.DBAPIError] = sa.exc.OperationalError
) -> BaseException:
    return cls("statement", {}, orig)


class PgError(Exception):
    def __init__(self, sqlstate: str | None) -> None:
        super().__init__("pg")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("sqlstate", "transient"),
    [
        ("57P01", True),  # admin shutdown
        ("57P03", True),  # cannot connect now (starting up)
        ("08006", True),  # connection failure
        ("40P01", True),  # deadlock
        ("55P03", True),  # lock not available
        ("53300", True),  # too many connections
        ("42703", False),  # undefined column
        ("42P01", False),  # undefined table
        ("23505", False),  # unique violation
        (None, True),  # no server answer: connecting failed
    ],
)
def test_postgresql_by_sqlstate(sqlstate: str | None, transient: bool) -> None:
    assert PostgresqlSession().transient(wrapped(PgError(sqlstate))) is transient


@pytest.mark.parametrize(
    ("code", "transient"),
    [(2013, True), (2006, True), (2003, True), (1213, True), (1205, True), (1927, True),
     (1054, False), (1146, False), (1142, False), (1045, False), (4025, False)],
)  # fmt: skip
def test_mysql_by_error_code(code: int, transient: bool) -> None:
    assert MysqlSession().transient(wrapped(Exception(code, "message"))) is transient


def test_sqlite_busy_is_transient_a_missing_table_is_not() -> None:
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = 5  # type: ignore[attr-defined]
    missing = sqlite3.OperationalError("no such table: outbox")
    missing.sqlite_errorcode = 1  # type: ignore[attr-defined]
    assert SqliteSession().transient(wrapped(busy)) is True
    assert SqliteSession().transient(wrapped(missing)) is False


@pytest.mark.parametrize(
    ("state", "transient"), [("08S01", True), ("40001", True), ("HYT00", True), ("42S02", False)]
)
def test_mssql_by_odbc_sqlstate(state: str, transient: bool) -> None:
    assert MssqlSession().transient(wrapped(Exception(state, "message"))) is transient
