"""The Dialect interface every database strategy implements, and the registry.

A dialect owns every statement the outbox runs against one database family.
Each interface method runs in its own short transaction that the dialect
opens and commits; when the caller already has a transaction open on the
connection, the method joins it instead (tests use this to hold a claim's row
locks while another relay claims). Nothing is held open while publishing.

Settling writes (``mark_sent``, ``mark_failed``, ``release``) are fenced by
the claim token: they only touch rows whose ``lease_owner`` is still that
token, so a relay whose lease expired and was re-claimed changes nothing.

The interface is one class, :class:`Dialect`, assembled from parts:

* ``values``: shared values (ServerInfo, SessionLimits, table summaries);
* ``storage``: what a database can store (enqueue checks, migrate limits);
* ``ordered``: ordered claims (head of key, the walk over keys, runs);
* ``reading``: named reads of the table (status, doctor, migrate);
* ``registry``: backend name -> dialect class;
* this module: the clock, connections and session limits, enqueue,
  wake-ups, the claim, settling, reaping, cleanup, the inbox, the doctor
  hooks and test provisioning.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.dml import Insert

from outbox_core.dialects.base.ordered import OrderedClaims
from outbox_core.dialects.base.reading import TableReads
from outbox_core.dialects.base.registry import (
    REGISTRY,
    dialect_families,
    get_dialect,
    known_dialects,
)
from outbox_core.dialects.base.storage import StorageRules
from outbox_core.dialects.base.values import (
    _ACTIVE,
    MAX_ERROR,
    MAX_KEYS_PER_CLAIM,
    MAX_WALKS,
    NO_END,
    Activity,
    Backlog,
    Listener,
    LiveLeases,
    ServerInfo,
    SessionLimits,
    chunked,
    delete_in_batches,
    version_prefix,
)
from outbox_core.message import Event, Failure, NewEvent, State
from outbox_core.schema import OutboxTables, detached_index, in_state, obsolete_indexes

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from outbox_core.doctor import Check, Finding

__all__ = [
    "MAX_ERROR",
    "MAX_KEYS_PER_CLAIM",
    "MAX_WALKS",
    "NO_END",
    "REGISTRY",
    "Activity",
    "Backlog",
    "Dialect",
    "Listener",
    "LiveLeases",
    "ReturningDialect",
    "ServerInfo",
    "SessionLimits",
    "delete_in_batches",
    "dialect_families",
    "get_dialect",
    "known_dialects",
    "version_prefix",
]


class Dialect(StorageRules, TableReads, OrderedClaims, ABC):
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
    #: Ordered claims find keys with ``GROUP BY`` (MySQL runs it as a loose
    #: index scan; SQL Server's recursive CTEs allow no subqueries) instead of
    #: a recursive CTE.
    group_key_scan: ClassVar[bool] = False
    #: The clock is the application's (``now()`` is a bound value, not SQL):
    #: a prepared enqueue binds it per call.
    app_clock: ClassVar[bool] = False
    #: Largest claim batch the dialect accepts, and the most ids one statement
    #: binds (SQL Server takes at most 2,100 parameters per statement).
    max_batch: ClassVar[int] = 10_000
    #: Why the server cannot end a transaction its client froze in (None: it
    #: can, through :meth:`limit_session`'s idle limit).
    frozen_transactions_stay: ClassVar[str | None] = None

    def __init__(self, tables: OutboxTables) -> None:
        self.tables = tables
        self.table = tables.outbox
        # Ordered claims visit keys round-robin from here (see key_window); a
        # hint shared by the relays of this process, so races are harmless.
        self._key_cursor: str | None = None
        self._scans: dict[tuple[bool, int, int, int, bool], sa.CompoundSelect[Any]] = {}
        self._prepared: dict[tuple[bool, bool], sa.Executable] = {}
        self._claims: dict[tuple[int, float], sa.Executable] = {}
        self._marks: dict[bool, sa.Executable] = {}

    # -- clock ---------------------------------------------------------------

    @abstractmethod
    def now(self) -> sa.ColumnElement[datetime]:
        """The database's current UTC time as a SQL expression."""

    @abstractmethod
    def after(self, seconds: float) -> sa.ColumnElement[datetime]:
        """The database's current UTC time plus ``seconds`` (may be negative)."""

    # -- connections and transactions ---------------------------------------

    def engine_options(self) -> dict[str, Any]:
        """Options for ``create_engine`` when the outbox creates its engine from a URL."""
        return {}

    def connect_timeout_args(self, seconds: float) -> dict[str, Any]:
        """``connect_args`` that bound how long connecting may take (the driver's own name)."""
        return {}

    def connect(self, engine: Engine) -> Connection:
        """Open a connection configured for this dialect's claims."""
        return engine.connect()

    def limit_session(self, conn: Connection, limits: SessionLimits) -> None:
        """Put server-side limits on a relay's connection (docs/design.md, Liveness).

        A relay frozen inside a transaction (GC or VM pause, a partition that
        keeps TCP open) must not hold rows, or make other relays wait, much
        longer than a lease: each database sets what it has (a lock-wait
        timeout, an idle-in-transaction timeout). Runs once per new relay
        connection, outside any transaction. The default sets nothing.
        """

    def idle_limit(self, limits: SessionLimits) -> float | None:
        """Seconds after which the server drops an idle relay connection (None: never).

        Where the only bound on a frozen transaction also ends idle sessions
        (MySQL's ``wait_timeout``), the relay replaces a connection left
        unused this long before using it again.
        """
        return None

    def prepare(self, conn: Connection) -> None:
        """Adjust a connection before a transaction begins (isolation level, ...)."""

    def begin_statement(self, conn: Connection) -> None:
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

    # -- test provisioning (the contract, property, fault and chaos suites) ----

    #: Where the suites find a server when ``OUTBOX_TEST_<NAME>_URL`` is unset
    #: (None: only where that variable names one).
    test_default_url: ClassVar[str | None] = None
    #: With ``CI=true`` an unreachable test server fails the suites instead of skipping them.
    test_required_in_ci: ClassVar[bool] = False
    #: The test database is a server to reach (SQLite's is a file).
    test_needs_server: ClassVar[bool] = True

    @classmethod
    def test_url(cls, workdir: Path) -> str | None:
        """The database the suites run on: ``OUTBOX_TEST_<NAME>_URL``, else the default.

        A dialect without a server (SQLite) gives a fresh file in ``workdir``.
        """
        return os.environ.get(f"OUTBOX_TEST_{cls.name.upper()}_URL") or cls.test_default_url

    def shared_by_processes(self, url: URL) -> bool:
        """Other processes connecting to ``url`` reach this same database."""
        return True

    # -- ``outbox doctor`` ------------------------------------------------------

    #: How concurrent claims keep apart, for people.
    locking: ClassVar[str] = "claims skip each other's rows"
    #: The fix when :meth:`check` refuses the server.
    upgrade_hint: ClassVar[str | None] = None
    #: A primary key can be added to an existing table (SQLite cannot).
    can_add_primary_key: ClassVar[bool] = True

    def doctor_checks(self) -> list[tuple[str, Check]]:
        """This database's own checks (isolation, vacuum, storage engine, ...), by finding name.

        Each dialect keeps them in its ``doctor`` module, imported only when
        the doctor runs.
        """
        return []

    def doctor_preflight(self, url: URL, install_command: str) -> Finding | None:
        """A problem to report instead of connecting at all (SQLite: a mistyped file)."""
        return None

    @abstractmethod
    def server_info(self, conn: Connection) -> ServerInfo:
        """Identify the server (product and version), MySQL and MariaDB told apart."""

    @abstractmethod
    def check(self, conn: Connection) -> None:
        """Verify the server's version and capabilities.

        Raises :class:`~outbox_core.errors.UnsupportedDatabase` naming the
        version found and the version needed.
        """

    def check_ordered(self, conn: Connection) -> None:
        """Verify the database can serve ordered claims (checked when a relay starts ordered).

        Raises :class:`~outbox_core.errors.UnsupportedDatabase` with the fix.
        The default accepts: claims that see past other claims' row locks need
        nothing more.
        """

    def install(self, conn: Connection) -> None:
        """Create the tables (idempotent) and apply database settings the outbox needs."""
        with self.transaction(conn):
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

    # -- what this database can store (enqueue and migrate) ------------------

    # -- what a table of this database can store (``outbox migrate``) --------

    # -- enqueue --------------------------------------------------------------

    def with_wake_up(self, insert: Insert, *, notify: bool) -> sa.Executable:
        """Fold the wake-up into an enqueue ``INSERT`` where the database has one (PostgreSQL)."""
        return insert

    def json_bind(self, name: str) -> sa.ColumnElement[Any]:
        """A bound JSON value of the enqueue ``INSERT``.

        Where :attr:`json_as_text` is set, the value bound is the JSON text
        ``enqueue`` already made while checking the payload (serialising it
        a second time costs as much as the rest of enqueue's Python).
        """
        if self.json_as_text:
            return sa.bindparam(name, type_=sa.UnicodeText())
        return sa.bindparam(name, type_=self.table.c.payload.type)

    def prepared_insert(self, *, headers: bool, delay: float = 0.0) -> Insert:
        """The enqueue ``INSERT``, its event's values as bound parameters.

        Parameters are named ``o_<column>`` (see :meth:`enqueue_call`). Without
        ``headers`` the column is NULL. A ``delay`` goes into the statement
        (``available_at`` from the database clock).
        """
        t = self.table
        now = self.clock()
        # inline(): no implicit RETURNING id, which enqueue never reads.
        return (
            sa.insert(t)
            .inline()
            .values(
                event_id=sa.bindparam("o_event_id", type_=t.c.event_id.type),
                topic=sa.bindparam("o_topic", type_=t.c.topic.type),
                key=sa.bindparam("o_key", type_=t.c.key.type),
                payload=self.json_bind("o_payload"),
                headers=self.json_bind("o_headers") if headers else sa.null(),
                state=int(State.PENDING),
                attempts=0,
                available_at=self.after(delay) if delay else now,
                created_at=now,
            )
        )

    def enqueue_call(
        self, event: NewEvent, *, notify: bool
    ) -> tuple[sa.Executable, dict[str, Any]]:
        """What ``enqueue`` executes for ``event``: a statement and its parameters.

        Undelayed events (nearly all) reuse a statement built once: building a
        fresh one per event, and computing its cache key, cost more than the
        database's own work on the insert (``bench/producer_overhead.py``).
        A delayed event's statement carries its delay and is built per call.
        """
        headers = event.headers is not None
        if event.delay_seconds:
            insert = self.prepared_insert(headers=headers, delay=event.delay_seconds)
            stmt = self.with_wake_up(insert, notify=notify)
        else:
            cached = self._prepared.get((notify, headers))
            if cached is None:
                insert = self.prepared_insert(headers=headers)
                cached = self._prepared[notify, headers] = self.with_wake_up(insert, notify=notify)
            stmt = cached
        as_text = self.json_as_text
        params: dict[str, Any] = {
            "o_event_id": event.event_id,
            "o_topic": event.topic,
            "o_key": event.key,
            "o_payload": event.payload_json if as_text else event.payload,
        }
        if headers:
            params["o_headers"] = event.headers_json if as_text else event.headers
        params.update(self.clock_params())
        return stmt, params

    def enqueue_many_calls(
        self, events: Sequence[NewEvent], *, notify: bool, driver: sa.Dialect
    ) -> Iterator[tuple[sa.Executable, Any]]:
        """What ``enqueue_many`` executes: ``(statement, parameters)`` pairs, in order.

        The first event goes alone, carrying the wake-up. The others go as
        executemany of :meth:`enqueue`'s own prepared statement, one per run
        of events of the same shape (with or without headers, the same
        delay), so rows are written, and get their ids, in the order given.
        SQLAlchemy's "insertmanyvalues" folds each executemany into multi-row
        ``INSERT`` statements: on ``driver``\'s own where it does so without
        ``RETURNING`` (SQL Server, whose ``OUTPUT`` a trigger would break),
        else through ``RETURNING id`` where the server has it (PostgreSQL,
        SQLite, MariaDB). MySQL has neither: there PyMySQL sends the rows one
        by one.
        """
        if not events:
            return
        yield self.enqueue_call(events[0], notify=notify)
        fold = driver.insert_executemany_returning and not driver.use_insertmanyvalues_wo_returning
        run: list[dict[str, Any]] = []
        shape: tuple[bool, float] | None = None
        stmt: sa.Executable | None = None
        for event in events[1:]:
            this = (event.headers is not None, event.delay_seconds)
            if this != shape and run:
                assert stmt is not None
                yield stmt, run
                run = []
            next_stmt, params = self.enqueue_call(event, notify=False)
            if this != shape:
                # RETURNING makes SQLAlchemy fold the executemany into
                # multi-row INSERTs ("insertmanyvalues") on every driver.
                assert isinstance(next_stmt, sa.Insert)
                shape, stmt = this, next_stmt
                if fold:
                    stmt = next_stmt.returning(self.table.c.id)
            run.append(params)
        if run:
            assert stmt is not None
            yield stmt, run

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

    # -- ordered claims: which keys to look at -------------------------------

    def claim_columns(self, o: sa.FromClause) -> list[sa.ColumnElement[Any]]:
        """The columns a claim returns, in :meth:`to_event` order."""
        c = o.c
        return [c.id, c.event_id, c.topic, c.key, c.payload, c.headers, c.attempts, c.created_at]

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
    ) -> list[Event]:
        """Lease up to ``limit`` due pending events, oldest first, under ``token``.

        Concurrent claims on separate connections never return the same row
        and never wait for each other's locks (except on SQLite, where writers
        take turns). ``attempts`` is incremented. In ``ordered`` mode only the
        head of each key is eligible; ``block_on_dead``: a dead head still
        holds its key back.
        """

    def claim_returning(
        self,
        conn: Connection,
        stmt: sa.Executable,
        token: str,
        params: dict[str, Any] | None = None,
    ) -> list[Event]:
        """Run a claim that leases and returns its rows in one statement; oldest first.

        ``RETURNING`` / ``OUTPUT`` give rows in no particular order; the relay
        publishes in id order.
        """
        with self.transaction(conn):
            rows = conn.execute(stmt, params).all()
        return sorted((self.to_event(r, token) for r in rows), key=lambda e: e.id)

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

    # -- settle (all fenced by the claim token) ------------------------------

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
        states = [*_ACTIVE, State.DEAD] if or_dead else _ACTIVE
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
        if not ids:
            return 0
        # Built once (ids and token bound at execution): the relay marks a
        # batch every cycle, and building the statement cost more Python
        # than the database spent on it.
        stmt = self._marks.get(delete)
        if stmt is None:
            stmt = self._marks[delete] = self._mark_sent_statement(delete)
        params = {"o_ids": list(ids), "o_token": token, **self.clock_params()}
        with self.transaction(conn):
            return conn.execute(stmt, params).rowcount

    def _mark_sent_statement(self, delete: bool) -> sa.Executable:
        t = self.table
        mine = sa.and_(
            self.id_in_bound(),
            t.c.lease_owner == sa.bindparam("o_token", type_=t.c.lease_owner.type),
            in_state(t.c.state, *_ACTIVE, State.DEAD),
        )
        if delete:
            return sa.delete(t).where(mine)
        return (
            sa.update(t)
            .where(mine)
            # clock(), not now(): the statement is cached, and the application's
            # clock (SQLite) must be read at each mark, not when it was built.
            .values(state=int(State.SENT), sent_at=self.clock(), lease_owner=None, lease_until=None)
        )

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
            .where(self.owned(ids, token), in_state(t.c.state, State.LEASED))
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

    def forgive(self, conn: Connection, ids: Sequence[int]) -> int:
        """Take back the attempt of published events whose lease was lost before marking.

        Another relay re-claimed them (and counted an attempt of its own): the
        lost lease's attempt delivered, so it is no failure and must not bring
        the event closer to dead. Touches only the counter of rows still
        unsent; returns the rows changed.
        """
        if not ids:
            return 0
        t = self.table
        stmt = (
            sa.update(t)
            .where(self.id_in(ids), in_state(t.c.state, *_ACTIVE), t.c.attempts > 0)
            .values(attempts=t.c.attempts - 1)
        )
        with self.transaction(conn):
            return conn.execute(stmt).rowcount

    def extend(self, conn: Connection, ids: Sequence[int], *, token: str, lease: float) -> set[int]:
        """Renew the lease of the events among ``ids`` that ``token`` still holds.

        Returns the ids renewed: the others were reaped or re-claimed and must
        not be published by this relay. A lease that ran out but that nobody
        took yet is renewed (no other relay can have published it).
        """
        if not ids:
            return set()
        t = self.table
        held = sa.and_(self.id_in(ids), t.c.lease_owner == token, in_state(t.c.state, State.LEASED))
        with self.transaction(conn):
            renewed = conn.execute(
                sa.update(t).where(held).values(lease_until=self.after(lease))
            ).rowcount
            if renewed == len(ids):
                return set(ids)
            # Our UPDATE locked what it renewed: the same filter reads exactly those.
            return {int(i) for i in conn.execute(sa.select(t.c.id).where(held)).scalars()}

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

    # -- reading the tables: status, doctor, migrate ---------------------------

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
            ids = list(conn.execute(pick).scalars())
            # Deleted by id in chunks a statement can bind (SQL Server: 2,100 parameters).
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

    def inbox_guard(self, conn: Connection, consumer: str, event_id: str) -> None:
        """Run before :meth:`inbox_insert` in the consumer's transaction (optional hook).

        Where concurrent inserts of one key can deadlock each other (InnoDB),
        the dialect serialises them here until the transaction ends.
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
            picked = list(conn.execute(pick))
            deleted = 0
            # In chunks a statement can bind (SQL Server: 2,100 parameters; a
            # chunk binds at most two per row).
            for chunk in chunked(picked, self.max_batch):
                by_consumer: dict[str, list[str]] = {}
                for consumer, event_id in chunk:
                    by_consumer.setdefault(consumer, []).append(str(event_id))
                # One (consumer = ? AND event_id IN (...)) per consumer: it uses the
                # primary key on every database, with no row-value IN (SQL Server has none).
                match = sa.or_(
                    *(
                        sa.and_(t.c.consumer == consumer, t.c.event_id.in_(ids))
                        for consumer, ids in by_consumer.items()
                    )
                )
                deleted += conn.execute(sa.delete(t).where(match)).rowcount
            return deleted


class ReturningDialect(Dialect):
    """A dialect whose claim leases and returns its rows in one statement.

    PostgreSQL (``UPDATE ... RETURNING``), SQLite (``RETURNING`` inside
    ``BEGIN IMMEDIATE``) and SQL Server (``OUTPUT``) each build that statement
    in :meth:`claim_statement`; MySQL, without ``RETURNING``, claims in its own way.
    """

    @abstractmethod
    def claim_statement(
        self,
        *,
        limit: int,
        lease: float,
        token: str | sa.BindParameter[str],
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
        block_on_dead: bool = True,
    ) -> sa.Executable:
        """Pick up to ``limit`` rows (skipping rows other claims hold), lease and return them."""

    def claim(
        self,
        conn: Connection,
        *,
        limit: int,
        lease: float,
        token: str,
        ordered: bool,
        block_on_dead: bool = True,
    ) -> list[Event]:
        """Lease up to ``limit`` rows in one statement (after the key walk in ordered mode).

        The unordered statement is built once per batch size and lease, its
        token a bound parameter: building it (and its cache key) anew for
        every claim cost as much Python as decoding a tenth of its rows.
        """
        if not ordered and not self.app_clock:
            stmt = self._claims.get((limit, lease))
            if stmt is None:
                token_param = sa.bindparam("o_token", type_=self.table.c.lease_owner.type)
                stmt = self.claim_statement(
                    limit=limit, lease=lease, token=token_param, ordered=False
                )
                self._claims[limit, lease] = stmt
            return self.claim_returning(conn, stmt, token, {"o_token": token})
        with self.transaction(conn):
            window = (
                self.key_window(conn, limit=limit, run_length=1, block_on_dead=block_on_dead)
                if ordered
                else None
            )
            if ordered and window is None:
                return []
            stmt = self.claim_statement(
                limit=limit,
                lease=lease,
                token=token,
                ordered=ordered,
                window=window,
                block_on_dead=block_on_dead,
            )
            return self.claim_returning(conn, stmt, token)
