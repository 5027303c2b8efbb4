"""SQLite inbox: ``ON CONFLICT DO NOTHING``."""

from __future__ import annotations

from sqlalchemy.sql.dml import Insert

from outbox_core.dialects.base import InboxStatements


class SqliteInbox(InboxStatements):
    """Insert-if-absent on the inbox's primary key."""

    def insert(self, consumer: str, event_id: str) -> Insert:
        """``INSERT ... ON CONFLICT (consumer, event_id) DO NOTHING``.

        Unlike ``INSERT OR IGNORE`` it ignores only the primary-key conflict,
        not NOT NULL or CHECK failures. Writers take turns on the database's
        write lock, so a concurrent duplicate waits and then inserts nothing.
        """
        from sqlalchemy.dialects.sqlite import insert

        t = self.tables.inbox
        return (
            insert(t)
            .values(consumer=consumer, event_id=event_id, processed_at=self.sql.now())
            .on_conflict_do_nothing(index_elements=[t.c.consumer, t.c.event_id])
        )
