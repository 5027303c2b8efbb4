"""PostgreSQL (12 and newer, psycopg 3).

Claim: a ``MATERIALIZED`` CTE picks the ids with ``FOR UPDATE SKIP LOCKED``,
then ``UPDATE ... FROM c ... RETURNING`` leases exactly those rows. Never
``UPDATE ... WHERE id IN (SELECT ... LIMIT ... SKIP LOCKED)``: the planner
may run that subquery more than once and lease more than ``limit`` rows.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from dialects.base import Dialect
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import Event

MIN_VERSION = (12,)


class PostgresqlDialect(Dialect):
    """PostgreSQL strategy: ``FOR UPDATE SKIP LOCKED`` in a materialized CTE."""

    name: ClassVar[str] = "postgresql"

    def now(self) -> sa.ColumnElement[datetime]:
        """``statement_timestamp()``: unlike ``now()`` it moves within a long transaction."""
        return sa.func.statement_timestamp(type_=sa.DateTime(timezone=True))

    def after(self, seconds: float) -> sa.ColumnElement[datetime]:
        """``statement_timestamp() + interval``."""
        return self.now() + sa.literal(timedelta(seconds=seconds), sa.Interval())

    def check(self, conn: Connection) -> None:
        """Require PostgreSQL 12+ (``MATERIALIZED`` CTEs; SKIP LOCKED came in 9.5)."""
        version = conn.dialect.server_version_info or (0,)
        if tuple(version[:1]) < MIN_VERSION:
            found = ".".join(str(v) for v in version)
            raise UnsupportedDatabase(
                f"PostgreSQL {found} is too old: the outbox needs PostgreSQL 12 or newer "
                "(MATERIALIZED common table expressions with FOR UPDATE SKIP LOCKED)"
            )

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``FOR UPDATE SKIP LOCKED``: lock the picked rows, skip rows other claims hold."""
        return select.with_for_update(skip_locked=True)

    def claim_statement(self, *, limit: int, lease: float, token: str, ordered: bool) -> sa.Update:
        """``WITH c AS MATERIALIZED (SELECT ... SKIP LOCKED) UPDATE ... FROM c RETURNING``."""
        t = self.table
        pick = sa.select(t.c.id).where(*self.claim_filter(t, ordered)).order_by(t.c.id)
        picked = self.lock_rows(pick.limit(limit)).cte("c").prefix_with("MATERIALIZED")
        return (
            sa.update(t)
            .where(t.c.id == picked.c.id)
            .values(self.lease_values(lease=lease, token=token))
            .returning(*self.claim_columns(t))
        )

    def claim(
        self, conn: Connection, *, limit: int, lease: float, token: str, ordered: bool
    ) -> list[Event]:
        """Lease up to ``limit`` rows in one statement."""
        stmt = self.claim_statement(limit=limit, lease=lease, token=token, ordered=ordered)
        with self.transaction(conn):
            rows = conn.execute(stmt).all()
        # RETURNING gives rows in no particular order; the relay publishes in id order.
        return sorted((self.to_event(r, token) for r in rows), key=lambda e: e.id)
