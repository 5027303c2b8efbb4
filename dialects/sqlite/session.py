"""SQLite connections: wait for the write lock, take it at ``BEGIN``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection

from outbox_core.dialects.base import SessionSetup

if TYPE_CHECKING:
    from sqlalchemy.engine import URL


class SqliteSession(SessionSetup):
    """Writers take turns on the database's write lock."""

    def engine_options(self) -> dict[str, Any]:
        """Relays and producers take turns on the write lock: wait up to 30 s, don't fail."""
        return {"connect_args": {"timeout": 30}}

    def pool_options(self, *, size: int, overflow: int) -> dict[str, Any]:
        """No options: the pool SQLAlchemy chooses for the URL stays (in memory, one
        connection per thread, with no overflow to set); writers take turns on one lock."""
        return {}

    def begin_statement(self, conn: Connection) -> None:
        """Take the write lock at ``BEGIN`` so a claim never fails upgrading a read lock."""
        dbapi = conn.connection.dbapi_connection
        # A pool configured to emit its own BEGIN already opened the transaction.
        if dbapi is not None and not getattr(dbapi, "in_transaction", False):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    def shared_by_processes(self, url: URL) -> bool:
        """A file is; an in-memory database belongs to one connection of one process."""
        return url.database not in (None, "", ":memory:") and "mode=memory" not in str(url)

    def transient(self, error: BaseException) -> bool:
        """Busy or locked (another writer holds the file); sqlite3 files schema errors, a
        missing table included, as ``OperationalError`` too."""
        orig = getattr(error, "orig", error)
        code = getattr(orig, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF in (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED (extended codes too)
        return "database is locked" in str(orig)
