"""The idempotent consumer's statements on the inbox table (a part of Dialect).

``outbox_core.inbox.Inbox`` validates the values and runs these in the
consumer's transaction; each family gives its native insert-if-absent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql.dml import Insert

from outbox_core.dialects.base.primitives import SqlPrimitives
from outbox_core.dialects.base.values import chunked


class InboxStatements(ABC):
    """Record, guard and clean up ``(consumer, event_id)`` rows."""

    def __init__(self, sql: SqlPrimitives) -> None:
        self.sql = sql
        self.tables = sql.tables

    @abstractmethod
    def insert(self, consumer: str, event_id: str) -> Insert:
        """Record ``(consumer, event_id)`` in the inbox table unless it is already there.

        Each database's native insert-if-absent: it affects 1 row when the id
        is new and 0 when it is a duplicate, and never raises on the duplicate,
        so the caller's transaction stays usable. A concurrent insert of the
        same key waits for the other transaction, then counts as a duplicate if
        it committed. ``outbox_core.inbox.Inbox`` validates the values first.
        """

    def guard(self, conn: Connection, consumer: str, event_id: str) -> None:  # noqa: B027
        """Run before :meth:`insert` in the consumer's transaction (optional hook).

        Where concurrent inserts of one key can deadlock each other (InnoDB),
        the dialect serialises them here until the transaction ends.
        """

    def cleanup(self, conn: Connection, *, older_than: float, batch: int) -> int:
        """Delete at most ``batch`` inbox rows processed more than ``older_than`` seconds ago.

        Returns the rows deleted; call again until it returns less than ``batch``.
        """
        t = self.tables.inbox
        # Keys first, then delete by key (as in cleanup): MySQL rejects LIMIT in
        # an IN subquery and SQL Server escalates big deletes to a table lock.
        pick = (
            sa.select(t.c.consumer, t.c.event_id)
            .where(t.c.processed_at < self.sql.after(-older_than))
            .order_by(t.c.processed_at)
            .limit(batch)
        )
        with self.sql.transaction(conn):
            picked = list(conn.execute(pick))
            deleted = 0
            # In chunks a statement can bind (SQL Server: 2,100 parameters; a
            # chunk binds at most two per row).
            for chunk in chunked(picked, self.sql.max_batch):
                by_consumer: dict[str, list[str]] = {}
                for consumer, event_id in chunk:
                    by_consumer.setdefault(consumer, []).append(str(event_id))
                # One (consumer = ? AND event_id IN (...)) per consumer: it uses the
                # primary key on every database, with no row-value IN (SQL Server has none).
                match = sa.or_(
                    *(
                        sa.and_(t.c.consumer == consumer, t.c.event_id.in_(ids))
                        for consumer, ids in by_consumer.items()
                    )
                )
                deleted += conn.execute(sa.delete(t).where(match)).rowcount
            return deleted
