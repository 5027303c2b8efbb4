"""Reading the outbox table: ``outbox status``, the doctor, migrate (a part of Dialect)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.primitives import SqlPrimitives
from outbox_core.dialects.base.values import Activity, Backlog, LiveLeases
from outbox_core.message import State
from outbox_core.schema import in_state


class TableReads:
    """Named reads (and the bulk insert) of the outbox table: the SQL lives here, not in callers."""

    def __init__(self, sql: SqlPrimitives) -> None:
        self.sql = sql
        self.table = sql.table

    def state_counts(self, conn: Connection) -> dict[str, int]:
        """Rows per state, by lower-case state name (every state, 0 when none)."""
        t = self.table
        counts = {s.name.lower(): 0 for s in State}
        for state, n in conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state)):
            counts[State(state).name.lower()] = int(n)
        return counts

    def activity(self, conn: Connection) -> Activity:
        """The oldest pending event, the last minute's traffic, the last send (status)."""
        t = self.table
        minute_ago = self.sql.after(-60)
        row = conn.execute(
            sa.select(
                sa.select(sa.func.min(t.c.created_at))
                .where(in_state(t.c.state, State.PENDING))
                .scalar_subquery(),
                self.sql.now(),
                sa.select(sa.func.count()).where(t.c.created_at >= minute_ago).scalar_subquery(),
                sa.select(sa.func.count()).where(t.c.sent_at >= minute_ago).scalar_subquery(),
                sa.select(sa.func.max(t.c.sent_at))
                .where(in_state(t.c.state, State.SENT))
                .scalar_subquery(),
            )
        ).one()
        return Activity(row[0], row[1], int(row[2] or 0), int(row[3] or 0), row[4])

    def backlog(self, conn: Connection) -> Backlog:
        """Pending and due events, the oldest due, expired leases (``outbox doctor``)."""
        t = self.table
        now = self.sql.now()
        pending = in_state(t.c.state, State.PENDING)
        due = sa.and_(pending, t.c.available_at <= now)
        row = conn.execute(
            sa.select(
                sa.select(sa.func.count()).select_from(t).where(pending).scalar_subquery(),
                sa.select(sa.func.count()).select_from(t).where(due).scalar_subquery(),
                sa.select(sa.func.min(t.c.available_at)).where(due).scalar_subquery(),
                sa.select(sa.func.count())
                .select_from(t)
                .where(in_state(t.c.state, State.LEASED), t.c.lease_until < now)
                .scalar_subquery(),
                now,
            )
        ).one()
        return Backlog(int(row[0]), int(row[1]), row[2], int(row[3]), row[4])

    def dead_by_topic(self, conn: Connection) -> list[tuple[str, int, str | None]]:
        """``(topic, dead events, the newest one's error)``, most dead first."""
        t = self.table
        per_topic = (
            sa.select(t.c.topic, sa.func.count().label("n"), sa.func.max(t.c.id).label("last"))
            .where(in_state(t.c.state, State.DEAD))
            .group_by(t.c.topic)
            .subquery()
        )
        rows = conn.execute(
            sa.select(per_topic.c.topic, per_topic.c.n, t.c.last_error)
            .join_from(per_topic, t, t.c.id == per_topic.c.last)
            .order_by(per_topic.c.n.desc(), per_topic.c.topic)
        ).all()
        return [(str(topic), int(n), error) for topic, n, error in rows]

    def count_in_states(self, conn: Connection, states: Sequence[int]) -> int:
        """Rows in any of ``states``."""
        t = self.table
        query = sa.select(sa.func.count()).select_from(t).where(in_state(t.c.state, *states))
        return int(conn.execute(query).scalar_one())

    def page(
        self,
        conn: Connection,
        columns: Sequence[sa.ColumnElement[Any]],
        states: Sequence[int],
        *,
        after_id: int | None,
        limit: int,
    ) -> list[Sequence[Any]]:
        """The next ``limit`` rows in ``states`` after ``after_id``, in id order (migrate)."""
        t = self.table
        query = sa.select(*columns).where(in_state(t.c.state, *states))
        if after_id is not None:
            query = query.where(t.c.id > after_id)
        return list(conn.execute(query.order_by(t.c.id).limit(limit)).all())

    def by_event_id(
        self, conn: Connection, columns: Sequence[sa.ColumnElement[Any]], event_ids: Sequence[str]
    ) -> list[Sequence[Any]]:
        """``columns`` of the rows whose ``event_id`` is among ``event_ids`` (any order)."""
        t = self.table
        query = sa.select(*columns).where(t.c.event_id.in_(list(event_ids)))
        return list(conn.execute(query).all())

    def live_leases(self, conn: Connection, *, owners: int = 20) -> LiveLeases:
        """Leases not yet expired: how many, until when, and some of their tokens."""
        t = self.table
        live = sa.and_(in_state(t.c.state, State.LEASED), t.c.lease_until > self.sql.now())
        count, until = conn.execute(
            sa.select(sa.func.count(), sa.func.max(t.c.lease_until)).where(live)
        ).one()
        tokens = conn.execute(
            sa.select(t.c.lease_owner).where(live).distinct().limit(owners)
        ).scalars()
        return LiveLeases(int(count), until, [str(o) for o in tokens if o])

    def insert_rows(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert whole rows (migrate), as one executemany."""
        # One executemany: multi-row INSERTs on PyMySQL, a pipeline on psycopg
        # (faster there than SQLAlchemy's multi-row VALUES).
        conn.execute(sa.insert(self.table), list(rows))
