"""The outbox table as the log-tailing relay uses it: rows from the log, dead rows, cleanup.

The relay builds events from the log and writes nothing per event; it
touches the table only for what the log cannot do: marking a dead event,
reading rows ``outbox replay`` returned to pending, the keys held by dead
rows, and removing old rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import MAX_ERROR, Dialect
from outbox_core.dialects.postgresql.wal.pgoutput import load_text
from outbox_core.dialects.postgresql.wal.stream import WalRow
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import Event, State
from outbox_core.schema import in_state


class WalTable:
    """The outbox table's statements for log tailing (PostgreSQL only)."""

    def __init__(self, dialect: Dialect) -> None:
        from outbox_core.dialects.postgresql import PostgresqlDialect

        if not isinstance(dialect, PostgresqlDialect):
            raise UnsupportedDatabase(
                f"--source wal reads PostgreSQL's logical replication, not {dialect.family}: "
                "use --source table"
            )
        self.dialect = dialect
        self.table = dialect.table
        self.columns = dialect.claim_columns(self.table)
        stmt = postgresql.insert(self.table)
        # By event_id: the row may have been removed by cleanup already (then it is
        # inserted again, dead; that insert is in the log with state DEAD, skipped).
        self._dead = stmt.on_conflict_do_update(
            index_elements=[self.table.c.event_id],
            set_={
                "state": stmt.excluded.state,
                "attempts": stmt.excluded.attempts,
                "last_error": stmt.excluded.last_error,
                "lease_owner": None,
                "lease_until": None,
            },
            # A row dead already keeps its first cause: after a reconnect the
            # relay reads it again and holds it behind its own key.
            where=self.table.c.state != int(State.DEAD),
        )

    def event(self, row: WalRow, token: str) -> tuple[Event, datetime]:
        """An inserted row as :meth:`Dialect.to_event` builds it from a claim, and its
        ``available_at``.

        Columns the dialect reads as text (``event_id``, ``payload``,
        ``headers``) keep the log's text; the others are loaded by type oid.
        """
        values, oids = row.values, row.type_oids
        claimed = [
            values[c.name]
            if isinstance(c.type, sa.Text)
            else load_text(values[c.name], oids[c.name])
            for c in self.columns
        ]
        # attempts_offset 1: the event carries its attempt number, as a claim's does.
        event = self.dialect.to_event(claimed, token, attempts_offset=1)
        return event, load_text(values["available_at"], oids["available_at"])

    @staticmethod
    def is_pending(row: WalRow) -> bool:
        """The row's (new) state is pending: an enqueued row, or a replayed one."""
        return row.values.get("state") == str(int(State.PENDING))

    def replayed(
        self, conn: Connection, ids: Sequence[int], token: str
    ) -> list[tuple[Event, datetime]]:
        """Rows among ``ids`` still pending, in id order (an update's TOAST is not in the log)."""
        t = self.table
        query = (
            sa.select(*self.columns, t.c.available_at)
            .where(self.dialect.id_in(ids), in_state(t.c.state, State.PENDING))
            .order_by(t.c.id)
        )
        rows = conn.execute(query).all()
        return [(self.dialect.to_event(r[:-1], token, attempts_offset=1), r[-1]) for r in rows]

    def mark_dead(self, conn: Connection, dead: Sequence[tuple[Event, int, str]]) -> None:
        """``(event, attempts, error)``: each row dead, in one transaction."""
        now = datetime.now(UTC)
        rows: list[Mapping[str, Any]] = [
            {
                "id": event.id,
                "event_id": event.event_id,
                "topic": event.topic,
                "key": event.key,
                "payload": event.payload,
                "headers": dict(event.headers) or None,
                "state": int(State.DEAD),
                "attempts": attempts,
                "available_at": now,
                "created_at": event.created_at,
                "last_error": error[:MAX_ERROR],
            }
            for event, attempts, error in dead
        ]
        with self.dialect.transaction(conn):
            conn.execute(self._dead, rows)

    def dead_keys(self, conn: Connection) -> set[str]:
        """Keys with a dead row (they hold their later events, ``block_on_dead``)."""
        t = self.table
        query = sa.select(t.c.key).where(in_state(t.c.state, State.DEAD), t.c.key.is_not(None))
        return {str(k) for k in conn.execute(query.distinct()).scalars()}

    def cleanup(self, conn: Connection, *, older_than: float, batch: int) -> int:
        """Delete at most ``batch`` rows but dead ones, due more than ``older_than`` s ago.

        Their events came from the log: the table serves only status, dead
        rows and replays. ``available_at`` is the age (a replay renews it, so
        a replayed row is not removed before the relay reads it back).
        """
        t = self.table
        old = sa.and_(
            in_state(t.c.state, State.PENDING, State.SENT),
            t.c.available_at < self.dialect.after(-older_than),
        )
        pick = self.dialect.lock_rows(sa.select(t.c.id).where(old).limit(batch))
        with self.dialect.transaction(conn):
            ids = list(conn.execute(pick).scalars())
            if ids:
                conn.execute(sa.delete(t).where(self.dialect.id_in(ids)))
        return len(ids)
