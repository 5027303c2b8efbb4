"""SQL Server inbox: insert-if-absent under a key-range lock."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql.dml import Insert

from outbox_core.dialects.base import InboxStatements


class MssqlInbox(InboxStatements):
    """``INSERT ... SELECT ... WHERE NOT EXISTS`` with UPDLOCK, HOLDLOCK."""

    def insert(self, consumer: str, event_id: str) -> Insert:
        """``INSERT ... SELECT ... WHERE NOT EXISTS (... WITH (UPDLOCK, HOLDLOCK) ...)``.

        SQL Server has no insert-or-ignore. UPDLOCK, HOLDLOCK make the existence
        check take a key-range lock held to commit: a second transaction checking
        the same key waits for the first instead of also seeing "absent" and
        failing on the primary key. The hinted read locks under
        READ_COMMITTED_SNAPSHOT too, instead of reading an old version.
        """
        t = self.tables.inbox
        existing: sa.Select[Any] = (
            sa.select(sa.literal_column("1"))
            .select_from(t)
            .where(t.c.consumer == consumer, t.c.event_id == event_id)
            .with_hint(t, "WITH (UPDLOCK, HOLDLOCK)", "mssql")
        )
        row = sa.select(
            sa.literal(consumer, t.c.consumer.type),
            sa.literal(event_id, t.c.event_id.type),
            self.sql.now(),
        ).where(~existing.exists())
        return sa.insert(t).from_select(["consumer", "event_id", "processed_at"], row)
