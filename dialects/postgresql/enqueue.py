"""PostgreSQL's enqueue statements: JSON bound as text, one array INSERT, NOTIFY at commit."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine

from outbox_core.dialects.base import EnqueueStatements, Listener
from outbox_core.message import NewEvent, State
from outbox_core.partitions import partition_of


class PgListener:
    """A psycopg connection that ``LISTEN``s on its channels."""

    def __init__(self, engine: Engine, channels: Sequence[str]) -> None:
        from psycopg import sql

        self._raw = engine.raw_connection()
        try:
            conn: Any = self._raw.driver_connection
            if conn is None:
                raise RuntimeError("the pool gave no driver connection")
            conn.autocommit = True
            # LISTEN has no SQLAlchemy construct; the channel is quoted as an identifier.
            for channel in channels:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            # Not back to the pool (left to the garbage collector it would be):
            # the pool's reset of a connection the server dropped logs a traceback.
            self._raw.invalidate()
            raise
        self._conn = conn

    def wait(self, timeout: float) -> bool:
        """True when a notification arrived within ``timeout`` seconds."""
        return any(True for _ in self._conn.notifies(timeout=timeout, stop_after=1))

    def received(self, timeout: float) -> list[str]:
        """The channels notified within ``timeout`` seconds (those already queued with them)."""
        first = [n.channel for n in self._conn.notifies(timeout=timeout, stop_after=1)]
        if not first:
            return []
        # Whatever else arrived meanwhile, without waiting again.
        return first + [n.channel for n in self._conn.notifies(timeout=0)]

    def close(self) -> None:
        """Close the connection instead of returning a listening one to the pool."""
        self._raw.invalidate()


class PostgresqlEnqueue(EnqueueStatements):
    """The enqueue ``INSERT`` with NOTIFY folded in, and ``enqueue_many`` as one statement."""

    #: The bulk enqueue statement, built on first use (see many_calls).
    _bulk: sa.Insert | None = None
    _bulk_partitioned = True

    def json_bind(self, name: str) -> sa.ColumnElement[Any]:
        """``CAST(:name AS JSONB)`` of the JSON text: psycopg would serialise the object again."""
        return sa.cast(sa.bindparam(name, type_=sa.UnicodeText()), postgresql.JSONB())

    def many_calls(
        self, events: Sequence[NewEvent], *, notify: bool, driver: sa.Dialect
    ) -> Iterator[tuple[sa.Executable, Any]]:
        """One ``INSERT ... SELECT ... FROM unnest(arrays) WITH ORDINALITY ORDER BY ordinality``.

        Seven array parameters whatever the number of events: one statement
        text (prepared once by psycopg), one round trip, rows (and so ids)
        in the order given. A multi-row ``VALUES`` would be a new statement
        text per batch size, which psycopg parses anew.
        """
        wake_up = self.notify_statement()
        if notify and wake_up is not None:
            yield wake_up, {}
        if self._bulk is None or self._bulk_partitioned != self.with_partition:
            self._bulk = self._bulk_insert()
            self._bulk_partitioned = self.with_partition
        params = {
            "b_event_id": [e.event_id for e in events],
            "b_topic": [e.topic for e in events],
            "b_key": [e.key for e in events],
            "b_key_partition": [partition_of(e.key, e.event_id) for e in events],
            "b_payload": [e.payload_json for e in events],
            "b_headers": [e.headers_json for e in events],
            "b_delay": [float(e.delay_seconds) for e in events],
        }
        yield self._bulk, params

    def _bulk_insert(self) -> sa.Insert:
        t = self.table

        def array(name: str, item: sa.types.TypeEngine[Any]) -> sa.BindParameter[Any]:
            return sa.bindparam(f"b_{name}", type_=postgresql.ARRAY(item))

        text = sa.Text()
        rows = (
            sa.func.unnest(
                *(array(n, text) for n in ("event_id", "topic", "key", "payload", "headers")),
                array("delay", sa.Float()),
                array("key_partition", sa.SmallInteger()),
            )
            .table_valued(
                "event_id",
                "topic",
                "key",
                "payload",
                "headers",
                "delay",
                "key_partition",
                with_ordinality="n",
            )
            .render_derived()
        )
        now = self.sql.now()
        delay = sa.func.make_interval(0, 0, 0, 0, 0, 0, rows.c.delay)
        partition = [rows.c.key_partition] if self.with_partition else []
        picked = sa.select(
            sa.cast(rows.c.event_id, t.c.event_id.type),
            rows.c.topic,
            rows.c.key,
            *partition,
            sa.cast(rows.c.payload, postgresql.JSONB()),
            sa.cast(rows.c.headers, postgresql.JSONB()),
            sa.literal(int(State.PENDING), sa.SmallInteger()),
            sa.literal(0, sa.Integer()),
            now + delay,
            now,
        ).order_by(rows.c.n)
        columns = ["event_id", "topic", "key", *(c.name for c in partition)]
        columns += ["payload", "headers", "state", "attempts"]
        return sa.insert(t).from_select([*columns, "available_at", "created_at"], picked)

    def notify_statement(self) -> sa.Executable | None:
        """``SELECT pg_notify(channel, '')``: delivered only if the transaction commits.

        Repeated notifications of one transaction are folded into one.
        """
        return sa.select(sa.func.pg_notify(self.notify_channel(), ""))

    def with_wake_up(self, insert: sa.Insert, *, notify: bool) -> sa.Executable:
        """One round trip: ``WITH i AS (INSERT ... RETURNING id) SELECT pg_notify(...) FROM i``."""
        if not notify:
            return insert
        inserted = insert.returning(self.table.c.id).cte("i")
        return sa.select(sa.func.pg_notify(self.notify_channel(), "")).select_from(inserted)

    def listener(self, engine: Engine, channels: Sequence[str] = ()) -> Listener | None:
        """``LISTEN`` on a connection of its own (autocommit, outside the pool)."""
        return PgListener(engine, list(channels) or [self.notify_channel()])
