"""SQLite 3.35 and newer (sqlite3; aiosqlite for async producers).

SQLite has no row locks: a claim takes the database's write lock with
``BEGIN IMMEDIATE`` and leases rows with ``UPDATE ... WHERE id IN (SELECT
... LIMIT n) RETURNING``; the lease columns keep relays apart. The database
runs in WAL mode so producers' reads are not blocked by a claim. SQLite has
no clock of its own in UTC with microseconds, so the relay passes UTC.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import ReturningDialect, ServerInfo
from outbox_core.errors import UnsupportedDatabase

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from outbox_core.doctor import Check, Finding


MIN_VERSION = (3, 35, 0)  # UPDATE ... RETURNING


class SqliteDialect(ReturningDialect):
    """SQLite strategy: one immediate write transaction per claim, leases only."""

    name: ClassVar[str] = "sqlite"
    family: ClassVar[str] = "SQLite"
    locking: ClassVar[str] = (
        "claims take turns on the database's write lock (BEGIN IMMEDIATE; SQLite has "
        "no row locks) and leases keep relays apart"
    )
    upgrade_hint: ClassVar[str | None] = (
        "use a Python whose sqlite3 links SQLite 3.35 or newer (UPDATE ... RETURNING)"
    )
    can_add_primary_key: ClassVar[bool] = False
    row_locks: ClassVar[bool] = False
    frozen_transactions_stay: ClassVar[str | None] = (
        "SQLite has no server to end it: a relay frozen inside a claim holds the write lock "
        "until its process dies"
    )
    app_clock: ClassVar[bool] = True

    def now(self) -> sa.ColumnElement[datetime]:
        """The application's UTC clock, bound as a parameter."""
        return sa.literal(self.utcnow(), sa.DateTime())

    def after(self, seconds: float) -> sa.ColumnElement[datetime]:
        """The application's UTC clock plus ``seconds``."""
        return sa.literal(self.utcnow() + timedelta(seconds=seconds), sa.DateTime())

    #: Declared lengths are not limits: SQLite keeps any length it is given.
    enforces_lengths: ClassVar[bool] = False

    def time_digits(self, column_type: Any) -> int:
        """Timestamps are the text the toolkit writes: microseconds."""
        return 6

    test_needs_server: ClassVar[bool] = False

    @classmethod
    def test_url(cls, workdir: Path) -> str | None:
        """A fresh database file per test: no server needed."""
        return f"sqlite:///{workdir / 'outbox.sqlite3'}"

    def engine_options(self) -> dict[str, Any]:
        """Relays and producers take turns on the write lock: wait up to 30 s, don't fail."""
        return {"connect_args": {"timeout": 30}}

    def begin_statement(self, conn: Connection) -> None:
        """Take the write lock at ``BEGIN`` so a claim never fails upgrading a read lock."""
        dbapi = conn.connection.dbapi_connection
        # A pool configured to emit its own BEGIN already opened the transaction.
        if dbapi is not None and not getattr(dbapi, "in_transaction", False):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    def doctor_checks(self) -> list[tuple[str, Check]]:
        """See ``doctor.py`` beside this module."""
        from outbox_core.dialects.sqlite.doctor import CHECKS

        return list(CHECKS)

    def doctor_preflight(self, url: URL, install_command: str) -> Finding | None:
        """A file database that does not exist would be created by connecting: report it."""
        from outbox_core.dialects.sqlite.doctor import missing_file

        return missing_file(url.database, install_command)

    def server_info(self, conn: Connection) -> ServerInfo:
        """The SQLite library Python's ``sqlite3`` was built with."""
        version = sqlite3.sqlite_version
        return ServerInfo("SQLite", version, f"SQLite {version} (Python sqlite3)")

    def check(self, conn: Connection) -> None:
        """Require SQLite 3.35+ (``RETURNING``)."""
        version = sqlite3.sqlite_version_info
        if version < MIN_VERSION:
            raise UnsupportedDatabase(
                f"SQLite {sqlite3.sqlite_version} is too old: the outbox needs SQLite 3.35 "
                "or newer (UPDATE ... RETURNING)"
            )

    def shared_by_processes(self, url: URL) -> bool:
        """A file is; an in-memory database belongs to one connection of one process."""
        return url.database not in (None, "", ":memory:") and "mode=memory" not in str(url)

    def install(self, conn: Connection) -> None:
        """Create the tables and switch a file database to WAL (persistent)."""
        if conn.in_transaction():
            conn.commit()
        if self.shared_by_processes(conn.engine.url):
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
            conn.commit()
        super().install(conn)

    def claim_statement(
        self,
        *,
        limit: int,
        lease: float,
        token: str | sa.BindParameter[str],
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
        block_on_dead: bool = True,
    ) -> sa.Update:
        """``UPDATE ... WHERE id IN (SELECT id ... LIMIT n) RETURNING``.

        The IN-subquery form is safe here: the write lock taken by ``BEGIN
        IMMEDIATE`` means nothing changes between the subquery and the update.
        """
        t = self.table
        picked = (
            sa.select(t.c.id)
            .where(*self.claim_filter(t, ordered, window, block_on_dead=block_on_dead))
            .order_by(t.c.id)
            .limit(limit)
            .scalar_subquery()
        )
        return (
            sa.update(t)
            .where(t.c.id.in_(picked))
            .values(self.lease_values(lease=lease, token=token))
            .returning(*self.claim_columns(t))
        )

    def inbox_insert(self, consumer: str, event_id: str) -> sa.Insert:
        """``INSERT ... ON CONFLICT (consumer, event_id) DO NOTHING``.

        Unlike ``INSERT OR IGNORE`` it ignores only the primary-key conflict,
        not NOT NULL or CHECK failures. Writers take turns on the database's
        write lock, so a concurrent duplicate waits and then inserts nothing.
        """
        from sqlalchemy.dialects.sqlite import insert

        t = self.tables.inbox
        return (
            insert(t)
            .values(consumer=consumer, event_id=event_id, processed_at=self.now())
            .on_conflict_do_nothing(index_elements=[t.c.consumer, t.c.event_id])
        )
