"""What the toolkit knows of each DB-API driver: its SQLAlchemy dialect and transaction state.

A connection is recognised by its class, looked up in the driver's module
only when that module is already imported (a connection of that driver
exists only then), so no driver that is not installed is ever imported.

Each driver says three things about a connection:

- ``autocommit``: its statements would commit on their own. A connection in
  autocommit mode *inside* an explicit transaction (psycopg's
  ``conn.transaction()``, ``BEGIN`` on sqlite3 or PyMySQL) is not: its
  statements join that transaction. Where the driver cannot tell
  (mysqlclient, pyodbc), autocommit mode is refused outright.
- ``ended``: no transaction is open any more (it committed or rolled back),
  or None where the driver has no such flag (mysqlclient, pyodbc). Only a
  read of a flag the driver keeps from the server's replies: it may be read
  from another thread (see :mod:`outbox_core.ports.commit_watch`).
- ``hint``: how a caller of this driver gets a transaction.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

#: libpq's transaction status (psycopg 3's ``pq.TransactionStatus``, psycopg2's
#: ``TRANSACTION_STATUS_*``): the same numbers in both.
_PQ_IDLE, _PQ_INTRANS, _PQ_INERROR, _PQ_UNKNOWN = 0, 2, 3, 4
#: MySQL's server status flags (PyMySQL's ``SERVER_STATUS``).
_MY_IN_TRANS = 0x0001


@dataclass(frozen=True)
class Driver:
    """One DB-API driver: how to recognise its connections and run statements on them."""

    #: Names the driver in messages ("psycopg 3").
    label: str
    #: ``module:Class`` of its connections (several: any of them).
    classes: tuple[str, ...]
    #: The SQLAlchemy dialect that compiles statements for it (``backend+driver``).
    sa_name: str
    #: The driver's DB-API ``paramstyle`` (SQLAlchemy takes it from the module it
    #: imports; given here so nothing is imported).
    paramstyle: str
    autocommit: Callable[[Any], bool]
    ended: Callable[[Any], bool] | None
    hint: str
    #: Its statements are awaited (asyncpg, psycopg's ``AsyncConnection``).
    is_async: bool = False

    def matches(self, conn: object) -> bool:
        """``conn`` is a connection of this driver (its module is never imported here)."""
        for target in self.classes:
            module_name, _, name = target.partition(":")
            module = sys.modules.get(module_name)
            cls = getattr(module, name, None) if module is not None else None
            if isinstance(cls, type) and isinstance(conn, cls):
                return True
        return False

    def dialect(self) -> sa.Dialect:
        """A fresh SQLAlchemy dialect compiling for this driver's paramstyle."""
        cls = sa.engine.make_url(f"{self.sa_name}://").get_dialect()
        dialect = cls(paramstyle=self.paramstyle)  # type: ignore[call-arg]
        # The statements run as the driver's own executemany, never through
        # SQLAlchemy's "insertmanyvalues" (which needs its execution context).
        dialect.insert_executemany_returning = False
        dialect.use_insertmanyvalues_wo_returning = False
        return dialect


def _pq_status(conn: Any) -> int:
    return int(conn.info.transaction_status)


def _pq_autocommit(conn: Any) -> bool:
    # Only an explicit transaction block (INTRANS, or INERROR inside one) makes an
    # autocommit connection atomic: in psycopg's pipeline mode a statement in
    # flight shows ACTIVE, and it would still commit on its own at the next sync.
    return bool(conn.autocommit) and _pq_status(conn) not in (_PQ_INTRANS, _PQ_INERROR)


def _pq_ended(conn: Any) -> bool:
    # UNKNOWN: the connection is closed or broken; nothing is left to wait for.
    return _pq_status(conn) in (_PQ_IDLE, _PQ_UNKNOWN)


def _pymysql_autocommit(conn: Any) -> bool:
    return bool(conn.get_autocommit()) and not conn.server_status & _MY_IN_TRANS


def _pymysql_ended(conn: Any) -> bool:
    return not conn.open or not conn.server_status & _MY_IN_TRANS


def _sqlite_autocommit(conn: sqlite3.Connection) -> bool:
    # Python 3.12+: ``autocommit`` True / False, or LEGACY_TRANSACTION_CONTROL
    # (-1, the default), where ``isolation_level=None`` means autocommit.
    mode = getattr(conn, "autocommit", -1)
    if mode is False:
        return False  # PEP 249 mode: always in a transaction
    if mode is True or conn.isolation_level is None:
        return not conn.in_transaction
    return False


def _sqlite_ended(conn: sqlite3.Connection) -> bool:
    return not conn.in_transaction


def _asyncpg_autocommit(conn: Any) -> bool:
    # asyncpg runs each statement on its own outside ``conn.transaction()``.
    return not conn.is_in_transaction()


def _asyncpg_ended(conn: Any) -> bool:
    return bool(conn.is_closed()) or not conn.is_in_transaction()


_PSYCOPG_HINT = (
    "use a connection with autocommit=False (psycopg's default), "
    "or enqueue inside `with conn.transaction():`"
)

#: The sync drivers, most common first.
SYNC_DRIVERS: tuple[Driver, ...] = (
    Driver(
        "psycopg 3",
        ("psycopg:Connection",),
        "postgresql+psycopg",
        "pyformat",
        _pq_autocommit,
        _pq_ended,
        _PSYCOPG_HINT,
    ),
    Driver(
        "psycopg2",
        ("psycopg2.extensions:connection",),
        "postgresql+psycopg2",
        "pyformat",
        _pq_autocommit,
        _pq_ended,
        "use a connection with autocommit=False (psycopg2's default)",
    ),
    Driver(
        "PyMySQL",
        ("pymysql.connections:Connection",),
        "mysql+pymysql",
        "pyformat",
        _pymysql_autocommit,
        _pymysql_ended,
        "use a connection with autocommit=False (PyMySQL's default), or call conn.begin() first",
    ),
    Driver(
        "mysqlclient",
        ("MySQLdb.connections:Connection",),
        "mysql+mysqldb",
        "format",
        lambda conn: bool(conn.get_autocommit()),
        None,
        "use a connection with autocommit=False (mysqlclient's default)",
    ),
    Driver(
        "sqlite3",
        ("sqlite3:Connection",),
        "sqlite+pysqlite",
        "qmark",
        _sqlite_autocommit,
        _sqlite_ended,
        "use a connection with the default isolation_level (or autocommit=False on "
        "Python 3.12+), or execute BEGIN first",
    ),
    Driver(
        "pyodbc",
        ("pyodbc:Connection",),
        "mssql+pyodbc",
        "qmark",
        lambda conn: bool(conn.autocommit),
        None,
        "use a connection with autocommit=False (pyodbc's default)",
    ),
)

#: The async drivers, for ``enqueue_async``.
ASYNC_DRIVERS: tuple[Driver, ...] = (
    Driver(
        "asyncpg",
        ("asyncpg.connection:Connection", "asyncpg.pool:PoolConnectionProxy"),
        "postgresql+asyncpg",
        "numeric_dollar",
        _asyncpg_autocommit,
        _asyncpg_ended,
        "enqueue inside `async with conn.transaction():`",
        is_async=True,
    ),
    Driver(
        "psycopg 3 async",
        ("psycopg:AsyncConnection",),
        "postgresql+psycopg",
        "pyformat",
        _pq_autocommit,
        _pq_ended,
        _PSYCOPG_HINT.replace("with conn", "async with conn"),
        is_async=True,
    ),
)


def find_driver(conn: object, drivers: tuple[Driver, ...]) -> Driver | None:
    """The driver of ``conn`` among ``drivers``, or None."""
    for driver in drivers:
        if driver.matches(conn):
            return driver
    return None


def labels(drivers: tuple[Driver, ...]) -> str:
    """The drivers' names for an error message."""
    return ", ".join(d.label for d in drivers)
