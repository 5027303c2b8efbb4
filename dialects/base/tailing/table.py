"""The outbox table as the log-tailing relay uses it: dead rows, replays, cleanup.

The relay builds events from the log and writes nothing per event; it
touches the table only for what the log cannot do: marking a dead event,
reading rows ``outbox replay`` returned to pending, the keys held by dead
rows, removing old rows, the events handed to the table to wait
(:mod:`.deferred_rows`) and its progress row (:mod:`.progress_row`).
Plain SQLAlchemy Core but for the upserts, which the database's
:class:`~outbox_core.dialects.base.tailing.writes.TableWrites` spells.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import Dialect
from outbox_core.dialects.base.tailing.deferred_rows import DEFERRED, DeferredRows, whole_row
from outbox_core.dialects.base.tailing.progress_row import ProgressRows
from outbox_core.dialects.base.tailing.writes import TableWrites
from outbox_core.dialects.base.values import aware
from outbox_core.message import Event, State
from outbox_core.schema import in_state


class LogTable:
    """The outbox table's statements for log tailing."""

    def __init__(self, dialect: Dialect, writes: TableWrites) -> None:
        self.dialect = dialect
        self.table = t = dialect.table
        self.columns = dialect.claim_columns(t)
        #: Events handed to the table to wait.
        self.deferred = DeferredRows(dialect, writes)
        #: ``<table>_wal``, the relays' progress rows.
        self.progress = ProgressRows(dialect, writes)
        # By event_id: the row may have been removed by cleanup already (then it is
        # inserted again, dead; that insert is in the log with state DEAD, skipped).
        self.killing = writes.upsert_by_event_id(
            t,
            update=["state", "attempts", "last_error", "lease_owner", "lease_until"],
            # A row dead already keeps its first cause: after a reconnect the
            # relay reads it again and holds it behind its own key.
            where=t.c.state != int(State.DEAD),
        )

    def replayed(
        self, conn: Connection, ids: Sequence[int], token: str
    ) -> list[tuple[Event, datetime]]:
        """Rows among ``ids`` still pending, in id order (an update's TOAST is not in the log).

        The log may show the replay's commit before other sessions can see it:
        MySQL sends the binlog before InnoDB commits, and PostgreSQL writes the
        commit record before the transaction ends. A plain read could then find
        the rows still dead and the replay would be lost. A locking read, by id
        only (PostgreSQL locks only rows its snapshot matched), waits for the
        replay's transaction and reads what it wrote.
        """
        t = self.table
        query = (
            sa.select(*self.columns, t.c.available_at, t.c.state)
            .where(self.dialect.id_in(ids))
            .order_by(t.c.id)
            .with_for_update(read=True)
        )
        rows = [r for r in conn.execute(query) if r[-1] == int(State.PENDING)]
        return [
            (self.dialect.to_event(r[:-2], token, attempts_offset=1), aware(r[-2])) for r in rows
        ]

    def mark_dead(self, conn: Connection, dead: Sequence[tuple[Event, int, str]]) -> None:
        """``(event, attempts, error)``: each row dead, in one transaction."""
        now = datetime.now(UTC)
        rows = [
            whole_row(event, State.DEAD, attempts, now, error) for event, attempts, error in dead
        ]
        with self.dialect.transaction(conn):
            conn.execute(self.killing, rows)

    def dead_keys(self, conn: Connection) -> set[str]:
        """Keys with a dead row (they hold their later events, ``block_on_dead``)."""
        t = self.table
        query = sa.select(t.c.key).where(in_state(t.c.state, State.DEAD), t.c.key.is_not(None))
        return {str(k) for k in conn.execute(query.distinct()).scalars()}

    def dead_count(self, conn: Connection) -> int:
        """Dead rows (the partial index of dead rows: cheap on a table of pending rows)."""
        t = self.table
        query = sa.select(sa.func.count()).where(in_state(t.c.state, State.DEAD))
        return int(conn.execute(query).scalar_one())

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
            # A deferred row is an event still to publish.
            t.c.lease_owner.is_distinct_from(DEFERRED),
        )
        pick = self.dialect.lock_rows(sa.select(t.c.id).where(old).limit(batch))
        with self.dialect.transaction(conn):
            ids = list(conn.execute(pick).scalars())
            if ids:
                conn.execute(sa.delete(t).where(self.dialect.id_in(ids)))
        return len(ids)

    def oldest_created_since(self, conn: Connection, since: datetime) -> datetime | None:
        """``created_at`` of the oldest pending row created after ``since`` (a lower bound
        of what no relay has read when none reports)."""
        t = self.table
        query = sa.select(sa.func.min(t.c.created_at)).where(
            in_state(t.c.state, State.PENDING), t.c.created_at > since
        )
        oldest = conn.execute(query).scalar()
        return None if oldest is None else aware(oldest)
