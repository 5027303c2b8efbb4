"""The dashboard's reads of the outbox table (a part of Dialect).

Every read goes through the indexes the relays already keep (no index of
its own: each insert would pay for it) and takes no lock a relay waits on:
plain reads in a short transaction, never ``FOR UPDATE``. The history of
sent rows, which grows for days, is only ever read from an id on (the
primary key), never scanned by time: :meth:`ConsoleReads.first_id_since`
finds that id by a binary search over the primary key.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.primitives import SqlPrimitives, plain_read
from outbox_core.dialects.base.values import EventRow, FlowBucket, HeldKey, Overview
from outbox_core.message import State
from outbox_core.schema import in_state

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)
#: The discriminator of a flow row: counted by ``created_at`` or by ``sent_at``.
FLOW_CREATED, FLOW_SENT = 0, 1


def utc(value: datetime) -> datetime:
    """``value`` as an aware UTC datetime (the databases but PostgreSQL return naive UTC)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utc_or_none(value: datetime | None) -> datetime | None:
    """:func:`utc`, None kept."""
    return None if value is None else utc(value)


class ConsoleReads:
    """The dashboard's reads: an overview, the recent flow, lists of events, held keys.

    Each method runs in a short read transaction of its own, or joins the
    caller's open one. Families give :meth:`microseconds_between`, the one
    piece of SQL that differs.
    """

    def __init__(self, sql: SqlPrimitives) -> None:
        self.sql = sql
        self.table = sql.table

    # -- the family's SQL ------------------------------------------------------

    def microseconds_between(
        self, start: sa.ColumnElement[datetime], end: sa.ColumnElement[datetime]
    ) -> sa.ColumnElement[int]:
        """Whole microseconds from ``start`` to ``end``, as an integer expression."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot subtract timestamps: a family gives its own"
        )

    # -- reading ---------------------------------------------------------------

    def overview(self, conn: Connection) -> Overview:
        """Rows per state still to deliver, the oldest pending one, the newest id.

        One statement of scalar subqueries, each an index range (the pending,
        leased and dead indexes, the primary key), index-only where the
        database can.
        """
        t = self.table
        p = t.alias("p")
        first_pending = (
            sa.select(sa.func.min(p.c.id)).where(in_state(p.c.state, State.PENDING))
        ).scalar_subquery()

        def count(state: State) -> sa.ScalarSelect[Any]:
            return (
                sa.select(sa.func.count()).select_from(t).where(in_state(t.c.state, state))
            ).scalar_subquery()

        query = sa.select(
            self.sql.now(),
            count(State.PENDING),
            count(State.LEASED),
            count(State.DEAD),
            sa.select(t.c.created_at).where(t.c.id == first_pending).scalar_subquery(),
            first_pending,
            sa.select(sa.func.max(t.c.id)).scalar_subquery(),
        )
        with plain_read(conn):
            now, pending, leased, dead, created, first, newest = conn.execute(query).one()
        return Overview(
            now=utc(now),
            pending=int(pending or 0),
            leased=int(leased or 0),
            dead=int(dead or 0),
            oldest_pending_created=utc_or_none(created),
            oldest_pending_id=None if first is None else int(first),
            newest_id=None if newest is None else int(newest),
        )

    def first_id_since(self, conn: Connection, seconds: float) -> int | None:
        """The lowest id created in the last ``seconds`` (None: empty, or nothing that recent).

        Ids rise with ``created_at``, so a binary search over the primary key
        finds it: each probe reads the first row at or after an id, about
        log2(ids) probes, never a scan of the table. Where producers'
        inserts interleave, ids rise with ``created_at`` only roughly, and
        the boundary found is as close as their order allows.
        """
        t = self.table
        lo, hi = t.alias("lo"), t.alias("hi")
        lowest = sa.select(sa.func.min(lo.c.id)).scalar_subquery()
        highest = sa.select(sa.func.max(hi.c.id)).scalar_subquery()
        bounds = sa.select(
            self.sql.after(-seconds),
            lowest,
            highest,
            sa.select(t.c.created_at).where(t.c.id == highest).scalar_subquery(),
        )
        probe = (
            sa.select(t.c.id, t.c.created_at)
            .where(t.c.id >= sa.bindparam("o_from", type_=t.c.id.type))
            .order_by(t.c.id)
            .limit(1)
        )
        with plain_read(conn):
            since, low, high, newest_created = conn.execute(bounds).one()
            if low is None or newest_created is None or utc(newest_created) < utc(since):
                return None
            cutoff = utc(since)
            found: int | None = None
            low, high = int(low), int(high)
            while low <= high:
                middle = (low + high) // 2
                row = conn.execute(probe, {"o_from": middle}).first()
                if row is None:  # deleted since (cleanup): the answer lies below
                    high = middle - 1
                elif utc(row[1]) >= cutoff:
                    found, high = int(row[0]), middle - 1
                else:
                    low = int(row[0]) + 1
            return found

    def flow(
        self, conn: Connection, *, seconds: float, bucket: float, from_id: int | None
    ) -> list[FlowBucket]:
        """Rows created and sent per ``bucket`` seconds over the last ``seconds``, oldest first.

        Buckets start at whole multiples of ``bucket`` since the Unix epoch
        (whole minutes for 60), so they stay put from one call to the next;
        the oldest may start before ``now - seconds``. Empty buckets are
        included. Only rows with ``id >= from_id`` are counted (the caller
        passes :meth:`first_id_since`; pass one for ``seconds + bucket`` to
        fill the oldest bucket, or a lower id to see a backlog created earlier
        and sent in the window); ``from_id=None``, nothing created that
        recently: every bucket is empty. Two statements: the clock, then both
        counts grouped in SQL.
        """
        if seconds <= 0 or bucket <= 0:
            raise ValueError(f"seconds and bucket must be positive, not {seconds} and {bucket}")
        width = max(1, round(bucket * 1_000_000))
        with plain_read(conn):
            clock = conn.execute(sa.select(self.sql.now())).scalar_one()
            now = (utc(clock) - EPOCH) // MICROSECOND
            first = (now - round(seconds * 1_000_000)) // width
            buckets = now // width - first + 1
            origin = EPOCH + first * width * MICROSECOND
            counts: dict[tuple[int, int], int] = {}
            if from_id is not None:
                # Bound as the database returned its clock: naive where it stores naive UTC.
                bound = origin if clock.tzinfo is not None else origin.replace(tzinfo=None)
                query = self.flow_counts(bound, width, from_id)
                counts = {(int(k), int(b)): int(n) for k, b, n in conn.execute(query)}
        return [
            FlowBucket(
                start=origin + i * width * MICROSECOND,
                created=counts.get((FLOW_CREATED, i), 0),
                sent=counts.get((FLOW_SENT, i), 0),
            )
            for i in range(buckets)
        ]

    def flow_counts(self, origin: datetime, width: int, from_id: int) -> sa.CompoundSelect[Any]:
        """``(FLOW_CREATED or FLOW_SENT, bucket number, rows)``: buckets of ``width`` microseconds
        from ``origin``, among ids from ``from_id`` (a range of the primary key)."""
        t = self.table

        def per_bucket(kind: int, column: sa.Column[datetime]) -> sa.Select[Any]:
            since = sa.literal(origin, column.type)
            number = self.microseconds_between(since, column) // sa.literal(width, sa.BigInteger())
            # Grouped by a column of a subquery: SQL Server and PostgreSQL refuse a
            # GROUP BY expression whose parameters are bound apart from the select list's.
            rows = (
                sa.select(number.label("b"))
                .where(t.c.id >= sa.literal(from_id, t.c.id.type), column >= since)
                .subquery()
            )
            kind_column = sa.literal_column(str(kind), sa.Integer()).label("k")
            return sa.select(kind_column, rows.c.b, sa.func.count()).group_by(rows.c.b)

        return sa.union_all(
            per_bucket(FLOW_CREATED, t.c.created_at), per_bucket(FLOW_SENT, t.c.sent_at)
        )

    def list_columns(self) -> list[sa.ColumnElement[Any]]:
        """The columns of a listed event, in :class:`EventRow` order (no payload or headers)."""
        c = self.table.c
        return [
            c.id, c.event_id, c.topic, c.key, c.state, c.attempts, c.created_at,
            c.available_at, c.sent_at, c.lease_until, c.key_partition, c.last_error,
        ]  # fmt: skip

    def events(
        self,
        conn: Connection,
        *,
        states: Sequence[int],
        topic: str | None = None,
        key: str | None = None,
        error: str | None = None,
        before_id: int | None = None,
        limit: int = 50,
    ) -> list[EventRow]:
        """Events in ``states``, newest first; the next page: ``before_id`` = the last id shown.

        ``topic`` and ``key`` match exactly, ``error`` is a case-insensitive
        substring of ``last_error`` (``%`` and ``_`` in it are plain
        characters). Each state is read through its own index (the pending,
        leased and dead indexes, the primary key backwards for sent rows), up
        to ``limit`` rows each, and the newest ``limit`` of them kept.
        Payloads and headers are not read.
        """
        wanted = sorted({int(s) for s in states})
        if not wanted or limit <= 0:
            return []
        t = self.table
        where: list[sa.ColumnElement[bool]] = []
        if topic is not None:
            where.append(t.c.topic == topic)
        if key is not None:
            where.append(t.c.key == key)
        if error is not None:
            where.append(t.c.last_error.icontains(error, autoescape=True))
        if before_id is not None:
            where.append(t.c.id < before_id)

        def newest(state: int) -> sa.Select[Any]:
            return (
                sa.select(*self.list_columns())
                .where(in_state(t.c.state, state), *where)
                .order_by(t.c.id.desc())
                .limit(limit)
            )

        query = newest(wanted[0])
        if len(wanted) > 1:
            branches = [newest(s).subquery(f"s{s}") for s in wanted]
            merged = sa.union_all(*(sa.select(*b.c) for b in branches)).subquery("u")
            query = sa.select(*merged.c).order_by(merged.c.id.desc()).limit(limit)
        with plain_read(conn):
            rows = conn.execute(query).all()
        return [self.event_row(row) for row in rows]

    def event(self, conn: Connection, id: int) -> EventRow | None:
        """The event ``id`` with its payload and headers (None: no such row)."""
        t = self.table
        query = sa.select(*self.list_columns(), t.c.payload, t.c.headers).where(t.c.id == id)
        with plain_read(conn):
            row = conn.execute(query).first()
        return None if row is None else self.event_row(row)

    @staticmethod
    def event_row(row: Sequence[Any]) -> EventRow:
        """An :class:`EventRow` from a row of :meth:`list_columns` (then payload, headers)."""
        payload = row[12] if len(row) > 12 else None
        headers = row[13] if len(row) > 13 else None
        return EventRow(
            id=int(row[0]),
            event_id=str(row[1]),
            topic=row[2],
            key=row[3],
            state=int(row[4]),
            attempts=int(row[5]),
            created_at=utc(row[6]),
            available_at=utc(row[7]),
            sent_at=utc_or_none(row[8]),
            lease_until=utc_or_none(row[9]),
            key_partition=None if row[10] is None else int(row[10]),
            last_error=row[11],
            payload=payload,
            headers=None if headers is None else dict(headers),
        )

    def held_keys(self, conn: Connection, *, limit: int = 100) -> list[HeldKey]:
        """Keys whose lowest unsent event is dead and has pending events behind it.

        Most waiting first. The dead heads come from the dead index (lowest
        dead id per key), each checked and counted through the pending and
        leased indexes of its key: work in proportion to the dead keys and
        the events they hold.
        """
        t = self.table
        d = t.alias("d")
        heads = (
            sa.select(d.c.key.label("key"), sa.func.min(d.c.id).label("dead_id"))
            .where(in_state(d.c.state, State.DEAD), d.c.key.is_not(None))
            .group_by(d.c.key)
            .subquery("heads")
        )

        def earlier(state: State, name: str) -> sa.Exists:
            e = t.alias(name)
            return sa.exists().where(
                in_state(e.c.state, state), e.c.key == heads.c.key, e.c.id < heads.c.dead_id
            )

        def behind(name: str) -> tuple[sa.FromClause, sa.ColumnElement[bool]]:
            b = t.alias(name)
            return b, sa.and_(
                in_state(b.c.state, State.PENDING),
                b.c.key == heads.c.key,
                b.c.id > heads.c.dead_id,
            )

        counted, counted_where = behind("w")
        firsts, firsts_where = behind("f")
        head = t.alias("h")
        found = (
            sa.select(
                heads.c.key,
                heads.c.dead_id,
                head.c.last_error,
                sa.select(sa.func.count())
                .select_from(counted)
                .where(counted_where)
                .scalar_subquery()
                .label("waiting"),
                sa.select(sa.func.min(firsts.c.id))
                .where(firsts_where)
                .scalar_subquery()
                .label("first_waiting"),
            )
            .join_from(heads, head, head.c.id == heads.c.dead_id)
            .where(~earlier(State.PENDING, "ep"), ~earlier(State.LEASED, "el"))
            .subquery("found")
        )
        # The first waiting row's created_at, joined here: a subquery two levels
        # below ``heads`` would not be correlated with it.
        o = t.alias("o")
        query = (
            sa.select(
                found.c.key, found.c.dead_id, found.c.last_error, found.c.waiting, o.c.created_at
            )
            .join_from(found, o, o.c.id == found.c.first_waiting)
            .where(found.c.waiting > 0)
            .order_by(found.c.waiting.desc(), found.c.dead_id)
            .limit(limit)
        )
        with plain_read(conn):
            rows = conn.execute(query).all()
        return [
            HeldKey(str(k), int(dead_id), error, int(waiting), utc_or_none(oldest))
            for k, dead_id, error, waiting, oldest in rows
        ]

    def sent_by_partition(
        self, conn: Connection, *, seconds: float, from_id: int | None
    ) -> dict[int, int]:
        """Rows sent in the last ``seconds`` per ``key_partition``, among ids from ``from_id``.

        Rows without a partition are left out. ``from_id`` bounds the read to
        a range of the primary key (``sent_at`` has no index);
        ``from_id=None`` (nothing created that recently): empty.
        """
        if from_id is None:
            return {}
        t = self.table
        query = (
            sa.select(t.c.key_partition, sa.func.count())
            .where(
                t.c.id >= from_id,
                t.c.sent_at >= self.sql.after(-seconds),
                t.c.key_partition.is_not(None),
            )
            .group_by(t.c.key_partition)
        )
        with plain_read(conn):
            rows = conn.execute(query).all()
        return {int(p): int(n) for p, n in rows}
