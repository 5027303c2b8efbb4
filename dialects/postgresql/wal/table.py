"""The outbox table as the log-tailing relay uses it: rows from the log, dead rows, cleanup.

The relay builds events from the log and writes nothing per event; it
touches the table only for what the log cannot do: marking a dead event,
reading rows ``outbox replay`` returned to pending, the keys held by dead
rows, and removing old rows. It reports its progress (a row per slot in
``<table>_wal``, as it confirms and at least once a second) so that
``outbox status``, run elsewhere, can tell how old the oldest unpublished
event is, and so that the next reader of the slot starts where it was: the
row is crash-safe, while the slot's confirmed position survives a crash only
as of the server's last save of it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from outbox_core.dialects.base import MAX_ERROR, Dialect
from outbox_core.dialects.postgresql.wal.pgoutput import load_text
from outbox_core.dialects.postgresql.wal.stream import WalRow, format_lsn, slot_facts
from outbox_core.errors import UnsupportedDatabase
from outbox_core.message import Event, State
from outbox_core.schema import in_state

#: A report older than this, or a slot nobody reads, means no relay is relaying.
REPORT_STALE = 10.0
#: ``lease_owner`` of a row handed back to the table: its event waits there (a long
#: delay or backoff) instead of in the relay's memory, which would hold the slot.
DEFERRED = "wal:deferred"


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
        *_added_columns(),
        schema=outbox.schema,
    )


def _added_columns() -> list[sa.Column[Any]]:
    """Columns of ``<table>_wal`` that ``install --source wal`` adds to an older one."""
    return [
        sa.Column("read_lsn", sa.BigInteger()),
        sa.Column("published_last_minute", sa.Integer()),
    ]


#: The names of :func:`_added_columns`: a relay writes them only where they exist.
ADDED = frozenset(c.name for c in _added_columns())


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


@dataclass(frozen=True)
class SlotStatus:
    """What ``outbox status --source wal`` shows of the slot and its relay.

    ``oldest_unpublished_age`` comes from the reading relay's report while
    it reads (``estimated`` False). When no relay reads, or its report is
    older than :data:`REPORT_STALE`, it is estimated: the oldest event the
    last report held, else the oldest row created since that report.
    """

    slot: str
    exists: bool
    active: bool = False
    reader_pid: int | None = None
    relay: str | None = None
    confirmed_lsn: str | None = None
    lag_bytes: int | None = None
    retained_bytes: int | None = None
    held: int | None = None
    report_age: float | None = None
    oldest_unpublished_age: float | None = None
    estimated: bool = False
    #: Events handed to the table to wait (long delays and backoffs).
    deferred: int = 0
    #: WAL written since the relay's last read position (None: not reported).
    unread_bytes: int | None = None
    #: Events the reading relay published in the last minute (None: no relay reads).
    published_last_minute: int | None = None
    #: Seconds the earliest due deferred event has been due (None: none due).
    deferred_due_age: float | None = None
    #: ``oldest_unpublished_age`` leaving out deferred events (held or unread ones only).
    stream_age: float | None = None

    @property
    def reading(self) -> bool:
        """A relay reads the slot and its report is fresh (the figures are its own)."""
        return self.active and not self.estimated


def _row(
    event: Event,
    state: State,
    attempts: int,
    available_at: datetime,
    error: str | None,
    *,
    owner: str | None = None,
    until: datetime | None = None,
) -> Mapping[str, Any]:
    """A whole row of ``event`` for an upsert by ``event_id`` (cleanup may have removed it)."""
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


def _deferred(t: sa.FromClause) -> sa.ColumnElement[bool]:
    """Pending and handed to the table; the marker inline, as the index's predicate is
    (a bound value would not match it in a generic plan)."""
    marker = sa.literal(DEFERRED, literal_execute=True)
    return sa.and_(in_state(t.c.state, State.PENDING), t.c.lease_owner == marker)


def _deferred_index(outbox: sa.Table) -> sa.Index:
    """``(lease_until) WHERE`` deferred: the few rows waiting in the table, in hand-over order.

    On a copy of the table: it is made by ``install --source wal`` only.
    """
    copy = sa.Table(
        outbox.name,
        sa.MetaData(),
        sa.Column("id", sa.BigInteger()),
        sa.Column("state", sa.SmallInteger()),
        sa.Column("lease_owner", sa.String(64)),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        schema=outbox.schema,
    )
    c = copy.c
    return sa.Index(
        f"ix_{outbox.name}_wal_deferred",
        c.lease_until,
        c.id,
        postgresql_where=sa.and_(in_state(c.state, State.PENDING), c.lease_owner == DEFERRED),
        # Built while producers insert (install on a live table).
        postgresql_concurrently=True,
    )


class WalTable:
    """The outbox table's statements for log tailing (PostgreSQL only)."""

    def __init__(self, dialect: Dialect) -> None:
        from outbox_core.dialects.postgresql import PostgresqlDialect

        if not isinstance(dialect, PostgresqlDialect):
            raise UnsupportedDatabase(
                f"--source wal reads PostgreSQL's logical replication, not {dialect.family}: "
                "use --source table"
            )
        self.dialect = dialect
        self.table = dialect.table
        self.columns = dialect.claim_columns(self.table)
        self.progress_table = progress_table(self.table)
        self._columns: frozenset[str] | None = None
        self._deferred_index = _deferred_index(self.table)
        t = self.table
        self.is_deferred = _deferred(t)
        defer = postgresql.insert(t)
        # By event_id, as for dead rows; only a row not already handed over (a
        # reconnect resends its insert) or sent (by the table path) changes.
        self._defer = defer.on_conflict_do_update(
            index_elements=[t.c.event_id],
            set_={
                "lease_owner": defer.excluded.lease_owner,
                "lease_until": defer.excluded.lease_until,
                "available_at": defer.excluded.available_at,
                "attempts": defer.excluded.attempts,
                "last_error": defer.excluded.last_error,
            },
            where=sa.and_(in_state(t.c.state, State.PENDING), t.c.lease_owner.is_(None)),
        )
        stmt = postgresql.insert(self.table)
        # By event_id: the row may have been removed by cleanup already (then it is
        # inserted again, dead; that insert is in the log with state DEAD, skipped).
        self._dead = stmt.on_conflict_do_update(
            index_elements=[self.table.c.event_id],
            set_={
                "state": stmt.excluded.state,
                "attempts": stmt.excluded.attempts,
                "last_error": stmt.excluded.last_error,
                "lease_owner": None,
                "lease_until": None,
            },
            # A row dead already keeps its first cause: after a reconnect the
            # relay reads it again and holds it behind its own key.
            where=self.table.c.state != int(State.DEAD),
        )

    def event(self, row: WalRow, token: str) -> tuple[Event, datetime]:
        """An inserted row as :meth:`Dialect.to_event` builds it from a claim, and its
        ``available_at``.

        Columns the dialect reads as text (``event_id``, ``payload``,
        ``headers``) keep the log's text; the others are loaded by type oid.
        """
        values, oids = row.values, row.type_oids
        claimed = [
            values[c.name]
            if isinstance(c.type, sa.Text)
            else load_text(values[c.name], oids[c.name])
            for c in self.columns
        ]
        # attempts_offset 1: the event carries its attempt number, as a claim's does.
        event = self.dialect.to_event(claimed, token, attempts_offset=1)
        return event, load_text(values["available_at"], oids["available_at"])

    @staticmethod
    def is_pending(row: WalRow) -> bool:
        """The row's (new) state is pending: an enqueued row, or a replayed one."""
        return row.values.get("state") == str(int(State.PENDING))

    def replayed(
        self, conn: Connection, ids: Sequence[int], token: str
    ) -> list[tuple[Event, datetime]]:
        """Rows among ``ids`` still pending, in id order (an update's TOAST is not in the log)."""
        t = self.table
        query = (
            sa.select(*self.columns, t.c.available_at)
            .where(self.dialect.id_in(ids), in_state(t.c.state, State.PENDING))
            .order_by(t.c.id)
        )
        rows = conn.execute(query).all()
        return [(self.dialect.to_event(r[:-1], token, attempts_offset=1), r[-1]) for r in rows]

    def mark_dead(self, conn: Connection, dead: Sequence[tuple[Event, int, str]]) -> None:
        """``(event, attempts, error)``: each row dead, in one transaction."""
        now = datetime.now(UTC)
        rows = [_row(event, State.DEAD, attempts, now, error) for event, attempts, error in dead]
        with self.dialect.transaction(conn):
            conn.execute(self._dead, rows)

    def dead_keys(self, conn: Connection) -> set[str]:
        """Keys with a dead row (they hold their later events, ``block_on_dead``)."""
        t = self.table
        query = sa.select(t.c.key).where(in_state(t.c.state, State.DEAD), t.c.key.is_not(None))
        return {str(k) for k in conn.execute(query.distinct()).scalars()}

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

    # -- progress -------------------------------------------------------------------------

    def install(self, conn: Connection) -> None:
        """Create ``<table>_wal`` and the deferred rows' index where missing
        (``outbox install --source wal``)."""
        with self.dialect.transaction(conn):
            self.progress_table.create(conn, checkfirst=True)
            p = self.progress_table
            name = conn.dialect.identifier_preparer.format_table(p)
            for column in self._absent_columns(conn):
                kind = column.type.compile(dialect=conn.dialect)
                conn.execute(
                    sa.text(f"ALTER TABLE {name} ADD COLUMN IF NOT EXISTS {column.name} {kind}")
                )
        self._columns = None
        # CREATE INDEX CONCURRENTLY runs outside a transaction.
        with conn.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as auto:
            self._deferred_index.create(auto, checkfirst=True)

    def missing(self, conn: Connection) -> list[str]:
        """What ``install --source wal`` makes and the table lacks (a table installed
        before them): the relay runs without, slower or unseen by status."""
        found = {
            ix["name"] for ix in sa.inspect(conn).get_indexes(self.table.name, self.table.schema)
        }
        gone = [] if self.has_progress(conn) else [self.progress_table.name]
        absent = self._absent_columns(conn) if not gone else []
        if absent:
            named = ", ".join(c.name for c in absent)
            gone.append(f"{self.progress_table.name}'s column(s) {named}")
        if self._deferred_index.name not in found:
            gone.append(str(self._deferred_index.name))
        return gone

    def uninstall(self, conn: Connection) -> None:
        """Drop ``<table>_wal`` and the index if they exist (``outbox uninstall --source wal``)."""
        with self.dialect.transaction(conn):
            self.progress_table.drop(conn, checkfirst=True)
        with conn.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as auto:
            self._deferred_index.drop(auto, checkfirst=True)

    def has_progress(self, conn: Connection) -> bool:
        """Whether ``<table>_wal`` exists."""
        p = self.progress_table
        return sa.inspect(conn).has_table(p.name, schema=p.schema)

    def _present(self, conn: Connection) -> frozenset[str]:
        """The columns ``<table>_wal`` has (read once; empty when it does not exist)."""
        if self._columns is None:
            p = self.progress_table
            if not self.has_progress(conn):
                return frozenset()
            found = sa.inspect(conn).get_columns(p.name, schema=p.schema)
            self._columns = frozenset(str(c["name"]) for c in found)
        return self._columns

    def _absent_columns(self, conn: Connection) -> list[sa.Column[Any]]:
        p = self.progress_table
        found = {str(c["name"]) for c in sa.inspect(conn).get_columns(p.name, schema=p.schema)}
        return [p.c[name] for name in sorted(ADDED) if name not in found]

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
        p = self.progress_table
        values: dict[str, Any] = {
            "relay": relay[:64],
            "confirmed_lsn": confirmed_lsn or None,
            "held": held,
            "oldest_held_at": oldest_held_at,
            "reported_at": sa.func.now(),
        }
        present = self._present(conn)
        added = {"read_lsn": read_lsn or None, "published_last_minute": published_last_minute}
        values.update({name: value for name, value in added.items() if name in present})
        stmt = postgresql.insert(p).values(slot=slot, **values)
        with self.dialect.transaction(conn):
            if not durable:
                conn.execute(sa.text("SET LOCAL synchronous_commit = off"))
            conn.execute(stmt.on_conflict_do_update(index_elements=[p.c.slot], set_=values))

    def progress(self, conn: Connection, slot: str) -> Progress | None:
        """The slot's last report (None: no relay ever reported, or no ``<table>_wal``)."""
        present = self._present(conn)
        if not present:
            return None
        p = self.progress_table
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
        return Progress(*row[:6], **extra)

    def settled_lsn(self, conn: Connection, slot: str) -> int | None:
        """The slot's last reported confirmed position (None: none, or no ``<table>_wal``):
        every transaction that committed before it is published, dead or handed over."""
        if not self._present(conn):
            return None
        p = self.progress_table
        found = conn.execute(sa.select(p.c.confirmed_lsn).where(p.c.slot == slot)).scalar()
        return None if found is None else int(found)

    def forget_progress(self, conn: Connection, slot: str) -> None:
        """Delete the slot's row (a new slot of that name: the old position means nothing)."""
        if not self._present(conn):
            return
        p = self.progress_table
        with self.dialect.transaction(conn):
            conn.execute(sa.delete(p).where(p.c.slot == slot))

    def oldest_created_since(self, conn: Connection, since: datetime) -> datetime | None:
        """``created_at`` of the oldest pending row created after ``since`` (a lower bound
        of what no relay has read when none reports)."""
        t = self.table
        query = sa.select(sa.func.min(t.c.created_at)).where(
            in_state(t.c.state, State.PENDING), t.c.created_at > since
        )
        return conn.execute(query).scalar()

    def slot_status(self, conn: Connection, slot: str) -> SlotStatus:
        """The slot, its relay's last report and the oldest unpublished event's age."""
        facts = slot_facts(conn, slot)
        if facts is None:
            return SlotStatus(slot, exists=False)
        progress = self.progress(conn, slot)
        reading = facts.active and progress is not None and progress.age <= REPORT_STALE
        age: float | None = None
        deferred, oldest_deferred = self.oldest_deferred(conn)
        due_age = self.deferred_due_age(conn) if deferred else None
        unread = None
        if progress is not None and progress.read_lsn is not None and facts.lag_bytes is not None:
            # The server's WAL end, as slot_facts measured it, less the relay's read position.
            end = (facts.confirmed_flush_lsn or 0) + facts.lag_bytes
            unread = max(0, end - progress.read_lsn)
        stream_age: float | None = None
        if progress is not None:
            oldest = progress.oldest_held_at
            if not reading and oldest is None:
                oldest = self.oldest_created_since(conn, progress.reported_at)
            if oldest is not None:
                stream_age = max(0.0, (progress.now - oldest).total_seconds())
            elif reading:
                stream_age = 0.0
            if oldest_deferred is not None and (oldest is None or oldest_deferred < oldest):
                oldest = oldest_deferred
            if oldest is not None:
                age = max(0.0, (progress.now - oldest).total_seconds())
            elif reading:
                age = 0.0
        return SlotStatus(
            slot,
            exists=True,
            active=facts.active,
            reader_pid=facts.active_pid,
            relay=None if progress is None else progress.relay,
            confirmed_lsn=None
            if facts.confirmed_flush_lsn is None
            else format_lsn(facts.confirmed_flush_lsn),
            lag_bytes=facts.lag_bytes,
            retained_bytes=facts.retained_bytes,
            held=None if progress is None else progress.held,
            report_age=None if progress is None else progress.age,
            oldest_unpublished_age=age,
            estimated=not reading,
            deferred=deferred,
            unread_bytes=unread,
            published_last_minute=progress.published_last_minute
            if reading and progress is not None
            else None,
            deferred_due_age=due_age,
            stream_age=stream_age,
        )

    # -- deferred rows ----------------------------------------------------------------------

    @staticmethod
    def is_ours(row: WalRow) -> bool:
        """The row was handed to the table by a relay (its insert or update is in the log)."""
        return row.values.get("lease_owner") == DEFERRED

    def defer(
        self, conn: Connection, rows: Sequence[tuple[Event, int, datetime, datetime, str | None]]
    ) -> None:
        """``(event, attempts, due, order, error)``: hand each event to the table, one transaction.

        ``order`` (in ``lease_until``) keeps the hand-over order, which is the
        log's commit order: ids need not be.
        """
        values = [
            _row(event, State.PENDING, attempts, due, error, owner=DEFERRED, until=order)
            for event, attempts, due, order, error in rows
        ]
        with self.dialect.transaction(conn):
            conn.execute(self._defer, values)

    def deferred_keys(self, conn: Connection, among: Collection[str] | None = None) -> set[str]:
        """Keys (of ``among``, or all) with events waiting in the table: the key's later
        events wait there too."""
        t = self.table
        query = sa.select(t.c.key).where(self.is_deferred, t.c.key.is_not(None)).distinct()
        if among is not None:
            query = query.where(t.c.key.in_(sorted(among)))
        return {str(k) for k in conn.execute(query).scalars()}

    def last_handed(self, conn: Connection) -> datetime | None:
        """The hand-over order (``lease_until``) of the last row handed over."""
        t = self.table
        return conn.execute(
            sa.select(sa.func.max(t.c.lease_until)).where(self.is_deferred)
        ).scalar()

    def _heads(self, t: sa.FromClause, *, due: bool) -> sa.ColumnElement[bool]:
        """No earlier deferred row of the key (``due``: none not due yet)."""
        earlier = self.table.alias("earlier")
        before = sa.tuple_(earlier.c.lease_until, earlier.c.id) < sa.tuple_(t.c.lease_until, t.c.id)
        conditions = [_deferred(earlier), earlier.c.key == t.c.key, before]
        if due:
            conditions.append(earlier.c.available_at > sa.func.now())
        return ~sa.select(earlier.c.id).where(*conditions).exists()

    def next_deferred_due(self, conn: Connection) -> datetime | None:
        """When the earliest key's first deferred row is due (None: no deferred row)."""
        t = self.table
        query = sa.select(sa.func.min(t.c.available_at)).where(
            self.is_deferred, self._heads(t, due=False)
        )
        return conn.execute(query).scalar()

    def deferred_runs(
        self, conn: Connection, limit: int, token: str, *, block_on_dead: bool = True
    ) -> list[tuple[Event, int]]:
        """Deferred events now due, each key's from its first in hand-over order, and the
        attempts each has spent.

        A key whose first deferred event is not due yet gives none (its later
        ones wait behind it); with ``block_on_dead`` neither does a key with a
        dead row.
        """
        t = self.table
        where = [self.is_deferred, t.c.available_at <= sa.func.now(), self._heads(t, due=True)]
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

    def settle_deferred(
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
                mine = sa.and_(self.dialect.id_in(sent), self.is_deferred)
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
                    .where(t.c.id == row_id, self.is_deferred)
                    .values(
                        attempts=attempts,
                        available_at=self.dialect.after(delay),
                        last_error=error[:MAX_ERROR],
                    )
                )

    def kill_deferred(self, conn: Connection, keys: set[str]) -> None:
        """The deferred rows of ``keys`` dead, held behind a dead event of their key."""
        t = self.table
        with self.dialect.transaction(conn):
            conn.execute(
                sa.update(t)
                .where(self.is_deferred, t.c.key.in_(sorted(keys)))
                .values(
                    state=int(State.DEAD),
                    lease_owner=None,
                    lease_until=None,
                    last_error=sa.func.concat(
                        "held: an earlier event of key ", t.c.key, " is dead"
                    ),
                )
            )

    def dead_count(self, conn: Connection) -> int:
        """Dead rows (the partial index of dead rows: cheap on a table of pending rows)."""
        t = self.table
        query = sa.select(sa.func.count()).where(in_state(t.c.state, State.DEAD))
        return int(conn.execute(query).scalar_one())

    def deferred_due_age(self, conn: Connection) -> float | None:
        """Seconds the earliest due deferred event has been due (None: none is due)."""
        t = self.table
        waited = sa.extract("epoch", sa.func.now() - sa.func.min(t.c.available_at))
        found = conn.execute(
            sa.select(waited).where(self.is_deferred, t.c.available_at <= sa.func.now())
        ).scalar()
        return None if found is None else max(0.0, float(found))

    def oldest_deferred(self, conn: Connection) -> tuple[int, datetime | None]:
        """How many events wait in the table, and the oldest one's ``created_at``."""
        t = self.table
        row = conn.execute(
            sa.select(sa.func.count(), sa.func.min(t.c.created_at)).where(self.is_deferred)
        ).one()
        return int(row[0]), row[1]
