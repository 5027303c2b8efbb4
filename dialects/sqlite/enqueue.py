"""SQLite's enqueue: the caller's own event ids guarded in a savepoint it cannot commit."""

from __future__ import annotations

import sqlalchemy as sa

from outbox_core.dialects.base import EnqueueStatements


class SqliteEnqueue(EnqueueStatements):
    """The base statements; the guarded inserts first open the driver's transaction."""

    def guard_begin(self) -> list[sa.Executable]:
        """A write that changes nothing, then the savepoint.

        Python's ``sqlite3`` (legacy transaction control, the default) sends
        ``BEGIN`` only before a write. A ``SAVEPOINT`` sent first would open
        the transaction itself, and its ``RELEASE`` would then commit it,
        the caller's writes with it. The write before makes the savepoint a
        nested one, whatever the caller did before.
        """
        return [sa.delete(self.table).where(sa.false()), *super().guard_begin()]
