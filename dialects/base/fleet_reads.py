"""Many outboxes in one database: each one's backlog, in one statement for all of them.

A relay over many outboxes serves backlog gauges per outbox (``/metrics``).
Reading them outbox by outbox would cost the database a round trip per
outbox per scrape; :func:`backlogs` asks every outbox of a database at once,
a ``UNION ALL`` of one row per outbox, as the probe of which outboxes have
work does (:func:`~outbox_core.dialects.base.discovery.probe`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.console import utc, utc_or_none
from outbox_core.dialects.base.discovery import PROBE_CHUNK
from outbox_core.dialects.base.primitives import plain_read
from outbox_core.message import State
from outbox_core.schema import in_state

if TYPE_CHECKING:
    from outbox_core.dialects.base.dialect import Dialect


@dataclasses.dataclass(frozen=True)
class OutboxBacklog:
    """One outbox's backlog (by its index in the list read)."""

    index: int
    #: Pending events (due or not yet).
    pending: int
    #: Dead events.
    dead: int
    #: Seconds since the oldest pending event was created, by the database's clock;
    #: None when nothing is pending.
    oldest_pending_age: float | None


def _row(dialect: Dialect, index: int) -> sa.Select[Any]:
    """One outbox's row: its index, pending and dead counts, the oldest pending event's
    ``created_at`` and the database's time.

    One aggregate over the rows still pending or dead (the work indexes:
    never the history of sent rows), not a subquery per figure: a database
    plans a statement over hundreds of outboxes several times faster so.
    """
    t = dialect.table
    pending = in_state(t.c.state, State.PENDING)
    columns: list[sa.ColumnElement[Any]] = [
        sa.literal(index, sa.Integer()).label("n"),
        sa.func.sum(sa.case((pending, 1), else_=0)).label("pending"),
        sa.func.sum(sa.case((in_state(t.c.state, State.DEAD), 1), else_=0)).label("dead"),
        sa.func.min(sa.case((pending, t.c.created_at))).label("oldest"),
        dialect.now().label("now"),
    ]
    return sa.select(*columns).select_from(t).where(in_state(t.c.state, State.PENDING, State.DEAD))


class BacklogReader:
    """Reads the backlog of one database's outboxes (:meth:`read`).

    The statements are built once for a set of outboxes and run again while
    it stays the same (SQLAlchemy's cache then skips compiling them too):
    building one over hundreds of outboxes costs more than running it.
    """

    def __init__(self) -> None:
        self._dialects: list[Dialect] = []
        self._statements: list[sa.Executable] = []

    def _built(self, dialects: Sequence[Dialect]) -> list[sa.Executable]:
        if len(dialects) != len(self._dialects) or any(
            a is not b for a, b in zip(dialects, self._dialects, strict=True)
        ):
            statements: list[sa.Executable] = []
            for start in range(0, len(dialects), PROBE_CHUNK):
                chunk = dialects[start : start + PROBE_CHUNK]
                rows = [_row(dialect, start + offset) for offset, dialect in enumerate(chunk)]
                statements.append(rows[0] if len(rows) == 1 else sa.union_all(*rows))
            self._dialects, self._statements = list(dialects), statements
        return self._statements

    def read(self, conn: Connection, dialects: Sequence[Dialect]) -> list[OutboxBacklog]:
        """The backlog of each of ``dialects``' outboxes (all in this database): one
        statement per :data:`~outbox_core.dialects.base.discovery.PROBE_CHUNK` outboxes.

        Read in a plain read transaction (no lock a relay waits on). A missing
        table (a schema dropped since it was found) fails the statement.
        """
        out: list[OutboxBacklog] = []
        for statement in self._built(dialects):
            with plain_read(conn):
                found = conn.execute(statement).all()
            for n, pending, dead, oldest, now in found:
                created = utc_or_none(oldest)
                age = None
                if created is not None:
                    age = max(0.0, (utc(now) - created).total_seconds())
                out.append(OutboxBacklog(int(n), int(pending or 0), int(dead or 0), age))
        return sorted(out, key=lambda b: b.index)


def backlogs(conn: Connection, dialects: Sequence[Dialect]) -> list[OutboxBacklog]:
    """:meth:`BacklogReader.read` once (the statements built for this call)."""
    return BacklogReader().read(conn, dialects)
