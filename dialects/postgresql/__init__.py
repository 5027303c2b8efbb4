"""PostgreSQL (12 and newer, psycopg 3).

Claim: a ``MATERIALIZED`` CTE picks the ids with ``FOR UPDATE SKIP LOCKED``,
then ``UPDATE ... FROM c ... RETURNING`` leases exactly those rows. Never
``UPDATE ... WHERE id IN (SELECT ... LIMIT ... SKIP LOCKED)``: the planner
may run that subquery more than once and lease more than ``limit`` rows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import (
    KeyWalk,
    Parts,
    ReturningDialect,
    ServerInfo,
    version_prefix,
)
from outbox_core.dialects.base.budget import SIZE, budget_param, within_budget
from outbox_core.dialects.postgresql.adoption import PostgresqlAdoption
from outbox_core.dialects.postgresql.console import PostgresqlConsole
from outbox_core.dialects.postgresql.enqueue import PostgresqlEnqueue
from outbox_core.dialects.postgresql.inbox import PostgresqlInbox
from outbox_core.dialects.postgresql.partitioned import PostgresqlPartitions
from outbox_core.dialects.postgresql.session import PostgresqlSession
from outbox_core.dialects.postgresql.storage import PostgresqlStorage
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import Event, State, StoredEvent
from outbox_core.schema import in_state

MIN_VERSION = (12,)
_loads = json.loads
_UNPARSED = StoredEvent.UNPARSED


class IdArray(sa.TypeDecorator[Sequence[int]]):
    """Row ids bound as one ``'{1,2,3}'`` text, cast to ``BIGINT[]`` on the server.

    psycopg dumps a Python list element by element (quoting each); joining
    the ids into PostgreSQL's array literal costs a fraction of that, and a
    settle binds a whole batch of ids.
    """

    impl = sa.Text
    cache_ok = True

    def process_bind_param(self, value: Sequence[int] | None, dialect: Any) -> str | None:
        """``{1,2,3}``: PostgreSQL's array literal."""
        return None if value is None else "{" + ",".join(map(str, value)) + "}"

    def bind_expression(self, bindvalue: Any) -> Any:
        """``CAST(:ids AS BIGINT[])``."""
        return sa.cast(bindvalue, postgresql.ARRAY(sa.BigInteger()))


class PostgresqlKeyWalk(KeyWalk):
    """Runs of a key read with ``LATERAL ... LIMIT``."""

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


class PostgresqlDialect(ReturningDialect):
    """PostgreSQL strategy: ``FOR UPDATE SKIP LOCKED`` in a materialized CTE."""

    name: ClassVar[str] = "postgresql"
    family: ClassVar[str] = "PostgreSQL"
    parts: ClassVar[Parts] = Parts(
        session=PostgresqlSession,
        storage=PostgresqlStorage,
        enqueue=PostgresqlEnqueue,
        inbox=PostgresqlInbox,
        keys=PostgresqlKeyWalk,
        partitions=PostgresqlPartitions,
        console=PostgresqlConsole,
        adoption=PostgresqlAdoption,
    )

    def now(self) -> sa.ColumnElement[datetime]:
        """``statement_timestamp()``: unlike ``now()`` it moves within a long transaction."""
        return sa.func.statement_timestamp(type_=sa.DateTime(timezone=True))

    def after(self, seconds: float) -> sa.ColumnElement[datetime]:
        """``statement_timestamp() + interval``."""
        return self.now() + sa.literal(timedelta(seconds=seconds), sa.Interval())

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

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``FOR UPDATE SKIP LOCKED``: lock the picked rows, skip rows other claims hold."""
        return select.with_for_update(skip_locked=True)

    def id_in(self, ids: Sequence[int]) -> sa.ColumnElement[bool]:
        """``id = ANY(%(ids)s::BIGINT[])``: one parameter however many ids.

        With ``IN (...)`` every batch size is a different statement text, which
        the driver parses anew on the relay's threads.
        """
        ids_param = sa.bindparam(
            "ids", list(ids), type_=postgresql.ARRAY(sa.BigInteger()), unique=True
        )
        return self.table.c.id == sa.any_(ids_param)

    def claim_columns(self, o: sa.FromClause) -> list[sa.ColumnElement[Any]]:
        """The base columns with ``event_id``, ``payload`` and ``headers`` read as text.

        psycopg would build a ``uuid.UUID`` per row (which SQLAlchemy then
        turns back into a string) and hand jsonb bytes to ``json.loads``, which
        sniffs their encoding first: much of the claim thread's Python time
        (see ``bench/drain.py``).
        :meth:`to_event` keeps the payload's text, parsed only when read.
        """
        columns = super().claim_columns(o)
        for i in (1, 4, 5):
            columns[i] = sa.cast(columns[i], sa.Text).label(columns[i].key)
        return columns

    def to_event(self, row: Sequence[Any], token: str, attempts_offset: int = 0) -> Event:
        """A :class:`StoredEvent`: its payload is parsed from the JSON text on first use.

        ``created_at`` comes back aware (TIMESTAMPTZ), the headers (small,
        often absent) are parsed here.
        """
        # Positional, in the fields' order: a claim builds one per row, and
        # keywords cost a third more.
        return StoredEvent(
            row[0],  # id
            row[1],  # event_id
            row[2],  # topic
            row[3],  # key
            _UNPARSED,  # payload
            {} if row[5] is None else _loads(row[5]),  # headers
            row[6] + attempts_offset,  # attempts
            row[7],  # created_at
            token,
            # SQL NULL (an adopted table's payload may allow it) reads as JSON null.
            "null" if row[4] is None else row[4],  # payload_json
        )

    def id_in_bound(self) -> sa.ColumnElement[bool]:
        """``id = ANY(:o_ids)``: one array parameter, bound at execution."""
        ids_param = sa.bindparam("o_ids", type_=IdArray())
        return self.table.c.id == sa.any_(ids_param)

    def claim_statement(
        self,
        *,
        limit: int,
        lease: float,
        token: str | sa.BindParameter[str],
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
        block_on_dead: bool = True,
        max_bytes: int | sa.BindParameter[int] | None = None,
    ) -> sa.Update:
        """``WITH c AS MATERIALIZED (SELECT ... SKIP LOCKED) UPDATE ... FROM c RETURNING``.

        With a byte budget, ``c`` also reads each row's stored size and the
        update takes the rows of ``c`` the budget keeps (a running sum over
        ``c``: window functions cannot share a query with ``FOR UPDATE``),
        returning their sizes last. The rows left out stay locked until the
        claim commits, moments later.
        """
        t = self.table
        columns: list[sa.ColumnElement[Any]] = [t.c.id]
        if max_bytes is not None:
            columns.append(self.stored_size(t).label(SIZE))
        pick = (
            sa.select(*columns)
            .where(*self.keys.claim_filter(t, ordered, window, block_on_dead=block_on_dead))
            .order_by(t.c.id)
        )
        picked: sa.FromClause = (
            self.lock_rows(pick.limit(limit)).cte("c").prefix_with("MATERIALIZED")
        )
        returned = self.claim_columns(t)
        if max_bytes is not None:
            picked = within_budget(picked, budget_param(max_bytes), SIZE).subquery("b")
            returned.append(picked.c[SIZE])
        return (
            sa.update(t)
            .where(t.c.id == picked.c.id)
            .values(self.lease_values(lease=lease, token=token))
            .returning(*returned)
        )

    def stored_size(self, o: sa.FromClause) -> sa.ColumnElement[int]:
        """``pg_column_size(payload) + coalesce(pg_column_size(headers), 0)``.

        The stored size: compressed where PostgreSQL compressed the value,
        and read from the TOAST pointer of a large one without fetching it.
        """
        c = o.c
        return sa.func.pg_column_size(c.payload, type_=sa.Integer()) + sa.func.coalesce(
            sa.func.pg_column_size(c.headers, type_=sa.Integer()), 0
        )
