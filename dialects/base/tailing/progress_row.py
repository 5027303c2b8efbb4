"""``<table>_wal``: one row per source (slot), what its reading relay last reported.

The relay reports as it confirms and at least once a second, so that
``outbox status``, run elsewhere, can tell how old the oldest unpublished
event is, and so that the next reader of the source starts where it was: the
row is crash-safe, while a slot's confirmed position survives a crash only as
of the server's last save of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import Dialect
from outbox_core.dialects.base.tailing.writes import TableWrites
from outbox_core.dialects.base.values import aware


def progress_table(outbox: sa.Table) -> sa.Table:
    """``<table>_wal``: one row per slot, what its reading relay last reported.

    ``confirmed_lsn`` is the position past which every transaction's events
    are published, dead or handed to the table (a reader may start there);
    ``oldest_held_at`` is the ``created_at`` of the oldest event the relay
    has read and not yet published (NULL: it holds none); ``read_lsn`` how far
    it has read the log; ``published_last_minute`` the events it published
    in the last minute; ``reported_at`` is on the database's clock.
    """
    return sa.Table(
        f"{outbox.name}_wal",
        sa.MetaData(),
        sa.Column("slot", sa.String(63), primary_key=True),
        sa.Column("relay", sa.String(64), nullable=False),
        # NULL until the relay's stream confirmed something.
        sa.Column("confirmed_lsn", sa.BigInteger()),
        sa.Column("held", sa.Integer(), nullable=False),
        sa.Column("oldest_held_at", sa.DateTime(timezone=True)),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
        *added_columns(),
        schema=outbox.schema,
    )


def added_columns() -> list[sa.Column[Any]]:
    """Columns of ``<table>_wal`` that ``install --source wal`` adds to an older one."""
    return [
        sa.Column("read_lsn", sa.BigInteger()),
        sa.Column("published_last_minute", sa.Integer()),
    ]


#: The names of :func:`added_columns`: a relay writes them only where they exist.
ADDED = frozenset(c.name for c in added_columns())


@dataclass(frozen=True)
class Progress:
    """A slot's relay as it last reported, and the database's time of reading it."""

    relay: str
    confirmed_lsn: int | None
    held: int
    oldest_held_at: datetime | None
    reported_at: datetime
    now: datetime
    read_lsn: int | None = None
    published_last_minute: int | None = None

    @property
    def age(self) -> float:
        """Seconds since the report."""
        return max(0.0, (self.now - self.reported_at).total_seconds())


class ProgressRows:
    """The statements of ``<table>_wal``."""

    def __init__(self, dialect: Dialect, writes: TableWrites) -> None:
        self.dialect = dialect
        self.writes = writes
        self.table = progress_table(dialect.table)
        self._columns: frozenset[str] | None = None

    def exists(self, conn: Connection) -> bool:
        """Whether ``<table>_wal`` exists."""
        p = self.table
        return sa.inspect(conn).has_table(p.name, schema=p.schema)

    def present(self, conn: Connection) -> frozenset[str]:
        """The columns ``<table>_wal`` has (read once; empty when it does not exist)."""
        if self._columns is None:
            p = self.table
            if not self.exists(conn):
                return frozenset()
            found = sa.inspect(conn).get_columns(p.name, schema=p.schema)
            self._columns = frozenset(str(c["name"]) for c in found)
        return self._columns

    def absent(self, conn: Connection) -> list[sa.Column[Any]]:
        """The :func:`added_columns` an older ``<table>_wal`` lacks (read afresh)."""
        p = self.table
        found = {str(c["name"]) for c in sa.inspect(conn).get_columns(p.name, schema=p.schema)}
        return [p.c[name] for name in sorted(ADDED) if name not in found]

    def reread(self) -> None:
        """Read the columns again when next needed (``install`` added some)."""
        self._columns = None

    def report(
        self,
        conn: Connection,
        *,
        slot: str,
        relay: str,
        confirmed_lsn: int,
        held: int,
        oldest_held_at: datetime | None,
        read_lsn: int | None = None,
        published_last_minute: int | None = None,
        durable: bool = False,
    ) -> None:
        """Upsert the slot's row: the relay's confirmed position and oldest held event.

        Committed without waiting for the disk unless ``durable``: a report
        lost in a crash costs the events since the one before it sent again,
        never a stall of the relay on each write.
        """
        values: dict[str, Any] = {
            "relay": relay[:64],
            "confirmed_lsn": confirmed_lsn or None,
            "held": held,
            "oldest_held_at": oldest_held_at,
            "reported_at": sa.func.now(),
        }
        present = self.present(conn)
        added = {"read_lsn": read_lsn or None, "published_last_minute": published_last_minute}
        values.update({name: value for name, value in added.items() if name in present})
        stmt = self.writes.upsert(self.table, "slot", {"slot": slot, **values})
        with self.dialect.transaction(conn):
            if not durable:
                self.writes.commit_lazily(conn)
            conn.execute(stmt)

    def last(self, conn: Connection, slot: str) -> Progress | None:
        """The slot's last report (None: no relay ever reported, or no ``<table>_wal``)."""
        present = self.present(conn)
        if not present:
            return None
        p = self.table
        added = [p.c[name] if name in present else sa.null() for name in sorted(ADDED)]
        row = conn.execute(
            sa.select(
                p.c.relay,
                p.c.confirmed_lsn,
                p.c.held,
                p.c.oldest_held_at,
                p.c.reported_at,
                sa.func.now(),
                *added,
            ).where(p.c.slot == slot)
        ).first()
        if row is None:
            return None
        extra = dict(zip(sorted(ADDED), row[6:], strict=True))
        relay, confirmed, held, oldest, reported, now = row[:6]
        return Progress(
            relay,
            confirmed,
            held,
            None if oldest is None else aware(oldest),
            aware(reported),
            aware(now),
            **extra,
        )

    def settled(self, conn: Connection, slot: str) -> int | None:
        """The slot's last reported confirmed position (None: none, or no ``<table>_wal``):
        every transaction that committed before it is published, dead or handed over."""
        if not self.present(conn):
            return None
        p = self.table
        found = conn.execute(sa.select(p.c.confirmed_lsn).where(p.c.slot == slot)).scalar()
        return None if found is None else int(found)

    def forget(self, conn: Connection, slot: str) -> None:
        """Delete the slot's row (a new slot of that name: the old position means nothing)."""
        if not self.present(conn):
            return
        p = self.table
        with self.dialect.transaction(conn):
            conn.execute(sa.delete(p).where(p.c.slot == slot))
