"""PostgreSQL's inbox insert: ``ON CONFLICT DO NOTHING``."""

from __future__ import annotations

from sqlalchemy.sql.dml import Insert

from outbox_core.dialects.base import InboxStatements


class PostgresqlInbox(InboxStatements):
    """Insert-if-absent on the inbox's primary key."""

    def insert(self, consumer: str, event_id: str) -> Insert:
        """``INSERT ... ON CONFLICT (consumer, event_id) DO NOTHING``.

        A concurrent insert of the same key waits for the other transaction and
        then does nothing if it committed. At REPEATABLE READ or SERIALIZABLE a
        conflict with a row committed after the snapshot raises a serialization
        failure instead: consumers should use READ COMMITTED (the default).
        """
        from sqlalchemy.dialects.postgresql import insert

        t = self.tables.inbox
        return (
            insert(t)
            .values(consumer=consumer, event_id=event_id, processed_at=self.sql.now())
            .on_conflict_do_nothing(index_elements=[t.c.consumer, t.c.event_id])
        )
