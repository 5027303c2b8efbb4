"""The Dialect: capability flags and the named operations on the outbox table.

A dialect owns every statement the outbox runs against one database family.
Each operation runs in its own short transaction that the dialect opens and
commits; when the caller already has a transaction open on the connection,
the operation joins it instead (tests use this to hold a claim's row locks
while another relay claims). Nothing is held open while publishing.

Settling writes (``mark_sent``, ``mark_failed``, ``release``) are fenced by
the claim token: they only touch rows whose ``lease_owner`` is still that
token, so a relay whose lease expired and was re-claimed changes nothing.

What is not an operation on the table lives in parts the dialect is composed
of, each a class a family subclasses where it differs (:class:`Parts`):
``session`` (connections and their server-side limits), ``storage`` (what the
database can store), ``enqueue`` (the producer's statements and wake-ups),
``inbox`` (the idempotent consumer's statements), ``reads`` (named reads for
status, the doctor and migrate), ``keys`` (the ordered claim's walk over
keys), ``partitions`` (the membership table and partitioned ordered claims),
``presence`` (a row per running relay), ``settle`` (the settling writes
above) and ``adoption`` (a team's own table made an outbox). The
statement-building parts receive the few operations of the dialect they build on
(:class:`~outbox_core.dialects.base.primitives.SqlPrimitives`), not the
dialect. Test provisioning and doctor checks sit beside each family's
dialect, in its ``provision`` and ``doctor`` modules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from outbox_core.dialects.base.adoption import Adoption
from outbox_core.dialects.base.console import ConsoleReads
from outbox_core.dialects.base.enqueue import EnqueueStatements
from outbox_core.dialects.base.inbox import InboxStatements
from outbox_core.dialects.base.ordered import KeyWalk
from outbox_core.dialects.base.partitioned import PartitionStatements
from outbox_core.dialects.base.presence import PresenceStatements
from outbox_core.dialects.base.primitives import SqlPrimitives
from outbox_core.dialects.base.reading import TableReads
from outbox_core.dialects.base.session import SessionSetup
from outbox_core.dialects.base.settle import SettleStatements
from outbox_core.dialects.base.storage import StorageRules
from outbox_core.dialects.base.values import ACTIVE_STATES, ServerInfo, chunked
from outbox_core.errors import ConfigurationError
from outbox_core.message import Event, Failure, State
from outbox_core.schema import OutboxTables, detached_index, in_state, obsolete_indexes


@dataclass(frozen=True)
class Parts:
    """The part classes a database family brings; each defaults to the base behaviour."""

    inbox: type[InboxStatements]
    session: type[SessionSetup] = SessionSetup
    storage: type[StorageRules] = StorageRules
    enqueue: type[EnqueueStatements] = EnqueueStatements
    reads: type[TableReads] = TableReads
    keys: type[KeyWalk] = KeyWalk
    partitions: type[PartitionStatements] = PartitionStatements
    settle: type[SettleStatements] = SettleStatements
    console: type[ConsoleReads] = ConsoleReads
    presence: type[PresenceStatements] = PresenceStatements
    adoption: type[Adoption] = Adoption


class Dialect(ABC):
    """Strategy for claiming, settling and cleaning outbox rows on one database family."""

    #: Registry name: "postgresql", "mysql", "mssql" or "sqlite".
    name: ClassVar[str]
    #: The family's name for people: "PostgreSQL", "MySQL/MariaDB", "SQL Server", "SQLite".
    family: ClassVar[str]
    #: True when concurrent claims skip each other's locked rows instead of
    #: waiting (SKIP LOCKED / READPAST). SQLite serialises writers instead.
    row_locks: ClassVar[bool] = True
    #: The database has partial (filtered) indexes: the work indexes cover
    #: only rows still to deliver (``schema._add_work_indexes``).
    partial_indexes: ClassVar[bool] = True
    #: The clock is the application's (``now()`` is a bound value, not SQL):
    #: a prepared enqueue binds it per call.
    app_clock: ClassVar[bool] = False
    #: Largest claim batch the dialect accepts, and the most ids one statement
    #: binds (SQL Server takes at most 2,100 parameters per statement).
    max_batch: ClassVar[int] = 10_000
    #: What a pattern of schemas (``--schemas``) finds in one database: ``schema``
    #: (PostgreSQL, SQL Server), ``database`` (MySQL, MariaDB: a database is a
    #: schema there), or None where the database has no schemas (SQLite).
    schema_kind: ClassVar[str | None] = "schema"
    #: Why the server cannot end a transaction its client froze in (None: it
    #: can, through the idle limit :meth:`SessionSetup.configure` sets).
    frozen_transactions_stay: ClassVar[str | None] = None
    #: The family's parts (see :class:`Parts`).
    parts: ClassVar[Parts]

    def __init__(self, tables: OutboxTables) -> None:
        self.tables = tables
        self.table = tables.outbox
        parts = self.parts
        self.session = parts.session()
        self.storage = parts.storage()
        sql = self.primitives()
        self.enqueue = parts.enqueue(sql, self.storage)
        self.inbox = parts.inbox(sql)
        self.reads = parts.reads(sql)
        self.partitions = parts.partitions(sql)
        # An ordered claim with runs leases its rows as a partitioned claim does.
        self.keys = parts.keys(sql, self.partitions.lease)
        self.settle = parts.settle(sql)
        self.console = parts.console(sql)
        self.presence = parts.presence(sql)
        self.adoption = parts.adoption(sql)
        self._claims: dict[tuple[int, float, bool], sa.Executable] = {}

    def primitives(self) -> SqlPrimitives:
        """The operations of this dialect its parts build their statements on."""
        return SqlPrimitives(
            tables=self.tables,
            now=self.now,
            after=self.after,
            clock=self.clock,
            clock_params=self.clock_params,
            transaction=self.transaction,
            lock_rows=self.lock_rows,
            id_in=self.id_in,
            id_in_bound=self.id_in_bound,
            max_batch=self.max_batch,
            owned=self.owned,
            claim_columns=self.claim_columns,
            to_event=self.to_event,
            lease_values=self.lease_values,
            stored_size=self.stored_size,
        )

    # -- clock ---------------------------------------------------------------

    @abstractmethod
    def now(self) -> sa.ColumnElement[datetime]:
        """The database's current UTC time as a SQL expression."""

    @abstractmethod
    def after(self, seconds: float) -> sa.ColumnElement[datetime]:
        """The database's current UTC time plus ``seconds`` (may be negative)."""

    def clock(self) -> sa.ColumnElement[datetime]:
        """:meth:`now` for statements built once and run many times.

        The application's clock (SQLite) is a bound parameter, ``o_now``,
        passed at each execution (see :meth:`clock_params`).
        """
        return sa.bindparam("o_now", type_=sa.DateTime()) if self.app_clock else self.now()

    def clock_params(self) -> dict[str, Any]:
        """The parameters :meth:`clock` needs at execution."""
        return {"o_now": self.utcnow()} if self.app_clock else {}

    @staticmethod
    def utcnow() -> datetime:
        """The application's UTC clock, naive (for databases that store naive UTC)."""
        return datetime.now(UTC).replace(tzinfo=None)

    # -- transactions, the server, the tables ----------------------------------

    @contextmanager
    def transaction(self, conn: Connection) -> Iterator[Connection]:
        """Open and commit a short transaction, or join the caller's open one."""
        if conn.in_transaction():
            yield conn
            return
        self.session.prepare(conn)
        with conn.begin():
            self.session.begin_statement(conn)
            yield conn

    @abstractmethod
    def server_info(self, conn: Connection) -> ServerInfo:
        """Identify the server (product and version), MySQL and MariaDB told apart."""

    @abstractmethod
    def check(self, conn: Connection) -> None:
        """Verify the server's version and capabilities.

        Raises :class:`~outbox_core.errors.UnsupportedDatabase` naming the
        version found and the version needed.
        """

    def check_ordered(self, conn: Connection) -> None:  # noqa: B027 - optional hook
        """Verify the database can serve ordered claims (checked when a relay starts ordered).

        Raises :class:`~outbox_core.errors.UnsupportedDatabase` with the fix.
        The default accepts: claims that see past other claims' row locks need
        nothing more.
        """

    def install(self, conn: Connection, *, existing: str = "pending") -> None:
        """Create the tables (idempotent) and apply database settings the outbox needs.

        An adopted table (``OutboxTables.columns``) must exist and gets only the
        toolkit's bookkeeping (:meth:`Adoption.adopt`).
        """
        if self.tables.adopted:
            self.adoption.adopt(conn, existing=existing, partial_indexes=self.partial_indexes)
            return
        if existing != "pending":
            raise ConfigurationError("existing applies to a table adopted with columns")
        with self.transaction(conn):
            # Inside the transaction: nothing is created over a table of another layout.
            self.adoption.refuse_another_layout(conn)
            self.tables.create_all(conn)
            self.drop_obsolete_indexes(conn)

    def drop_obsolete_indexes(self, conn: Connection) -> list[str]:
        """Drop the indexes an earlier version created that this one does not use.

        Runs after ``create_all`` has built their replacements, so claims
        always have an index to read. Returns the names dropped.
        """
        t = self.table
        present = {ix["name"] for ix in sa.inspect(conn).get_indexes(t.name, schema=t.schema)}
        dropped = [n for n in obsolete_indexes(t, self.partial_indexes) if n in present]
        for name in dropped:
            detached_index(t, name).drop(conn)
        return dropped

    #: The statement that refreshes a table's planner statistics (``{table}``: its quoted name).
    analyze_sql: ClassVar[str] = "ANALYZE {table}"

    def analyze(self, conn: Connection, table: sa.Table | None = None) -> None:
        """Refresh the planner's statistics of ``table`` (the outbox table) after a bulk load.

        A table filled faster than auto-analyze notices can be planned as if
        empty; ``outbox migrate`` and the benchmarks call this after loading.
        """
        target = self.table if table is None else table
        name = conn.dialect.identifier_preparer.format_table(target)
        # No SQLAlchemy construct for ANALYZE; the name is a quoted, validated identifier.
        conn.exec_driver_sql(self.analyze_sql.format(table=name))

    # -- claim ----------------------------------------------------------------

    def claim_columns(self, o: sa.FromClause) -> list[sa.ColumnElement[Any]]:
        """The columns a claim returns, in :meth:`to_event` order."""
        c = o.c
        return [c.id, c.event_id, c.topic, c.key, c.payload, c.headers, c.attempts, c.created_at]

    def stored_size(self, o: sa.FromClause) -> sa.ColumnElement[int]:
        """The bytes of a row's payload and headers as the database stores them.

        What a claim's byte budget counts (:mod:`~outbox_core.dialects.base.budget`):
        read on the server, without sending the values. The default is SQL's
        ``length()``, which some databases count in characters; each family
        gives its own stored size.
        """
        c = o.c
        return sa.func.length(c.payload, type_=sa.Integer()) + sa.func.coalesce(
            sa.func.length(c.headers, type_=sa.Integer()), 0
        )

    def lease_values(
        self,
        *,
        lease: float,
        token: str | sa.BindParameter[str],
        target: sa.FromClause | None = None,
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
        self,
        conn: Connection,
        *,
        limit: int,
        lease: float,
        token: str,
        ordered: bool,
        block_on_dead: bool = True,
        max_bytes: int | None = None,
    ) -> list[Event]:
        """Lease up to ``limit`` due pending events, oldest first, under ``token``.

        Concurrent claims on separate connections never return the same row
        and never wait for each other's locks (except on SQLite, where writers
        take turns). ``attempts`` is incremented. In ``ordered`` mode only the
        head of each key is eligible; ``block_on_dead``: a dead head still
        holds its key back. ``max_bytes``: the claim's byte budget (see
        :mod:`~outbox_core.dialects.base.budget`; None: none), counted by
        :meth:`stored_size`; the first event is taken whatever its size.
        """

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """Lock the rows a claim picks, skipping rows other claims hold.

        The default adds nothing: SQLite's ``BEGIN IMMEDIATE`` already makes
        claims take turns. Row-locking databases override it.
        """
        return select

    def to_event(self, row: Sequence[Any], token: str, attempts_offset: int = 0) -> Event:
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

    # -- settle (all fenced by the claim token; the writes are the settle part's) --

    def id_in(self, ids: Sequence[int]) -> sa.ColumnElement[bool]:
        """``id IN (...)``; PostgreSQL overrides it with one array parameter."""
        return self.table.c.id.in_(list(ids))

    def id_in_bound(self) -> sa.ColumnElement[bool]:
        """``id IN (:o_ids)``, the ids bound at execution (an expanding parameter)."""
        return self.table.c.id.in_(sa.bindparam("o_ids", expanding=True))

    def owned(
        self, ids: Sequence[int], token: str, *, or_dead: bool = False
    ) -> sa.ColumnElement[bool]:
        """Rows among ``ids`` still held by ``token``.

        ``reap`` keeps the owner on expired leases, so a slow relay can still
        settle an expired lease nobody re-claimed; a new claim changes the
        owner and fences the old one out. ``or_dead``: also a row the reaper
        made dead under this token (nobody claimed it since).
        """
        t = self.table
        states = [*ACTIVE_STATES, State.DEAD] if or_dead else ACTIVE_STATES
        return sa.and_(
            self.id_in(ids),
            t.c.lease_owner == token,
            in_state(t.c.state, *states),
        )

    def mark_sent(self, conn: Connection, ids: Sequence[int], *, token: str, delete: bool) -> int:
        """Mark published events sent (or delete them); return the rows changed.

        A count below ``len(ids)`` means those leases were lost to another relay.
        An event the reaper made dead while its relay was publishing it (its
        lease ran out on its last attempt) is marked sent too: the broker
        confirmed it, and a confirmed event never stays dead.
        """
        return self.settle.mark_sent(conn, ids, token=token, delete=delete)

    def mark_failed(self, conn: Connection, failures: Sequence[Failure], *, token: str) -> int:
        """Return failed events to pending after their backoff, or make them dead.

        A failure with ``retry_in=None`` becomes dead. Returns the rows changed.
        """
        return self.settle.mark_failed(conn, failures, token=token)

    def release(self, conn: Connection, ids: Sequence[int], *, token: str) -> int:
        """Give back claimed but unpublished events, due at once, without burning an attempt."""
        return self.settle.release(conn, ids, token=token)

    def forgive(self, conn: Connection, ids: Sequence[int]) -> int:
        """Take back the attempt of published events whose lease was lost before marking.

        Another relay re-claimed them (and counted an attempt of its own): the
        lost lease's attempt delivered, so it is no failure and must not bring
        the event closer to dead. Touches only the counter of rows still
        unsent; returns the rows changed.
        """
        return self.settle.forgive(conn, ids)

    def extend(self, conn: Connection, ids: Sequence[int], *, token: str, lease: float) -> set[int]:
        """Renew the lease of the events among ``ids`` that ``token`` still holds.

        Returns the ids renewed: the others were reaped or re-claimed and must
        not be published by this relay. A lease that ran out but that nobody
        took yet is renewed (no other relay can have published it).
        """
        return self.settle.extend(conn, ids, token=token, lease=lease)

    def reap(self, conn: Connection, *, max_attempts: int, batch: int = 1000) -> int:
        """Return expired leases to pending; make them dead once ``max_attempts`` is spent.

        An event whose relay keeps dying while publishing it would otherwise
        be retried forever. Rows another session has locked (a relay settling
        or renewing them, perhaps frozen mid-transaction) are skipped, not
        waited for; at most ``batch`` rows per call. Returns the rows changed.
        """
        t = self.table
        expired = sa.and_(in_state(t.c.state, State.LEASED), t.c.lease_until < self.now())
        pick = self.lock_rows(sa.select(t.c.id).where(expired).order_by(t.c.id).limit(batch))
        with self.transaction(conn):
            ids = list(conn.execute(pick).scalars())
            if not ids:
                return 0
            expired = sa.and_(self.id_in(ids), expired)
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
            return conn.execute(to_dead).rowcount + conn.execute(to_pending).rowcount

    # -- maintenance ----------------------------------------------------------

    def cleanup(self, conn: Connection, *, older_than: float, batch: int) -> int:
        """Delete at most ``batch`` sent rows sent more than ``older_than`` seconds ago.

        Never touches pending, leased or dead rows. Returns the rows deleted;
        call again until it returns less than ``batch``.
        """
        t = self.table
        old_sent = sa.and_(in_state(t.c.state, State.SENT), t.c.sent_at < self.after(-older_than))
        # Select the ids first, then delete by id: MySQL rejects LIMIT in an
        # IN subquery and SQL Server escalates big deletes to a table lock.
        # Rows another session holds are skipped, not waited for (a frozen
        # relay must not stall the others' maintenance).
        pick = self.lock_rows(sa.select(t.c.id).where(old_sent).order_by(t.c.id).limit(batch))
        with self.transaction(conn):
            return self.delete_picked(conn, list(conn.execute(pick).scalars()))

    def delete_picked(self, conn: Connection, ids: Sequence[int]) -> int:
        """Delete the sent rows ``ids`` that this transaction has locked (cleanup's second step)."""
        t = self.table
        # By id in chunks a statement can bind (SQL Server: 2,100 parameters).
        return sum(
            conn.execute(
                sa.delete(t).where(self.id_in(chunk), in_state(t.c.state, State.SENT))
            ).rowcount
            for chunk in chunked(ids, self.max_batch)
        )

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
        where: list[sa.ColumnElement[bool]] = [in_state(t.c.state, State.DEAD)]
        if ids is not None:
            where.append(self.id_in(ids))
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
