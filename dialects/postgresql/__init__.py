"""PostgreSQL (12 and newer, psycopg 3).

Claim: a ``MATERIALIZED`` CTE picks the ids with ``FOR UPDATE SKIP LOCKED``,
then ``UPDATE ... FROM c ... RETURNING`` leases exactly those rows. Never
``UPDATE ... WHERE id IN (SELECT ... LIMIT ... SKIP LOCKED)``: the planner
may run that subquery more than once and lease more than ``limit`` rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from outbox_core.dialects.base import (
    Listener,
    ReturningDialect,
    ServerInfo,
    SessionLimits,
    version_prefix,
)
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import Event, NewEvent, State, StoredEvent
from outbox_core.schema import in_state

if TYPE_CHECKING:
    from outbox_core.doctor import Check


MIN_VERSION = (12,)
_loads = json.loads


class PgListener:
    """A psycopg connection that ``LISTEN``s on one channel."""

    def __init__(self, engine: Engine, channel: str) -> None:
        from psycopg import sql

        self._raw = engine.raw_connection()
        conn: Any = self._raw.driver_connection
        if conn is None:
            raise RuntimeError("the pool gave no driver connection")
        conn.autocommit = True
        # LISTEN has no SQLAlchemy construct; the channel is quoted as an identifier.
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        self._conn = conn

    def wait(self, timeout: float) -> bool:
        """True when a notification arrived within ``timeout`` seconds."""
        return any(True for _ in self._conn.notifies(timeout=timeout, stop_after=1))

    def close(self) -> None:
        """Close the connection instead of returning a listening one to the pool."""
        self._raw.invalidate()


class PostgresqlDialect(ReturningDialect):
    """PostgreSQL strategy: ``FOR UPDATE SKIP LOCKED`` in a materialized CTE."""

    name: ClassVar[str] = "postgresql"
    family: ClassVar[str] = "PostgreSQL"
    test_default_url: ClassVar[str | None] = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    test_required_in_ci: ClassVar[bool] = True
    locking: ClassVar[str] = "claims skip each other's rows with FOR UPDATE SKIP LOCKED"
    upgrade_hint: ClassVar[str | None] = "upgrade to PostgreSQL 12 or newer"

    def now(self) -> sa.ColumnElement[datetime]:
        """``statement_timestamp()``: unlike ``now()`` it moves within a long transaction."""
        return sa.func.statement_timestamp(type_=sa.DateTime(timezone=True))

    def after(self, seconds: float) -> sa.ColumnElement[datetime]:
        """``statement_timestamp() + interval``."""
        return self.now() + sa.literal(timedelta(seconds=seconds), sa.Interval())

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        """The driver's connect timeout, in whole seconds."""
        return {"connect_timeout": max(1, int(seconds))}

    def doctor_checks(self) -> list[tuple[str, Check]]:
        """See ``doctor.py`` beside this module."""
        from outbox_core.dialects.postgresql.doctor import CHECKS

        return list(CHECKS)

    def server_info(self, conn: Connection) -> ServerInfo:
        """``version()`` and ``server_version``."""
        full = str(conn.execute(sa.select(sa.func.version())).scalar())
        short = conn.execute(sa.select(sa.func.current_setting("server_version"))).scalar()
        return ServerInfo("PostgreSQL", version_prefix(str(short)), full)

    def check(self, conn: Connection) -> None:
        """Require PostgreSQL 12+ (``MATERIALIZED`` CTEs; SKIP LOCKED came in 9.5)."""
        version = conn.dialect.server_version_info or (0,)
        if tuple(version[:1]) < MIN_VERSION:
            found = ".".join(str(v) for v in version)
            raise UnsupportedDatabase(
                f"PostgreSQL {found} is too old: the outbox needs PostgreSQL 12 or newer "
                "(MATERIALIZED common table expressions with FOR UPDATE SKIP LOCKED)"
            )

    def text_problem(self, name: str, value: str) -> str | None:
        """Also refused: NUL (``\\u0000``), which neither text nor jsonb can hold."""
        if "\x00" in value:
            return f"{name} contains a NUL character (\\u0000), which PostgreSQL cannot store"
        return super().text_problem(name, value)

    parses_json: ClassVar[bool] = True
    json_as_text: ClassVar[bool] = True
    #: The bulk enqueue statement, built on first use (see enqueue_many_calls).
    _bulk: sa.Insert | None = None

    def json_bind(self, name: str) -> sa.ColumnElement[Any]:
        """``CAST(:name AS JSONB)`` of the JSON text: psycopg would serialise the object again."""
        return sa.cast(sa.bindparam(name, type_=sa.UnicodeText()), postgresql.JSONB())

    def bind_time(self, value: datetime | None) -> datetime | None:
        """Aware UTC: a naive value bound to TIMESTAMPTZ is read in the session's time zone."""
        return None if value is None else value.replace(tzinfo=UTC)

    def json_text(self, column: sa.ColumnElement[Any]) -> sa.ColumnElement[str]:
        """``CAST(payload AS TEXT)``: psycopg would decode jsonb itself."""
        return sa.cast(column, sa.Text)

    def json_suspect(self, text: str) -> bool:
        """JSON text writes NUL as ``\\u0000``."""
        return "\\u0000" in text

    def limit_session(self, conn: Connection, limits: SessionLimits) -> None:
        """``idle_in_transaction_session_timeout`` and ``lock_timeout`` on a relay connection.

        The first makes the server end a session left idle inside a
        transaction (a relay frozen mid-claim or mid-settle), rolling it back
        and releasing its row locks; the second bounds any lock wait. Both are
        session settings (``set_config(..., false)``), so they last as long as
        the connection and touch nothing else.
        """
        settings = {
            "idle_in_transaction_session_timeout": limits.idle_in_transaction,
            "lock_timeout": limits.lock_wait,
        }
        with conn.begin():
            for name, seconds in settings.items():
                conn.execute(
                    sa.select(sa.func.set_config(name, f"{round(seconds * 1000)}ms", False))
                )

    def enqueue_many_calls(
        self, events: Sequence[NewEvent], *, notify: bool, driver: sa.Dialect
    ) -> Iterator[tuple[sa.Executable, Any]]:
        """One ``INSERT ... SELECT ... FROM unnest(arrays) WITH ORDINALITY ORDER BY ordinality``.

        Six array parameters whatever the number of events: one statement
        text (prepared once by psycopg), one round trip, rows (and so ids)
        in the order given. A multi-row ``VALUES`` would be a new statement
        text per batch size, which psycopg parses anew (tens of ms per
        thousand rows).
        """
        wake_up = self.notify_statement()
        if notify and wake_up is not None:
            yield wake_up, {}
        if self._bulk is None:
            self._bulk = self._bulk_insert()
        params = {
            "b_event_id": [e.event_id for e in events],
            "b_topic": [e.topic for e in events],
            "b_key": [e.key for e in events],
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
            )
            .table_valued(
                "event_id", "topic", "key", "payload", "headers", "delay", with_ordinality="n"
            )
            .render_derived()
        )
        now = self.now()
        delay = sa.func.make_interval(0, 0, 0, 0, 0, 0, rows.c.delay)
        picked = sa.select(
            sa.cast(rows.c.event_id, t.c.event_id.type),
            rows.c.topic,
            rows.c.key,
            sa.cast(rows.c.payload, postgresql.JSONB()),
            sa.cast(rows.c.headers, postgresql.JSONB()),
            sa.literal(int(State.PENDING), sa.SmallInteger()),
            sa.literal(0, sa.Integer()),
            now + delay,
            now,
        ).order_by(rows.c.n)
        columns = ["event_id", "topic", "key", "payload", "headers", "state", "attempts"]
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

    def listener(self, engine: Engine) -> Listener | None:
        """``LISTEN`` on a connection of its own (autocommit, outside the pool)."""
        return PgListener(engine, self.notify_channel())

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``FOR UPDATE SKIP LOCKED``: lock the picked rows, skip rows other claims hold."""
        return select.with_for_update(skip_locked=True)

    def id_in(self, ids: Sequence[int]) -> sa.ColumnElement[bool]:
        """``id = ANY(%(ids)s::BIGINT[])``: one parameter however many ids.

        With ``IN (...)`` every batch size is a different statement text, which
        the driver parses anew (a few ms for 500 ids) on the relay's threads.
        """
        ids_param = sa.bindparam(
            "ids", list(ids), type_=postgresql.ARRAY(sa.BigInteger()), unique=True
        )
        return self.table.c.id == sa.any_(ids_param)

    def claim_columns(self, o: sa.FromClause) -> list[sa.ColumnElement[Any]]:
        """The base columns with ``event_id``, ``payload`` and ``headers`` read as text.

        psycopg would build a ``uuid.UUID`` per row (which SQLAlchemy then
        turns back into a string) and hand jsonb bytes to ``json.loads``, which
        sniffs their encoding first: together about a quarter of the claim
        thread's Python time at batch 500 (py-spy, ``bench/drain.py``).
        :meth:`to_event` keeps the payload's text, parsed only when read.
        """
        columns = super().claim_columns(o)
        for i in (1, 4, 5):
            columns[i] = sa.cast(columns[i], sa.Text).label(columns[i].name)
        return columns

    def to_event(self, row: Sequence[Any], token: str, attempts_offset: int = 0) -> Event:
        """A :class:`StoredEvent`: its payload is parsed from the JSON text on first use.

        ``created_at`` comes back aware (TIMESTAMPTZ), the headers (small,
        often absent) are parsed here.
        """
        return StoredEvent(
            id=row[0],
            event_id=row[1],
            topic=row[2],
            key=row[3],
            payload=StoredEvent.UNPARSED,
            headers={} if row[5] is None else _loads(row[5]),
            attempts=row[6] + attempts_offset,
            created_at=row[7],
            token=token,
            payload_json=row[4],
        )

    def id_in_bound(self) -> sa.ColumnElement[bool]:
        """``id = ANY(:o_ids)``: one array parameter, bound at execution."""
        ids_param = sa.bindparam("o_ids", type_=postgresql.ARRAY(sa.BigInteger()))
        return self.table.c.id == sa.any_(ids_param)

    def run_rows(
        self, keys: sa.CTE, run_length: int
    ) -> tuple[sa.FromClause, sa.ColumnElement[int]]:
        """``visited CROSS JOIN LATERAL (SELECT id ... ORDER BY id LIMIT run_length)``.

        One index range per key whatever the statistics say (a plain join can
        be planned as a hash join over every pending row of the keys).
        """
        r = self.table.alias("r")
        run = (
            sa.select(r.c.id)
            .where(in_state(r.c.state, State.PENDING), r.c.key == keys.c.key)
            .order_by(r.c.id)
            .limit(run_length)
            .lateral("run")
        )
        return keys.join(run, sa.true()), run.c.id

    def claim_statement(
        self,
        *,
        limit: int,
        lease: float,
        token: str | sa.BindParameter[str],
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
        block_on_dead: bool = True,
    ) -> sa.Update:
        """``WITH c AS MATERIALIZED (SELECT ... SKIP LOCKED) UPDATE ... FROM c RETURNING``."""
        t = self.table
        pick = (
            sa.select(t.c.id)
            .where(*self.claim_filter(t, ordered, window, block_on_dead=block_on_dead))
            .order_by(t.c.id)
        )
        picked = self.lock_rows(pick.limit(limit)).cte("c").prefix_with("MATERIALIZED")
        return (
            sa.update(t)
            .where(t.c.id == picked.c.id)
            .values(self.lease_values(lease=lease, token=token))
            .returning(*self.claim_columns(t))
        )

    def inbox_insert(self, consumer: str, event_id: str) -> sa.Insert:
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
            .values(consumer=consumer, event_id=event_id, processed_at=self.now())
            .on_conflict_do_nothing(index_elements=[t.c.consumer, t.c.event_id])
        )
