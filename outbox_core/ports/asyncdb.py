"""The transaction port over an async driver's connection: asyncpg, psycopg's ``AsyncConnection``.

``enqueue`` is synchronous and written once against the port. Here the port
records the statements it is given, then :meth:`AsyncTransaction.flush`
awaits them on the caller's connection, in its transaction; the wake-up
after commit is registered only once they all ran. Marks and wake-ups as
for DB-API connections (see :mod:`outbox_core.ports.dbapi`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from outbox_core.errors import ConfigurationError
from outbox_core.ports.commit_watch import COMMIT_WATCH
from outbox_core.ports.dbapi import DriverTransaction
from outbox_core.ports.drivers import ASYNC_DRIVERS, find_driver, labels


class AsyncTransaction(DriverTransaction):
    """:class:`~outbox_core.transaction.TransactionPort` over asyncpg or psycopg async.

    asyncpg: inside ``async with conn.transaction():`` (outside one, asyncpg
    commits each statement: refused). psycopg: an ``AsyncConnection`` not in
    autocommit mode, or inside ``async with conn.transaction():``.
    """

    def __init__(self, connection: Any) -> None:
        driver = find_driver(connection, ASYNC_DRIVERS)
        if driver is None:
            cls = type(connection)
            raise ConfigurationError(
                f"enqueue_async got {cls.__module__}.{cls.__qualname__}, which is not a "
                "connection it accepts: a SQLAlchemy AsyncConnection or AsyncSession, or a "
                f"connection of {labels(ASYNC_DRIVERS)} (for sync connections: enqueue)"
            )
        super().__init__(connection, driver)
        self._statements: list[tuple[sa.Executable, Any]] = []
        self._callbacks: list[Callable[[], None]] = []

    def execute(self, statement: sa.Executable, parameters: Any) -> None:
        """Recorded, to be awaited by :meth:`flush`."""
        self._statements.append((statement, parameters))

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Kept until :meth:`flush` has run the statements."""
        self._callbacks.append(callback)

    async def flush(self) -> None:
        """Run the recorded statements in the caller's transaction, then watch for its end."""
        statements, self._statements = self._statements, []
        for statement, parameters in statements:
            prepared = self._compiler.prepare(statement)
            if self.driver_info.label == "asyncpg":
                if isinstance(parameters, list):
                    rows = [prepared.parameters(p) for p in parameters]
                    await self.connection.executemany(prepared.sql, rows)
                else:
                    await self.connection.execute(prepared.sql, *prepared.parameters(parameters))
            else:
                async with self.connection.cursor() as cursor:
                    if isinstance(parameters, list):
                        rows = [prepared.parameters(p) for p in parameters]
                        await cursor.executemany(prepared.sql, rows)
                    else:
                        await cursor.execute(prepared.sql, prepared.parameters(parameters))
        callbacks, self._callbacks = self._callbacks, []
        ended = self.driver_info.ended
        if ended is not None and callbacks:
            COMMIT_WATCH.watch(self.connection, ended, callbacks[-1], owner=self._owner)
