"""Events handed to the table to wait (a long delay or backoff) instead of in memory.

Such a row stays pending with ``lease_owner`` :data:`DEFERRED`, and the
hand-over order (the log's commit order, which ids need not follow) in
``lease_until``. The relay publishes due ones from here, each key's in
hand-over order, and settles them here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import MAX_ERROR, Dialect
from outbox_core.dialects.base.tailing.writes import TableWrites
from outbox_core.dialects.base.values import aware
from outbox_core.message import Event, State
from outbox_core.schema import in_state

#: ``lease_owner`` of a row handed back to the table: its event waits there (a long
#: delay or backoff) instead of in the relay's memory, which would hold the log.
DEFERRED = "wal:deferred"

#: The columns (by field: ``table.c[...]``) :func:`whole_row` gives a value for.
WHOLE_ROW = (
    "id",
    "event_id",
    "topic",
    "key",
    "payload",
    "headers",
    "state",
    "attempts",
    "available_at",
    "lease_owner",
    "lease_until",
    "created_at",
    "last_error",
)


def whole_row(
    event: Event,
    state: State,
    attempts: int,
    available_at: datetime,
    error: str | None,
    *,
    owner: str | None = None,
    until: datetime | None = None,
) -> Mapping[str, Any]:
    """A whole row of ``event`` for an upsert by ``event_id`` (cleanup may have removed it).

    Keyed by field (:data:`WHOLE_ROW`): SQLAlchemy binds a row's values by column
    key, which an adopted table's columns keep whatever their names.
    """
    return {
        "id": event.id,
        "event_id": event.event_id,
        "topic": event.topic,
        "key": event.key,
        "payload": event.payload,
        "headers": dict(event.headers) or None,
        "state": int(state),
        "attempts": attempts,
        "available_at": available_at,
        "lease_owner": owner,
        "lease_until": until,
        "created_at": event.created_at,
        "last_error": None if error is None else error[:MAX_ERROR],
    }


def is_deferred(t: sa.FromClause) -> sa.ColumnElement[bool]:
    """Pending and handed to the table; the marker inline, as the index's predicate is
    (a bound value would not match it in a generic plan)."""
    marker = sa.literal(DEFERRED, literal_execute=True)
    return sa.and_(in_state(t.c.state, State.PENDING), t.c.lease_owner == marker)


class DeferredRows:
    """The statements of the rows handed to the table."""

    def __init__(self, dialect: Dialect, writes: TableWrites) -> None:
        self.dialect = dialect
        self.table = t = dialect.table
        self.columns = dialect.claim_columns(t)
        self.where = is_deferred(t)
        # By event_id, as for dead rows; only a row not already handed over (a
        # reconnect resends its insert) or sent (by the table path) changes.
        self.handing = writes.upsert_by_event_id(
            t,
            update=["lease_owner", "lease_until", "available_at", "attempts", "last_error"],
            where=sa.and_(in_state(t.c.state, State.PENDING), t.c.lease_owner.is_(None)),
        )

    def defer(
        self, conn: Connection, rows: Sequence[tuple[Event, int, datetime, datetime, str | None]]
    ) -> None:
        """``(event, attempts, due, order, error)``: hand each event to the table, one transaction.

        ``order`` (in ``lease_until``) keeps the hand-over order, which is the
        log's commit order: ids need not be.
        """
        values = [
            whole_row(event, State.PENDING, attempts, due, error, owner=DEFERRED, until=order)
            for event, attempts, due, order, error in rows
        ]
        with self.dialect.transaction(conn):
            conn.execute(self.handing, values)

    def keys(self, conn: Connection, among: Collection[str] | None = None) -> set[str]:
        """Keys (of ``among``, or all) with events waiting in the table: the key's later
        events wait there too."""
        t = self.table
        query = sa.select(t.c.key).where(self.where, t.c.key.is_not(None)).distinct()
        if among is not None:
            query = query.where(t.c.key.in_(sorted(among)))
        return {str(k) for k in conn.execute(query).scalars()}

    def last_handed(self, conn: Connection) -> datetime | None:
        """The hand-over order (``lease_until``) of the last row handed over."""
        t = self.table
        last = conn.execute(sa.select(sa.func.max(t.c.lease_until)).where(self.where)).scalar()
        return None if last is None else aware(last)

    def _heads(self, t: sa.FromClause, *, due: bool) -> sa.ColumnElement[bool]:
        """No earlier deferred row of the key (``due``: none not due yet)."""
        earlier = self.table.alias("earlier")
        before = sa.tuple_(earlier.c.lease_until, earlier.c.id) < sa.tuple_(t.c.lease_until, t.c.id)
        conditions = [is_deferred(earlier), earlier.c.key == t.c.key, before]
        if due:
            conditions.append(earlier.c.available_at > sa.func.now())
        return ~sa.select(earlier.c.id).where(*conditions).exists()

    def next_due(self, conn: Connection) -> datetime | None:
        """When the earliest key's first deferred row is due (None: no deferred row)."""
        t = self.table
        query = sa.select(sa.func.min(t.c.available_at)).where(
            self.where, self._heads(t, due=False)
        )
        due = conn.execute(query).scalar()
        return None if due is None else aware(due)

    def due_runs(
        self, conn: Connection, limit: int, token: str, *, block_on_dead: bool = True
    ) -> list[tuple[Event, int]]:
        """Deferred events now due, each key's from its first in hand-over order, and the
        attempts each has spent.

        A key whose first deferred event is not due yet gives none (its later
        ones wait behind it); with ``block_on_dead`` neither does a key with a
        dead row.
        """
        t = self.table
        where = [self.where, t.c.available_at <= sa.func.now(), self._heads(t, due=True)]
        if block_on_dead:
            dead = self.table.alias("dead")
            where.append(
                ~sa.select(dead.c.id)
                .where(in_state(dead.c.state, State.DEAD), dead.c.key == t.c.key)
                .exists()
            )
        query = (
            sa.select(*self.columns).where(*where).order_by(t.c.lease_until, t.c.id).limit(limit)
        )
        return [
            (self.dialect.to_event(r, token, attempts_offset=1), int(r[6]))
            for r in conn.execute(query)
        ]

    def settle(
        self,
        conn: Connection,
        *,
        sent: Sequence[int],
        retries: Sequence[tuple[int, int, float, str]],
        delete: bool,
    ) -> None:
        """Deferred rows published (``sent`` ids) and to try again ``(id, attempts, in, error)``."""
        t = self.table
        with self.dialect.transaction(conn):
            if sent:
                mine = sa.and_(self.dialect.id_in(sent), self.where)
                if delete:
                    conn.execute(sa.delete(t).where(mine))
                else:
                    conn.execute(
                        sa.update(t)
                        .where(mine)
                        .values(
                            state=int(State.SENT),
                            sent_at=sa.func.now(),
                            lease_owner=None,
                            lease_until=None,
                        )
                    )
            for row_id, attempts, delay, error in retries:
                conn.execute(
                    sa.update(t)
                    .where(t.c.id == row_id, self.where)
                    .values(
                        attempts=attempts,
                        available_at=self.dialect.after(delay),
                        last_error=error[:MAX_ERROR],
                    )
                )

    def kill(self, conn: Connection, keys: set[str]) -> None:
        """The deferred rows of ``keys`` dead, held behind a dead event of their key."""
        t = self.table
        with self.dialect.transaction(conn):
            conn.execute(
                sa.update(t)
                .where(self.where, t.c.key.in_(sorted(keys)))
                .values(
                    state=int(State.DEAD),
                    lease_owner=None,
                    lease_until=None,
                    last_error=sa.func.concat(
                        "held: an earlier event of key ", t.c.key, " is dead"
                    ),
                )
            )

    def due_age(self, conn: Connection) -> float | None:
        """Seconds the earliest due deferred event has been due (None: none is due)."""
        t = self.table
        waited = sa.extract("epoch", sa.func.now() - sa.func.min(t.c.available_at))
        found = conn.execute(
            sa.select(waited).where(self.where, t.c.available_at <= sa.func.now())
        ).scalar()
        return None if found is None else max(0.0, float(found))

    def oldest(self, conn: Connection) -> tuple[int, datetime | None]:
        """How many events wait in the table, and the oldest one's ``created_at``."""
        t = self.table
        row = conn.execute(
            sa.select(sa.func.count(), sa.func.min(t.c.created_at)).where(self.where)
        ).one()
        return int(row[0]), None if row[1] is None else aware(row[1])
