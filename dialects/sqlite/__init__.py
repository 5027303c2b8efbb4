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
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import Parts, ReturningDialect, ServerInfo
from outbox_core.dialects.base.budget import SIZE, budget_param, within_budget
from outbox_core.dialects.sqlite.adoption import SqliteAdoption
from outbox_core.dialects.sqlite.console import SqliteConsole
from outbox_core.dialects.sqlite.enqueue import SqliteEnqueue
from outbox_core.dialects.sqlite.inbox import SqliteInbox
from outbox_core.dialects.sqlite.session import SqliteSession
from outbox_core.dialects.sqlite.storage import SqliteStorage
from outbox_core.errors import UnsupportedDatabase

MIN_VERSION = (3, 35, 0)  # UPDATE ... RETURNING


class SqliteDialect(ReturningDialect):
    """SQLite strategy: one immediate write transaction per claim, leases only."""

    name: ClassVar[str] = "sqlite"
    family: ClassVar[str] = "SQLite"
    row_locks: ClassVar[bool] = False
    frozen_transactions_stay: ClassVar[str | None] = (
        "SQLite has no server to end it: a relay frozen inside a claim holds the write lock "
        "until its process dies"
    )
    app_clock: ClassVar[bool] = True
    schema_kind: ClassVar[str | None] = None
    parts: ClassVar[Parts] = Parts(
        session=SqliteSession,
        storage=SqliteStorage,
        enqueue=SqliteEnqueue,
        inbox=SqliteInbox,
        console=SqliteConsole,
        adoption=SqliteAdoption,
    )

    def now(self) -> sa.ColumnElement[datetime]:
        """The application's UTC clock, bound as a parameter."""
        return sa.literal(self.utcnow(), sa.DateTime())

    def after(self, seconds: float) -> sa.ColumnElement[datetime]:
        """The application's UTC clock plus ``seconds``."""
        return sa.literal(self.utcnow() + timedelta(seconds=seconds), sa.DateTime())

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

    def stored_size(self, o: sa.FromClause) -> sa.ColumnElement[int]:
        """``length(CAST(payload AS BLOB))`` and the headers': bytes of the UTF-8 JSON text
        (``length()`` of text counts characters)."""
        c = o.c
        return sa.func.length(sa.cast(c.payload, sa.LargeBinary), type_=sa.Integer()) + (
            sa.func.coalesce(
                sa.func.length(sa.cast(c.headers, sa.LargeBinary), type_=sa.Integer()), 0
            )
        )

    def install(self, conn: Connection, *, existing: str = "pending") -> None:
        """Create the tables and switch a file database to WAL (persistent)."""
        if conn.in_transaction():
            conn.commit()
        if self.session.shared_by_processes(conn.engine.url):
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
            conn.commit()
        super().install(conn, existing=existing)

    def claim_statement(
        self,
        *,
        limit: int,
        lease: float,
        token: str | sa.BindParameter[str],
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
        block_on_dead: bool = True,
        max_bytes: int | sa.BindParameter[int] | None = None,
    ) -> sa.Update:
        """``UPDATE ... WHERE id IN (SELECT id ... LIMIT n) RETURNING``.

        The IN-subquery form is safe here: the write lock taken by ``BEGIN
        IMMEDIATE`` means nothing changes between the subquery and the update.
        With a byte budget, the ids the budget keeps of those (window
        functions: SQLite 3.25), each row returned with its stored size last.
        """
        t = self.table
        columns: list[sa.ColumnElement[Any]] = [t.c.id]
        if max_bytes is not None:
            columns.append(self.stored_size(t).label(SIZE))
        picked = (
            sa.select(*columns)
            .where(*self.keys.claim_filter(t, ordered, window, block_on_dead=block_on_dead))
            .order_by(t.c.id)
            .limit(limit)
        )
        returned = self.claim_columns(t)
        if max_bytes is not None:
            picked = within_budget(picked.subquery("c"), budget_param(max_bytes))
            returned.append(self.stored_size(t).label(SIZE))
        return (
            sa.update(t)
            .where(t.c.id.in_(picked.scalar_subquery()))
            .values(self.lease_values(lease=lease, token=token))
            .returning(*returned)
        )
