"""The Dialect interface every database strategy implements, and the registry.

A dialect owns every statement the outbox runs against one database family.
Each interface method runs in its own short transaction that the dialect
opens and commits; when the caller already has a transaction open on the
connection, the method joins it instead (tests use this to hold a claim's row
locks while another relay claims). Nothing is held open while publishing.

Settling writes (``mark_sent``, ``mark_failed``, ``release``) are fenced by
the claim token: they only touch rows whose ``lease_owner`` is still that
token, so a relay whose lease expired and was re-claimed changes nothing.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, ClassVar, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.dml import Insert

from outbox_core.errors import UnknownDialect
from outbox_core.message import Event, Failure, NewEvent, State
from outbox_core.schema import OutboxTables

#: Longest error text kept in ``last_error``.
MAX_ERROR = 2000

_ACTIVE = (State.PENDING, State.LEASED)


class Listener(Protocol):
    """Waits for wake-ups sent by producers' commits."""

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True when a wake-up arrived."""

    def close(self) -> None:
        """Stop listening and drop the connection."""


class Dialect(ABC):
    """Strategy for claiming, settling and cleaning outbox rows on one database family."""

    #: Registry name: "postgresql", "mysql", "mssql" or "sqlite".
    name: ClassVar[str]
    #: True when concurrent claims skip each other's locked rows instead of
    #: waiting (SKIP LOCKED / READPAST). SQLite serialises writers instead.
    row_locks: ClassVar[bool] = True
    #: Largest claim batch the dialect accepts.
    max_batch: ClassVar[int] = 10_000

    def __init__(self, tables: OutboxTables, *, block_on_dead: bool = True) -> None:
        self.tables = tables
        self.table = tables.outbox
        self.block_on_dead = block_on_dead

    # -- clock ---------------------------------------------------------------

    @abstractmethod
    def now(self) -> sa.ColumnElement[datetime]:
        """The database's current UTC time as a SQL expression."""

    @abstractmethod
    def after(self, seconds: float) -> sa.ColumnElement[datetime]:
        """The database's current UTC time plus ``seconds`` (may be negative)."""

    # -- connections and transactions ---------------------------------------

    def connect(self, engine: Engine) -> Connection:
        """Open a connection configured for this dialect's claims."""
        return engine.connect()

    def prepare(self, conn: Connection) -> None:  # noqa: B027 - optional hook
        """Adjust a connection before a transaction begins (isolation level, ...)."""

    def begin_statement(self, conn: Connection) -> None:  # noqa: B027 - optional hook
        """Run right after ``BEGIN``; SQLite upgrades to an immediate write transaction."""

    @contextmanager
    def transaction(self, conn: Connection) -> Iterator[Connection]:
        """Open and commit a short transaction, or join the caller's open one."""
        if conn.in_transaction():
            yield conn
            return
        self.prepare(conn)
        with conn.begin():
            self.begin_statement(conn)
            yield conn

    # -- capability -----------------------------------------------------------

    @abstractmethod
    def check(self, conn: Connection) -> None:
        """Verify the server's version and capabilities.

        Raises :class:`~outbox_core.errors.UnsupportedDatabase` naming the
        version found and the version needed.
        """

    def install(self, conn: Connection) -> None:
        """Create the tables (idempotent) and apply database settings the outbox needs."""
        with self.transaction(conn):
            self.tables.create_all(conn)

    # -- enqueue --------------------------------------------------------------

    def insert_statement(self, event: NewEvent) -> Insert:
        """The ``INSERT`` that enqueues ``event`` inside the caller's transaction."""
        now = self.now()
        return sa.insert(self.table).values(
            event_id=event.event_id,
            topic=event.topic,
            key=event.key,
            payload=event.payload,
            headers=event.headers,
            state=int(State.PENDING),
            attempts=0,
            available_at=self.after(event.delay_seconds) if event.delay_seconds else now,
            created_at=now,
        )

    def enqueue_statement(self, event: NewEvent, *, notify: bool) -> sa.Executable:
        """The statement ``enqueue`` runs: the insert, plus the wake-up where one exists."""
        return self.insert_statement(event)

    # -- wake-ups -------------------------------------------------------------

    def notify_channel(self) -> str:
        """The channel relays of this table listen on (databases with NOTIFY)."""
        t = self.table
        name = t.name if t.schema is None else f"{t.schema}_{t.name}"
        return f"outbox_{name}"[:63]

    def notify_statement(self) -> sa.Executable | None:
        """A statement, run in the producer's transaction, that wakes relays at commit.

        ``None`` where the database has no such thing: relays poll.
        """
        return None

    def listener(self, engine: Engine) -> Listener | None:
        """A connection that waits for :meth:`notify_statement` wake-ups (None: poll)."""
        return None

    # -- claim ----------------------------------------------------------------

    def claimable(self, o: sa.FromClause) -> list[sa.ColumnElement[bool]]:
        """WHERE terms of a claim: pending and due."""
        return [o.c.state == int(State.PENDING), o.c.available_at <= self.now()]

    def head_of_key(self, o: sa.FromClause) -> sa.ColumnElement[bool]:
        """Ordered mode: the row has no key, or no earlier unsent row of its key.

        A plain read with no lock hint: SKIP LOCKED or READPAST here would skip
        a leased head and let its successor overtake it.
        """
        p = self.table.alias("p")
        blocking = [int(State.PENDING), int(State.LEASED)]
        if self.block_on_dead:
            blocking.append(int(State.DEAD))
        earlier = sa.exists().where(p.c.key == o.c.key, p.c.state.in_(blocking), p.c.id < o.c.id)
        return sa.or_(o.c.key.is_(None), ~earlier)

    def claim_filter(self, o: sa.FromClause, ordered: bool) -> list[sa.ColumnElement[bool]]:
        """All WHERE terms of a claim."""
        terms = self.claimable(o)
        if ordered:
            terms.append(self.head_of_key(o))
        return terms

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """Lock the rows a claim picks, skipping rows other claims hold.

        The default adds nothing: SQLite's ``BEGIN IMMEDIATE`` already makes
        claims take turns. Row-locking databases override it.
        """
        return select

    def claim_runs(
        self, conn: Connection, *, limit: int, lease: float, token: str, run_length: int
    ) -> list[Event]:
        """Ordered mode with runs: per key, up to ``run_length`` consecutive due events.

        Three statements in one transaction:

        1. lock candidates (pending, due, at most ``run_length - 1`` pending
           rows before them in their key, and no earlier leased, dead or
           not-yet-due row of their key), skipping rows other claims hold;
        2. a plain read of the keys' unsent rows: a key's locked rows count
           only as far as they are the key's first unsent rows. A row skipped
           because another claim holds it ends the run there;
        3. lease what remains. The dropped rows' locks go at commit.
        """
        t = self.table
        p = t.alias("p")
        blocked = [int(State.LEASED)] + ([int(State.DEAD)] if self.block_on_dead else [])
        earlier_blocked = sa.exists().where(
            p.c.key == t.c.key,
            p.c.id < t.c.id,
            sa.or_(
                p.c.state.in_(blocked),
                sa.and_(p.c.state == int(State.PENDING), p.c.available_at > self.now()),
            ),
        )
        ahead = (
            sa.select(sa.func.count())
            .where(p.c.key == t.c.key, p.c.state == int(State.PENDING), p.c.id < t.c.id)
            .scalar_subquery()
        )
        candidates = self.lock_rows(
            sa.select(*self.claim_columns(t))
            .where(
                *self.claimable(t),
                sa.or_(t.c.key.is_(None), sa.and_(~earlier_blocked, ahead < run_length)),
            )
            .order_by(t.c.id)
            .limit(limit)
        )
        with self.transaction(conn):
            rows = conn.execute(candidates).all()
            valid = self.run_prefixes(conn, rows)
            if not valid:
                return []
            conn.execute(
                sa.update(t)
                .where(t.c.id.in_(sorted(valid)), t.c.state == int(State.PENDING))
                .values(self.lease_values(lease=lease, token=token))
            )
        # The rows were read before the UPDATE counted this attempt.
        return [self.to_event(r, token, attempts_offset=1) for r in rows if int(r[0]) in valid]

    def run_prefixes(self, conn: Connection, rows: Sequence[Any]) -> set[int]:
        """Ids of the locked ``rows`` that are their key's first unsent rows, in order.

        A plain read (no lock hint): a row another claim holds, skipped by
        SKIP LOCKED / READPAST, ends its key's run there.
        """
        t = self.table
        valid = {int(r[0]) for r in rows if r[3] is None}
        keys = sorted({r[3] for r in rows if r[3] is not None})
        if not keys:
            return valid
        unsent = [int(State.PENDING), int(State.LEASED)]
        if self.block_on_dead:
            unsent.append(int(State.DEAD))
        top = max(int(r[0]) for r in rows)
        order = conn.execute(
            sa.select(t.c.id, t.c.key)
            .where(t.c.key.in_(keys), t.c.state.in_(unsent), t.c.id <= top)
            .order_by(t.c.id)
        ).all()
        ours = {int(r[0]) for r in rows}
        broken: set[str] = set()
        for row_id, key in order:
            if key in broken:
                continue
            if int(row_id) in ours:
                valid.add(int(row_id))
            else:
                broken.add(key)  # an earlier row we do not hold: the run stops here
        return valid

    def claim_columns(self, o: sa.FromClause) -> list[sa.ColumnElement[Any]]:
        """The columns a claim returns, in :meth:`to_event` order."""
        c = o.c
        return [c.id, c.event_id, c.topic, c.key, c.payload, c.headers, c.attempts, c.created_at]

    def lease_values(
        self, *, lease: float, token: str, target: sa.FromClause | None = None
    ) -> dict[str, Any]:
        """The SET clause that turns a pending row of ``target`` into a leased one."""
        t = self.table if target is None else target
        return {
            "state": int(State.LEASED),
            "lease_owner": token,
            "lease_until": self.after(lease),
            "attempts": t.c.attempts + 1,
        }

    @abstractmethod
    def claim(
        self, conn: Connection, *, limit: int, lease: float, token: str, ordered: bool
    ) -> list[Event]:
        """Lease up to ``limit`` due pending events, oldest first, under ``token``.

        Concurrent claims on separate connections never return the same row
        and never wait for each other's locks (except on SQLite, where writers
        take turns). ``attempts`` is incremented. In ``ordered`` mode only the
        head of each key is eligible.
        """

    def claim_returning(self, conn: Connection, stmt: sa.Executable, token: str) -> list[Event]:
        """Run a claim that leases and returns its rows in one statement; oldest first.

        ``RETURNING`` / ``OUTPUT`` give rows in no particular order; the relay
        publishes in id order.
        """
        with self.transaction(conn):
            rows = conn.execute(stmt).all()
        return sorted((self.to_event(r, token) for r in rows), key=lambda e: e.id)

    @staticmethod
    def to_event(row: Sequence[Any], token: str, attempts_offset: int = 0) -> Event:
        """Build an :class:`Event` from a row of :meth:`claim_columns`."""
        created: datetime = row[7]
        if created.tzinfo is None:
            created = created.replace(tzinfo=UTC)
        return Event(
            id=int(row[0]),
            event_id=str(row[1]),
            topic=row[2],
            key=row[3],
            payload=row[4],
            headers=dict(row[5] or {}),
            attempts=int(row[6]) + attempts_offset,
            created_at=created,
            token=token,
        )

    # -- settle (all fenced by the claim token) ------------------------------

    def owned(self, ids: Sequence[int], token: str) -> sa.ColumnElement[bool]:
        """Rows among ``ids`` still held by ``token``.

        ``reap`` keeps the owner on expired leases, so a slow relay can still
        settle an expired lease nobody re-claimed; a new claim changes the
        owner and fences the old one out.
        """
        t = self.table
        return sa.and_(
            t.c.id.in_(list(ids)),
            t.c.lease_owner == token,
            t.c.state.in_([int(s) for s in _ACTIVE]),
        )

    def mark_sent(self, conn: Connection, ids: Sequence[int], *, token: str, delete: bool) -> int:
        """Mark published events sent (or delete them); return the rows changed.

        A count below ``len(ids)`` means those leases were lost to another relay.
        """
        if not ids:
            return 0
        t = self.table
        stmt: sa.Delete | sa.Update
        if delete:
            stmt = sa.delete(t).where(self.owned(ids, token))
        else:
            stmt = (
                sa.update(t)
                .where(self.owned(ids, token))
                .values(
                    state=int(State.SENT), sent_at=self.now(), lease_owner=None, lease_until=None
                )
            )
        with self.transaction(conn):
            return conn.execute(stmt).rowcount

    def mark_failed(self, conn: Connection, failures: Sequence[Failure], *, token: str) -> int:
        """Return failed events to pending after their backoff, or make them dead.

        A failure with ``retry_in=None`` becomes dead. Returns the rows changed.
        """
        if not failures:
            return 0
        t = self.table
        changed = 0
        with self.transaction(conn):
            for f in failures:
                values: dict[str, Any] = {
                    "last_error": f.error[:MAX_ERROR],
                    "lease_owner": None,
                    "lease_until": None,
                }
                if f.retry_in is None:
                    values["state"] = int(State.DEAD)
                else:
                    values["state"] = int(State.PENDING)
                    values["available_at"] = self.after(f.retry_in)
                stmt = sa.update(t).where(self.owned([f.id], token)).values(values)
                changed += conn.execute(stmt).rowcount
        return changed

    def release(self, conn: Connection, ids: Sequence[int], *, token: str) -> int:
        """Give back claimed but unpublished events, due at once, without burning an attempt."""
        if not ids:
            return 0
        t = self.table
        stmt = (
            sa.update(t)
            .where(self.owned(ids, token), t.c.state == int(State.LEASED))
            .values(
                state=int(State.PENDING),
                available_at=self.now(),
                attempts=sa.case((t.c.attempts > 0, t.c.attempts - 1), else_=0),
                lease_owner=None,
                lease_until=None,
            )
        )
        with self.transaction(conn):
            return conn.execute(stmt).rowcount

    def reap(self, conn: Connection, *, max_attempts: int) -> int:
        """Return expired leases to pending; make them dead once ``max_attempts`` is spent.

        An event whose relay keeps dying while publishing it would otherwise
        be retried forever. Returns the rows changed.
        """
        t = self.table
        expired = sa.and_(t.c.state == int(State.LEASED), t.c.lease_until < self.now())
        to_dead = (
            sa.update(t)
            .where(expired, t.c.attempts >= max_attempts)
            .values(
                state=int(State.DEAD),
                lease_until=None,
                last_error=sa.literal(
                    f"lease expired {max_attempts} times: relay died or publishing "
                    "took longer than the lease"
                ),
            )
        )
        to_pending = (
            sa.update(t)
            .where(expired, t.c.attempts < max_attempts)
            .values(state=int(State.PENDING), available_at=self.now(), lease_until=None)
        )
        with self.transaction(conn):
            return conn.execute(to_dead).rowcount + conn.execute(to_pending).rowcount

    # -- maintenance ----------------------------------------------------------

    def cleanup(self, conn: Connection, *, older_than: float, batch: int) -> int:
        """Delete at most ``batch`` sent rows sent more than ``older_than`` seconds ago.

        Never touches pending, leased or dead rows. Returns the rows deleted;
        call again until it returns less than ``batch``.
        """
        t = self.table
        old_sent = sa.and_(t.c.state == int(State.SENT), t.c.sent_at < self.after(-older_than))
        # Select the ids first, then delete by id: MySQL rejects LIMIT in an
        # IN subquery and SQL Server escalates big deletes to a table lock.
        pick = sa.select(t.c.id).where(old_sent).order_by(t.c.id).limit(batch)
        with self.transaction(conn):
            ids = list(conn.execute(pick).scalars())
            if not ids:
                return 0
            stmt = sa.delete(t).where(t.c.id.in_(ids), t.c.state == int(State.SENT))
            return conn.execute(stmt).rowcount

    def replay(
        self,
        conn: Connection,
        *,
        ids: Sequence[int] | None = None,
        topic: str | None = None,
        key: str | None = None,
    ) -> int:
        """Move dead events back to pending (attempts reset); all when no filter is given."""
        t = self.table
        where: list[sa.ColumnElement[bool]] = [t.c.state == int(State.DEAD)]
        if ids is not None:
            where.append(t.c.id.in_(list(ids)))
        if topic is not None:
            where.append(t.c.topic == topic)
        if key is not None:
            where.append(t.c.key == key)
        stmt = (
            sa.update(t)
            .where(*where)
            .values(
                state=int(State.PENDING),
                attempts=0,
                available_at=self.now(),
                lease_owner=None,
                lease_until=None,
            )
        )
        with self.transaction(conn):
            return conn.execute(stmt).rowcount

    @staticmethod
    def utcnow() -> datetime:
        """The application's UTC clock, naive (for databases that store naive UTC)."""
        return datetime.now(UTC).replace(tzinfo=None)

    # -- inbox (idempotent consumer) ------------------------------------------------

    @abstractmethod
    def inbox_insert(self, consumer: str, event_id: str) -> Insert:
        """Record ``(consumer, event_id)`` in the inbox table unless it is already there.

        Each database's native insert-if-absent: it affects 1 row when the id
        is new and 0 when it is a duplicate, and never raises on the duplicate,
        so the caller's transaction stays usable. A concurrent insert of the
        same key waits for the other transaction, then counts as a duplicate if
        it committed. ``outbox_core.inbox.Inbox`` validates the values first.
        """

    def inbox_cleanup(self, conn: Connection, *, older_than: float, batch: int) -> int:
        """Delete at most ``batch`` inbox rows processed more than ``older_than`` seconds ago.

        Returns the rows deleted; call again until it returns less than ``batch``.
        """
        t = self.tables.inbox
        # Keys first, then delete by key (as in cleanup): MySQL rejects LIMIT in
        # an IN subquery and SQL Server escalates big deletes to a table lock.
        pick = (
            sa.select(t.c.consumer, t.c.event_id)
            .where(t.c.processed_at < self.after(-older_than))
            .order_by(t.c.processed_at)
            .limit(batch)
        )
        with self.transaction(conn):
            by_consumer: dict[str, list[str]] = {}
            for consumer, event_id in conn.execute(pick):
                by_consumer.setdefault(consumer, []).append(str(event_id))
            if not by_consumer:
                return 0
            # One (consumer = ? AND event_id IN (...)) per consumer: it uses the
            # primary key on every database, with no row-value IN (SQL Server has none).
            match = sa.or_(
                *(
                    sa.and_(t.c.consumer == consumer, t.c.event_id.in_(ids))
                    for consumer, ids in by_consumer.items()
                )
            )
            return conn.execute(sa.delete(t).where(match)).rowcount


# -- registry ------------------------------------------------------------------

#: Backend name -> "module:Class", imported only when asked for, so a user
#: with one driver installed never needs the others.
REGISTRY: dict[str, str] = {
    "postgresql": "dialects.postgresql:PostgresqlDialect",
    "mysql": "dialects.mysql:MysqlDialect",
    "mariadb": "dialects.mysql:MysqlDialect",
    "mssql": "dialects.mssql:MssqlDialect",
    "sqlite": "dialects.sqlite:SqliteDialect",
}


def known_dialects() -> list[str]:
    """The names accepted by :func:`get_dialect`."""
    return sorted(REGISTRY)


def get_dialect(name: str) -> type[Dialect]:
    """Return the dialect class for a backend name; raise :class:`UnknownDialect` otherwise."""
    target = REGISTRY.get(name.lower())
    if target is None:
        raise UnknownDialect(
            f"unknown database dialect {name!r}; supported: {', '.join(known_dialects())}"
        )
    module_name, _, cls_name = target.partition(":")
    module = importlib.import_module(module_name)
    cls: type[Dialect] = getattr(module, cls_name)
    return cls
