"""MySQL / MariaDB inbox: ``INSERT IGNORE`` behind a named lock per key."""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql.dml import Insert

from outbox_core.dialects.base import InboxStatements
from outbox_core.errors import DatabaseError


class MysqlInbox(InboxStatements):
    """Insert-if-absent that InnoDB cannot deadlock on."""

    def guard(self, conn: Connection, consumer: str, event_id: str) -> None:
        """A named lock (``GET_LOCK``) per (consumer, event id) until the transaction ends.

        InnoDB alone deadlocks here: when the first inserter of a key rolls
        back, every consumer waiting on that key holds a lock on it and all
        of them try to insert (error 1213, and InnoDB rolls back the whole
        business transaction). With the named lock only one consumer at a
        time reaches the key; the rest wait for the lock (up to
        ``innodb_lock_wait_timeout``), then find its row. The lock is
        released when the transaction commits or rolls back.
        """
        digest = hashlib.sha1(
            f"{self.tables.inbox.fullname}\0{consumer}\0{event_id}".encode(), usedforsecurity=False
        ).hexdigest()
        name = f"outbox_inbox_{digest}"  # lock names hold at most 64 characters
        timeout: sa.ColumnElement[int] = sa.literal_column("@@innodb_lock_wait_timeout")
        got = conn.execute(sa.select(sa.func.get_lock(name, timeout))).scalar()
        if got != 1:
            raise DatabaseError(
                f"inbox: timed out waiting for another consumer recording event {event_id} "
                f"for {consumer!r} (innodb_lock_wait_timeout)"
            )
        _release_at_transaction_end(conn, name)

    def insert(self, consumer: str, event_id: str) -> Insert:
        """``INSERT IGNORE``: a duplicate key is skipped (0 rows) instead of failing.

        IGNORE also turns truncation into a warning, which is why ``Inbox``
        validates the consumer's length and the event id's form beforehand. A
        concurrent insert of the same key waits on its record lock, then is
        ignored if the other transaction committed. (Not ``ON DUPLICATE KEY
        UPDATE``: the driver's FOUND_ROWS flag would report a duplicate as 1 row.)
        """
        t = self.tables.inbox
        return (
            sa.insert(t)
            .values(consumer=consumer, event_id=event_id, processed_at=self.sql.now())
            .prefix_with("IGNORE")
        )


def _release_at_transaction_end(conn: Connection, name: str) -> None:
    """``RELEASE_LOCK(name)`` when the transaction on ``conn`` commits or rolls back.

    Named locks belong to the session, not the transaction: without this a
    pooled connection would keep it. Runs just before the COMMIT/ROLLBACK,
    on the driver's connection (no new SQLAlchemy transaction from an event).
    """
    released = False

    def release(connection: Connection) -> None:
        nonlocal released
        if released:
            return
        released = True
        dbapi = connection.connection.dbapi_connection
        if dbapi is None:
            return
        cursor = dbapi.cursor()
        try:
            cursor.execute("SELECT RELEASE_LOCK(%s)", (name,))
        finally:
            cursor.close()

    sa.event.listen(conn, "commit", release, once=True)
    sa.event.listen(conn, "rollback", release, once=True)
