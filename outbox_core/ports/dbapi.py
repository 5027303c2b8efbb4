"""The transaction port over a plain DB-API 2 connection (no SQLAlchemy on the caller's side).

``enqueue`` runs its statements on a cursor of the caller's connection, in
the transaction that connection is in: it never sends ``BEGIN``, ``COMMIT``
or ``ROLLBACK``. A DB-API connection that is not in autocommit mode is in a
transaction from its first statement (the driver begins it), so the event
may be that first statement.

Per-transaction marks: DB-API gives no transaction identity. A flag such as
libpq's transaction status tells whether *a* transaction is open, not
whether it is the one an earlier event was written in (the caller may have
committed and begun another between two calls). So every enqueue statement
is treated as its transaction's first: on PostgreSQL each carries the
``NOTIFY``, which PostgreSQL folds into one notification per transaction at
commit (a wake-up is never missed, a repeat costs nothing); the other
databases have no wake-up statement at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from outbox_core.errors import ConfigurationError
from outbox_core.ports.commit_watch import COMMIT_WATCH
from outbox_core.ports.compiler import StatementCompiler
from outbox_core.ports.drivers import SYNC_DRIVERS, Driver, find_driver, labels

#: One compiler per driver (its dialect and its compiled statements), process-wide.
_COMPILERS: dict[str, StatementCompiler] = {}

#: Registers a callback to run when the caller's transaction commits.
AfterCommit = Callable[[Callable[[], None]], None]


def compiler_for(driver: Driver) -> StatementCompiler:
    """The process's compiler for ``driver``."""
    compiler = _COMPILERS.get(driver.label)
    if compiler is None:
        compiler = _COMPILERS.setdefault(driver.label, StatementCompiler(driver.dialect()))
    return compiler


class DriverTransaction:
    """What the raw-connection ports share: the driver found, its compiler, the refusals.

    Subclasses set how statements run and how the commit is learnt of.
    """

    def __init__(self, connection: Any, driver: Driver) -> None:
        self.connection = connection
        self.driver_info = driver
        self._compiler = compiler_for(driver)
        self._owner: object = None

    @property
    def driver(self) -> sa.Dialect:
        """The SQLAlchemy dialect that compiles for this driver (its paramstyle)."""
        return self._compiler.dialect

    @property
    def bind(self) -> None:
        """None: the outbox reads the server's capabilities on its own engine, once."""
        return None

    def autocommit(self) -> bool:
        """In autocommit mode and not inside an explicit transaction (see ``drivers``)."""
        return self.driver_info.autocommit(self.connection)

    def require_transaction(self, what: str) -> None:
        """Refuse autocommit with this driver's own way out, before anything is written."""
        if self.autocommit():
            raise ConfigurationError(autocommit_message(what, self.driver_info))

    def first_event(self, owner: object) -> bool:
        """Always True: DB-API has no transaction identity (see the module's docstring)."""
        self._owner = owner
        return True


class DBAPITransaction(DriverTransaction):
    """:class:`~outbox_core.transaction.TransactionPort` over a DB-API 2 connection.

    ``connection`` is a connection of psycopg 3, psycopg2, PyMySQL,
    mysqlclient, sqlite3 or pyodbc; anything else raises
    :class:`~outbox_core.errors.ConfigurationError` naming what is accepted.
    ``after_commit`` registers a callback to run when the caller's
    transaction commits, for a framework that has such a hook (Django's
    ``transaction.on_commit``); without it, this process's relays are woken
    by :mod:`outbox_core.ports.commit_watch` once the connection reports no
    transaction open.
    """

    def __init__(self, connection: Any, *, after_commit: AfterCommit | None = None) -> None:
        driver = find_driver(connection, SYNC_DRIVERS)
        if driver is None:
            raise ConfigurationError(not_accepted("DBAPITransaction", connection))
        super().__init__(connection, driver)
        self._after_commit = after_commit

    def execute(self, statement: sa.Executable, parameters: Any) -> None:
        """On a new cursor of the caller's connection (a list of parameters: executemany)."""
        prepared = self._compiler.prepare(statement)
        cursor = self.connection.cursor()
        try:
            if isinstance(parameters, list):
                cursor.executemany(prepared.sql, [prepared.parameters(p) for p in parameters])
            else:
                cursor.execute(prepared.sql, prepared.parameters(parameters))
        finally:
            cursor.close()

    def after_commit(self, callback: Callable[[], None]) -> None:
        """The ``after_commit`` hook given, else the commit watch where the driver has a flag."""
        if self._after_commit is not None:
            self._after_commit(callback)
        elif self.driver_info.ended is not None:
            COMMIT_WATCH.watch(self.connection, self.driver_info.ended, callback, owner=self._owner)


def not_accepted(what: str, conn: object) -> str:
    """The message for a connection ``what`` cannot use: what was passed, what is accepted."""
    cls = type(conn)
    return (
        f"{what} got {cls.__module__}.{cls.__qualname__}, which is not a connection it "
        "accepts: a SQLAlchemy Connection or Session, or a DB-API connection of "
        f"{labels(SYNC_DRIVERS)} (for AsyncConnection, AsyncSession, asyncpg and "
        "psycopg's AsyncConnection: await enqueue_async)"
    )


def autocommit_message(what: str, driver: Driver) -> str:
    """The refusal of a connection in autocommit mode, with the driver's way out."""
    return (
        f"{what} needs the caller's transaction, but this {driver.label} connection is in "
        "autocommit mode: the event would be committed on its own, even if your business "
        f"write fails. {driver.hint[0].upper()}{driver.hint[1:]}"
    )
