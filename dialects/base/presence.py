"""The presence table: a row per running relay, whatever its mode (a part of Dialect).

The statements only; when a relay writes its row is
:mod:`outbox_core.relay.presence`'s. Each relay writes its own row and no
other (one writer per row): an UPDATE, and an INSERT when it changed nothing,
needs no upsert syntax. Ages are read on the database's clock, as the
membership table's are, so relays on hosts whose clocks disagree compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.primitives import SqlPrimitives, plain_read


@dataclass(frozen=True)
class Beat:
    """What a relay writes in its row at each heartbeat."""

    relay_id: str
    host: str
    pid: int
    #: ``none``, ``partitions``, ``heads`` (the polling relay's ordering) or ``wal``.
    mode: str
    #: Since the relay started: events the broker accepted, events made dead.
    published: int
    dead: int
    #: Events the broker accepted in about the last minute.
    published_last_minute: int


@dataclass(frozen=True)
class PresenceRow:
    """A relay as the presence table shows it (``Outbox.fleet()``, ``outbox status``).

    Ages in seconds on the database's clock; counts as of the relay's last
    heartbeat.
    """

    relay_id: str
    host: str
    pid: int
    mode: str
    #: Seconds since the relay's row was first written (its start).
    uptime: float
    #: Seconds since its last heartbeat: a few for a live relay, growing for a dead one.
    heartbeat_age: float
    published: int
    dead: int
    published_last_minute: int


def seconds_between(since: datetime, now: datetime) -> float:
    """``now - since`` in seconds, never negative; both UTC, aware or naive as returned."""
    if since.tzinfo is not None:
        since = since.astimezone(UTC).replace(tzinfo=None)
    if now.tzinfo is not None:
        now = now.astimezone(UTC).replace(tzinfo=None)
    return max(0.0, (now - since).total_seconds())


class PresenceStatements:
    """The presence table's statements on one database family: plain Core, short transactions."""

    def __init__(self, sql: SqlPrimitives) -> None:
        self.sql = sql
        self.presence = sql.tables.presence

    def installed(self, conn: Connection) -> bool:
        """The presence table exists (a table created by an earlier version has none)."""
        p = self.presence
        # In a transaction of its own: a relay's connection must not stay in
        # the one the inspector's query would begin.
        with plain_read(conn):
            return bool(sa.inspect(conn).has_table(p.name, schema=p.schema))

    def beat(self, conn: Connection, beat: Beat) -> bool:
        """Write ``beat`` in its relay's row, heartbeat now; True when the row was new.

        A relay removed as stale (frozen longer than the age limit) is
        inserted again, its start then.
        """
        p = self.presence
        counts = {
            "published": beat.published,
            "dead": beat.dead,
            "published_last_minute": beat.published_last_minute,
        }
        with self.sql.transaction(conn):
            now = self.sql.now()
            changed = conn.execute(
                sa.update(p).where(p.c.relay_id == beat.relay_id).values(heartbeat_at=now, **counts)
            ).rowcount
            if changed:
                return False
            conn.execute(
                sa.insert(p).values(
                    relay_id=beat.relay_id,
                    host=beat.host[:255],
                    pid=beat.pid,
                    mode=beat.mode,
                    started_at=now,
                    heartbeat_at=now,
                    **counts,
                )
            )
            return True

    def leave(self, conn: Connection, relay_id: str) -> None:
        """Delete ``relay_id``'s row (the relay stops cleanly)."""
        p = self.presence
        with self.sql.transaction(conn):
            conn.execute(sa.delete(p).where(p.c.relay_id == relay_id))

    def forget_stale(self, conn: Connection, older_than: float) -> int:
        """Delete the rows whose heartbeat is older than ``older_than`` seconds; how many."""
        p = self.presence
        with self.sql.transaction(conn):
            return int(
                conn.execute(
                    sa.delete(p).where(p.c.heartbeat_at < self.sql.after(-older_than))
                ).rowcount
            )

    def fleet(self, conn: Connection) -> list[PresenceRow]:
        """Every row, with its ages on the database's clock: the newest relay first.

        Ordered by start (then id), not by heartbeat, so a listing keeps its
        order from one read to the next.
        """
        p = self.presence
        query = sa.select(
            p.c.relay_id,
            p.c.host,
            p.c.pid,
            p.c.mode,
            p.c.started_at,
            p.c.heartbeat_at,
            self.sql.now(),
            p.c.published,
            p.c.dead,
            p.c.published_last_minute,
        ).order_by(p.c.started_at.desc(), p.c.relay_id)
        with plain_read(conn):
            rows = conn.execute(query).all()
        return [
            PresenceRow(
                relay_id=str(relay_id),
                host=str(host),
                pid=int(pid),
                mode=str(mode),
                uptime=seconds_between(started, now),
                heartbeat_age=seconds_between(beat, now),
                published=int(published),
                dead=int(dead),
                published_last_minute=int(last_minute),
            )
            for relay_id, host, pid, mode, started, beat, now, published, dead, last_minute in rows
        ]
