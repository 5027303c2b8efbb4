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
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.dml import Insert

from outbox_core.errors import PayloadError, UnknownDialect
from outbox_core.message import Event, Failure, NewEvent, State, find_in_json
from outbox_core.schema import OutboxTables

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from outbox_core.doctor import Check, Finding

#: Longest error text kept in ``last_error``.
MAX_ERROR = 2000

_ACTIVE = (State.PENDING, State.LEASED)

#: Most keys one walk of an ordered claim visits (it visits twice the batch,
#: up to this): bounds the walk's work per claim however many keys there are.
MAX_KEYS_PER_CLAIM = 500
#: Run end of a key with fewer pending rows than the run length: no end.
NO_END = 2**62
#: Most walks over keys one ordered claim makes when every key it meets is blocked.
MAX_WALKS = 8


class Listener(Protocol):
    """Waits for wake-ups sent by producers' commits."""

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True when a wake-up arrived."""

    def close(self) -> None:
        """Stop listening and drop the connection."""


@dataclass(frozen=True)
class ServerInfo:
    """What a server says it is (``outbox doctor``, the compatibility matrix)."""

    #: ``PostgreSQL``, ``MariaDB``, ``MySQL``, ``SQL Server 2022``, ``SQLite``.
    product: str
    #: Its version, e.g. ``15.20`` or ``10.11.19``.
    version: str
    #: The server's own full description (``SELECT version()`` and the like).
    full: str

    @property
    def label(self) -> str:
        """``product version``: a matrix column, a doctor finding."""
        return f"{self.product} {self.version}"


def version_prefix(text: str) -> str:
    """The leading dotted number of a version (``10.11.19-MariaDB-0+deb12u1``: ``10.11.19``)."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    return match.group(1) if match else text.strip().split(" ")[0]


@dataclass(frozen=True)
class Activity:
    """The table's recent traffic, from :meth:`Dialect.activity` (times: the database's)."""

    oldest_pending_created: datetime | None
    now: datetime
    created_last_minute: int
    sent_last_minute: int
    last_sent_at: datetime | None


@dataclass(frozen=True)
class Backlog:
    """What waits for a relay, from :meth:`Dialect.backlog`."""

    pending: int
    due: int
    oldest_due: datetime | None
    expired_leases: int
    now: datetime


@dataclass(frozen=True)
class LiveLeases:
    """Leases still running, from :meth:`Dialect.live_leases`."""

    count: int
    until: datetime | None
    tokens: list[str]


@dataclass(frozen=True)
class SessionLimits:
    """Server-side bounds for a relay connection, derived from the relay's lease.

    ``idle_in_transaction``: a transaction left idle this long is rolled back
    by the server (its row locks go with it). ``lock_wait``: the longest a
    statement waits for another session's row lock before failing.
    """

    idle_in_transaction: float
    lock_wait: float

    @classmethod
    def for_lease(cls, lease: float) -> SessionLimits:
        """About one lease for a frozen transaction; a quarter of it (0.5-5 s) for lock waits.

        Relays never wait on each other's locks on purpose (SKIP LOCKED), so
        a lock wait means a stuck session: fail fast and let the lease decide.
        """
        return cls(idle_in_transaction=max(lease, 1.0), lock_wait=min(max(lease / 4, 0.5), 5.0))


class Dialect(ABC):
    """Strategy for claiming, settling and cleaning outbox rows on one database family."""

    #: Registry name: "postgresql", "mysql", "mssql" or "sqlite".
    name: ClassVar[str]
    #: The family's name for people: "PostgreSQL", "MySQL/MariaDB", "SQL Server", "SQLite".
    family: ClassVar[str]
    #: True when concurrent claims skip each other's locked rows instead of
    #: waiting (SKIP LOCKED / READPAST). SQLite serialises writers instead.
    row_locks: ClassVar[bool] = True
    #: Ordered claims find keys with ``GROUP BY`` (MySQL runs it as a loose
    #: index scan; SQL Server's recursive CTEs allow no subqueries) instead of
    #: a recursive CTE.
    group_key_scan: ClassVar[bool] = False
    #: The clock is the application's (``now()`` is a bound value, not SQL):
    #: a prepared enqueue binds it per call.
    app_clock: ClassVar[bool] = False
    #: Largest claim batch the dialect accepts.
    max_batch: ClassVar[int] = 10_000

    def __init__(self, tables: OutboxTables, *, block_on_dead: bool = True) -> None:
        self.tables = tables
        self.table = tables.outbox
        self.block_on_dead = block_on_dead
        # Ordered claims visit keys round-robin from here (see key_window); a
        # hint shared by the relays of this process, so races are harmless.
        self._key_cursor: str | None = None
        self._scans: dict[tuple[bool, int, int, int], sa.CompoundSelect[Any]] = {}
        self._prepared: dict[tuple[bool, bool], sa.Executable] = {}

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

    def limit_session(self, conn: Connection, limits: SessionLimits) -> None:  # noqa: B027
        """Put server-side limits on a relay's connection (DESIGN.md section 1a).

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

    def install(self, conn: Connection) -> None:
        """Create the tables (idempotent) and apply database settings the outbox needs."""
        with self.transaction(conn):
            self.tables.create_all(conn)

    # -- what this database can store (enqueue and migrate) ------------------

    #: ``enqueue`` binds payload and headers as the JSON text it already
    #: serialised (UTF-8) instead of letting the driver serialise them again
    #: (as ASCII with ``\\uXXXX`` escapes: three times the size for non-Latin text).
    json_as_text: ClassVar[bool] = False

    def text_problem(self, name: str, value: str) -> str | None:
        """Why this database cannot store the text ``value`` of ``name``, or None.

        Every database: a lone surrogate is not Unicode. Dialects add their own
        rules (PostgreSQL: no NUL).
        """
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{name} contains a lone surrogate (not valid Unicode)"
        return None

    def json_suspect(self, text: str) -> bool:
        """Fast pre-check of serialised JSON: might :meth:`text_problem` refuse part of it?"""
        return False

    def json_problem(self, name: str, value: Any) -> str | None:
        """The first string (or key) of a JSON value this database cannot store, named."""
        return find_in_json(value, name, self.text_problem)

    # -- what a table of this database can store (``outbox migrate``) --------

    #: Declared text lengths are limits (SQLite keeps any length it is given).
    enforces_lengths: ClassVar[bool] = True
    #: JSON columns are parsed by the database, which can refuse parts of them
    #: (elsewhere JSON is stored as the text it is).
    parses_json: ClassVar[bool] = False

    def text_storage(
        self, inspector: sa.Inspector, table: sa.Table, column_type: Any
    ) -> tuple[int | None, str | None]:
        """``(byte limit, codec)`` a reflected text column imposes beyond its length.

        The codec (a Python codec name, or ``bmp``: no character beyond
        U+FFFF) is set where the column's character set is narrower than
        Unicode. None, None: nothing beyond the length.
        """
        return None, None

    def text_length(self, value: str) -> int:
        """How this database counts the length of ``value`` against a column's length."""
        return len(value)

    def time_problem(self, name: str, value: datetime) -> str | None:
        """Why a timestamp column cannot hold ``value``, or None."""
        return None

    def time_digits(self, column_type: Any) -> int:
        """Fractional second digits a reflected timestamp column keeps."""
        precision = getattr(column_type, "precision", None)
        return 6 if precision is None else min(int(precision), 6)

    def bind_time(self, value: datetime | None) -> datetime | None:
        """A naive UTC timestamp as this database's timestamp columns take it."""
        return value

    def json_text(self, column: sa.ColumnElement[Any]) -> sa.ColumnElement[str]:
        """A JSON column read as the exact text the database holds (no decoding)."""
        return sa.type_coerce(column, sa.UnicodeText)

    def initialize(self, conn: Connection) -> None:
        """Set the capability flags that depend on the server, once, from ``conn``.

        Called before the first enqueue, by each relay connection before its
        session limits, and by migrate on its target. The class flags are
        what a family can do; this refines them for the server at hand
        (MySQL: MariaDB or not, ``max_allowed_packet``). The default reads nothing.
        """
        self.initialized = True

    #: :meth:`initialize` ran (it reads the server at most once).
    initialized: bool = False

    def size_problem(self, event: NewEvent) -> str | None:
        """Why ``event`` is too large for this server, or None (see :meth:`initialize`)."""
        return None

    def check_event(self, event: NewEvent) -> None:
        """Raise :class:`PayloadError` when this database cannot store ``event``.

        Runs in ``enqueue`` before anything is written, so the caller's
        transaction stays usable (a refused statement aborts a PostgreSQL
        transaction).
        """
        for name, text in (("topic", event.topic), ("key", event.key)):
            problem = self.text_problem(name, text) if text is not None else None
            if problem:
                raise PayloadError(problem)
        for name, value, serialised in (
            ("payload", event.payload, event.payload_json),
            ("headers", event.headers, event.headers_json),
        ):
            if serialised and self.json_suspect(serialised):
                problem = self.json_problem(name, value)
                if problem:
                    raise PayloadError(problem)
        problem = self.size_problem(event)
        if problem:
            raise PayloadError(problem)

    # -- enqueue --------------------------------------------------------------

    def with_wake_up(self, insert: Insert, *, notify: bool) -> sa.Executable:
        """Fold the wake-up into an enqueue ``INSERT`` where the database has one (PostgreSQL)."""
        return insert

    def prepared_insert(self, *, headers: bool, delay: float = 0.0) -> Insert:
        """The enqueue ``INSERT``, its event's values as bound parameters.

        Parameters are named ``o_<column>`` (see :meth:`enqueue_call`). Without
        ``headers`` the column is NULL. A ``delay`` goes into the statement
        (``available_at`` from the database clock).
        """
        t = self.table
        now = self.clock()
        json_type = sa.UnicodeText() if self.json_as_text else t.c.payload.type
        # inline(): no implicit RETURNING id, which enqueue never reads.
        return (
            sa.insert(t)
            .inline()
            .values(
                event_id=sa.bindparam("o_event_id", type_=t.c.event_id.type),
                topic=sa.bindparam("o_topic", type_=t.c.topic.type),
                key=sa.bindparam("o_key", type_=t.c.key.type),
                payload=sa.bindparam("o_payload", type_=json_type),
                headers=sa.bindparam("o_headers", type_=json_type) if headers else None,
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
        blocking = [State.PENDING, State.LEASED] + ([State.DEAD] if self.block_on_dead else [])
        # One EXISTS per state: each is a single range of (state, key, id); with
        # state IN (...) MariaDB uses only the index's first column.
        earlier = [
            sa.exists().where(p.c.state == int(s), p.c.key == o.c.key, p.c.id < o.c.id)
            for s in blocking
        ]
        return sa.or_(o.c.key.is_(None), ~sa.or_(*earlier))

    def claim_filter(
        self,
        o: sa.FromClause,
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
    ) -> list[sa.ColumnElement[bool]]:
        """All WHERE terms of a claim; ``window`` comes from :meth:`key_window`."""
        terms = self.claimable(o)
        if ordered:
            terms.append(self.head_of_key(o))
        if window is not None:
            terms.append(window)
        return terms

    # -- ordered claims: which keys to look at -------------------------------

    def run_end(self, key: sa.ColumnElement[Any], run_length: int) -> sa.ScalarSelect[Any]:
        """The id of ``key``'s ``run_length``-th pending row (NULL when it has fewer)."""
        q = self.table.alias("q")
        return (
            sa.select(q.c.id)
            .where(q.c.state == int(State.PENDING), q.c.key == key)
            .order_by(q.c.id)
            .offset(run_length - 1)
            .limit(1)
            .scalar_subquery()
        )

    def key_scan(self, *, after: str | None, count: int, run_length: int) -> sa.Select[Any]:
        """Up to ``count`` keys with pending rows after ``after``: ``(key, head, run_end)``.

        ``head`` is the key's first pending row, ``run_end`` its
        ``run_length``-th (NULL when it has fewer). A loose index scan over
        ``(state, key, id)``: a recursive CTE steps from one key to the next
        with one index probe each, so the cost follows the number of keys
        visited, not the depth of their backlogs. Where
        :attr:`group_key_scan` is set, ``GROUP BY state, key`` instead.
        """
        t = self.table
        p = t.alias("p")
        if self.group_key_scan:
            after_term = (
                p.c.key.is_not(None)
                if after is None
                else p.c.key > sa.bindparam("after", after, type_=t.c.key.type)
            )
            # GROUP BY state, key (not just key) with MIN(id): MySQL and MariaDB
            # run it as a loose index scan ("Using index for group-by").
            g = (
                sa.select(p.c.key, sa.func.min(p.c.id).label("head"))
                .where(p.c.state == int(State.PENDING), after_term)
                .group_by(p.c.state, p.c.key)
                .order_by(p.c.state, p.c.key)
                .limit(count)
                .subquery("g")
            )
            end = g.c.head if run_length == 1 else self.run_end(g.c.key, run_length)
            return sa.select(g.c.key, g.c.head, end.label("run_end"))

        def next_key(prev: sa.ColumnElement[Any] | None) -> sa.ScalarSelect[Any]:
            q = sa.select(p.c.key).where(p.c.state == int(State.PENDING))
            q = q.where(p.c.key.is_not(None) if prev is None else p.c.key > prev)
            return q.order_by(p.c.key).limit(1).scalar_subquery()

        start = sa.bindparam("after", after, type_=t.c.key.type) if after is not None else None
        walk = sa.select(next_key(start).label("key"), sa.literal(1).label("n")).cte(
            "key_walk", recursive=True
        )
        walk = walk.union_all(
            sa.select(next_key(walk.c.key), walk.c.n + 1).where(
                walk.c.key.is_not(None), walk.c.n < count
            )
        )
        head = self.run_end(walk.c.key, 1)
        end = head if run_length == 1 else self.run_end(walk.c.key, run_length)
        return sa.select(walk.c.key, head.label("head"), end.label("run_end")).where(
            walk.c.key.is_not(None)
        )

    def run_rows(
        self, keys: sa.CTE, run_length: int
    ) -> tuple[sa.FromClause, sa.ColumnElement[int]]:
        """The pending rows of each visited key from its head to its run's end: (FROM, id column).

        A join on ``id <= run_end``; PostgreSQL overrides it with a ``LATERAL
        ... LIMIT`` that its planner cannot turn into a hash join over the
        keys' whole backlogs.
        """
        r = self.table.alias("r")
        end = sa.func.coalesce(keys.c.run_end, sa.literal(NO_END, sa.BigInteger()))
        on = sa.and_(
            r.c.state == int(State.PENDING),
            r.c.key == keys.c.key,
            r.c.id >= keys.c.head,
            r.c.id <= end,
        )
        return keys.join(r, on), r.c.id

    def run_scan(
        self, *, after: str | None, count: int, run_length: int, limit: int
    ) -> sa.CompoundSelect[Any]:
        """The first ``limit`` ids, in id order, of the runs of the keys :meth:`key_scan` visits.

        Keys with nothing to claim are left out: their first pending row is
        not due yet, or has an earlier leased (or, with ``block_on_dead``,
        dead) row. Rows ``(id, NULL, NULL)``, then one row ``(NULL, last key
        visited, keys visited)``: the cursor for the next claim.
        """
        t = self.table
        keys = self.key_scan(after=after, count=count, run_length=run_length).cte("visited")
        b = t.alias("b")
        blocking = [State.LEASED] + ([State.DEAD] if self.block_on_dead else [])
        blocked = sa.or_(
            *(
                sa.exists().where(b.c.state == int(s), b.c.key == keys.c.key, b.c.id < keys.c.head)
                for s in blocking
            ),
            sa.exists().where(b.c.id == keys.c.head, b.c.available_at > self.clock()),
        )
        if run_length == 1:
            source: sa.FromClause = keys
            ids: sa.ColumnElement[int] = keys.c.head
        else:
            source, ids = self.run_rows(keys, run_length)
        picked = (
            sa.select(ids.label("id"))
            .select_from(source)
            .where(~blocked)
            .order_by(ids)
            .limit(limit)
            .subquery("picked")
        )
        # Bare NULLs: every database types them from the other branch (a CAST
        # would bring the connection's collation into MySQL's UNION).
        return sa.union_all(
            sa.select(picked.c.id, sa.null().label("last_key"), sa.null().label("visited")),
            sa.select(sa.null(), sa.func.max(keys.c.key), sa.func.count()).select_from(keys),
        )

    def clock(self) -> sa.ColumnElement[datetime]:
        """:meth:`now` for statements built once and run many times.

        The application's clock (SQLite) is a bound parameter, ``o_now``,
        passed at each execution (see :meth:`clock_params`).
        """
        return sa.bindparam("o_now", type_=sa.DateTime()) if self.app_clock else self.now()

    def clock_params(self) -> dict[str, Any]:
        """The parameters :meth:`clock` needs at execution."""
        return {"o_now": self.utcnow()} if self.app_clock else {}

    def key_window(
        self, conn: Connection, *, limit: int, run_length: int
    ) -> sa.ColumnElement[bool] | None:
        """Ordered claims: ``id IN (...)`` over the first ``run_length`` pending rows of some keys.

        Without it the head-of-key check runs once per pending row, so a claim
        over a deep backlog of few keys reads the whole backlog. The keys are
        visited round-robin from a cursor kept between claims,
        :data:`MAX_KEYS_PER_CLAIM` at most per walk, so no key waits behind
        the others however many there are; when every key of a walk is
        blocked the next walk follows at once (up to :data:`MAX_WALKS`).
        These are plain reads: the claim's own checks decide. Due rows
        without a key come in up to ``limit``, locked here (SKIP LOCKED) so
        concurrent relays take different ones. Returns None when nothing is
        claimable.
        """
        t = self.table
        # Twice the batch: keys whose head is in flight elsewhere yield nothing.
        count = min(2 * limit, MAX_KEYS_PER_CLAIM)
        after = self._key_cursor
        wrapped = after is None
        ids: list[int] = []
        for _ in range(MAX_WALKS):
            found, last, visited = self._scan_runs(conn, after, count, run_length, limit)
            ids += found
            if visited < count:  # past the last key
                after = None
                if wrapped:
                    break
                wrapped = True  # go round from the first key
                if found:
                    break
                continue
            after = last
            if found:
                break
        self._key_cursor = after
        unkeyed = self.lock_rows(
            sa.select(t.c.id)
            .where(*self.claimable(t), t.c.key.is_(None))
            .order_by(t.c.id)
            .limit(limit)
        )
        ids += [int(i) for i in conn.execute(unkeyed).scalars()]
        if not ids:
            return None
        return self.id_in(sorted(set(ids))[:limit])

    def _scan_runs(
        self, conn: Connection, after: str | None, count: int, run_length: int, limit: int
    ) -> tuple[list[int], str | None, int]:
        # Built once per shape (building costs more than running it); the
        # cursor and the application's clock are bound parameters.
        shape = (after is None, count, run_length, limit)
        stmt = self._scans.get(shape)
        if stmt is None:
            stmt = self.run_scan(after=after, count=count, run_length=run_length, limit=limit)
            self._scans[shape] = stmt
        ids: list[int] = []
        last: str | None = None
        visited = 0
        params = self.clock_params()
        if after is not None:
            params["after"] = after
        for row_id, last_key, seen in conn.execute(stmt, params):
            if row_id is not None:
                ids.append(int(row_id))
            else:
                last, visited = last_key, int(seen or 0)
        return ids, last, visited

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

        In one transaction:

        1. :meth:`key_window` picks the keys to look at and their runs' ends;
        2. lock candidates among them (pending, due, no earlier leased, dead
           or not-yet-due row of their key), skipping rows other claims hold;
        3. a plain read of the keys' unsent rows: a key's locked rows count
           only as far as they are the key's first unsent rows, and at most
           ``run_length`` of them. A row skipped because another claim holds
           it ends the run there;
        4. lease what remains. The dropped rows' locks go at commit.
        """
        t = self.table
        p = t.alias("p")
        blocked = [State.LEASED] + ([State.DEAD] if self.block_on_dead else [])
        # One EXISTS per state, as in head_of_key: a single index range each.
        earlier_blocked = sa.or_(
            *(
                sa.exists().where(p.c.state == int(s), p.c.key == t.c.key, p.c.id < t.c.id)
                for s in blocked
            ),
            sa.exists().where(
                p.c.state == int(State.PENDING),
                p.c.key == t.c.key,
                p.c.id < t.c.id,
                p.c.available_at > self.now(),
            ),
        )
        with self.transaction(conn):
            window = self.key_window(conn, limit=limit, run_length=run_length)
            if window is None:
                return []
            candidates = self.lock_rows(
                sa.select(*self.claim_columns(t))
                .where(*self.claimable(t), window, sa.or_(t.c.key.is_(None), ~earlier_blocked))
                .order_by(t.c.id)
                .limit(limit)
            )
            rows = conn.execute(candidates).all()
            valid = self.run_prefixes(conn, rows)
            runs: dict[str, int] = {}
            for r in rows:
                if r[3] is not None and int(r[0]) in valid:
                    runs[r[3]] = runs.get(r[3], 0) + 1
                    if runs[r[3]] > run_length:  # rows reaped back since the window was read
                        valid.discard(int(r[0]))
            if not valid:
                return []
            conn.execute(
                sa.update(t)
                .where(self.id_in(sorted(valid)), t.c.state == int(State.PENDING))
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
        # One bound for all keys keeps the read a plain range scan everywhere
        # (an OR of per-key ranges makes MariaDB scan the table).
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

    def id_in(self, ids: Sequence[int]) -> sa.ColumnElement[bool]:
        """``id IN (...)``; PostgreSQL overrides it with one array parameter."""
        return self.table.c.id.in_(list(ids))

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
            t.c.state.in_([int(s) for s in states]),
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
        t = self.table
        mine = self.owned(ids, token, or_dead=True)
        stmt: sa.Delete | sa.Update
        if delete:
            stmt = sa.delete(t).where(mine)
        else:
            stmt = (
                sa.update(t)
                .where(mine)
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
            .where(self.id_in(ids), t.c.state.in_([int(s) for s in _ACTIVE]), t.c.attempts > 0)
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
        held = sa.and_(self.id_in(ids), t.c.lease_owner == token, t.c.state == int(State.LEASED))
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
        expired = sa.and_(t.c.state == int(State.LEASED), t.c.lease_until < self.now())
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

    def state_counts(self, conn: Connection) -> dict[str, int]:
        """Rows per state, by lower-case state name (every state, 0 when none)."""
        t = self.table
        counts = {s.name.lower(): 0 for s in State}
        for state, n in conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state)):
            counts[State(state).name.lower()] = int(n)
        return counts

    def activity(self, conn: Connection) -> Activity:
        """The oldest pending event, the last minute's traffic, the last send (status)."""
        t = self.table
        minute_ago = self.after(-60)
        row = conn.execute(
            sa.select(
                sa.select(sa.func.min(t.c.created_at))
                .where(t.c.state == int(State.PENDING))
                .scalar_subquery(),
                self.now(),
                sa.select(sa.func.count()).where(t.c.created_at >= minute_ago).scalar_subquery(),
                sa.select(sa.func.count()).where(t.c.sent_at >= minute_ago).scalar_subquery(),
                sa.select(sa.func.max(t.c.sent_at))
                .where(t.c.state == int(State.SENT))
                .scalar_subquery(),
            )
        ).one()
        return Activity(row[0], row[1], int(row[2] or 0), int(row[3] or 0), row[4])

    def backlog(self, conn: Connection) -> Backlog:
        """Pending and due events, the oldest due, expired leases (``outbox doctor``)."""
        t = self.table
        now = self.now()
        pending = t.c.state == int(State.PENDING)
        due = sa.and_(pending, t.c.available_at <= now)
        row = conn.execute(
            sa.select(
                sa.select(sa.func.count()).select_from(t).where(pending).scalar_subquery(),
                sa.select(sa.func.count()).select_from(t).where(due).scalar_subquery(),
                sa.select(sa.func.min(t.c.available_at)).where(due).scalar_subquery(),
                sa.select(sa.func.count())
                .select_from(t)
                .where(t.c.state == int(State.LEASED), t.c.lease_until < now)
                .scalar_subquery(),
                now,
            )
        ).one()
        return Backlog(int(row[0]), int(row[1]), row[2], int(row[3]), row[4])

    def dead_by_topic(self, conn: Connection) -> list[tuple[str, int, str | None]]:
        """``(topic, dead events, the newest one's error)``, most dead first."""
        t = self.table
        per_topic = (
            sa.select(t.c.topic, sa.func.count().label("n"), sa.func.max(t.c.id).label("last"))
            .where(t.c.state == int(State.DEAD))
            .group_by(t.c.topic)
            .subquery()
        )
        rows = conn.execute(
            sa.select(per_topic.c.topic, per_topic.c.n, t.c.last_error)
            .join_from(per_topic, t, t.c.id == per_topic.c.last)
            .order_by(per_topic.c.n.desc(), per_topic.c.topic)
        ).all()
        return [(str(topic), int(n), error) for topic, n, error in rows]

    def count_in_states(self, conn: Connection, states: Sequence[int]) -> int:
        """Rows in any of ``states``."""
        t = self.table
        query = sa.select(sa.func.count()).select_from(t).where(t.c.state.in_(list(states)))
        return int(conn.execute(query).scalar_one())

    def page(
        self,
        conn: Connection,
        columns: Sequence[sa.ColumnElement[Any]],
        states: Sequence[int],
        *,
        after_id: int | None,
        limit: int,
    ) -> list[Sequence[Any]]:
        """The next ``limit`` rows in ``states`` after ``after_id``, in id order (migrate)."""
        t = self.table
        query = sa.select(*columns).where(t.c.state.in_(list(states)))
        if after_id is not None:
            query = query.where(t.c.id > after_id)
        return list(conn.execute(query.order_by(t.c.id).limit(limit)).all())

    def by_event_id(
        self, conn: Connection, columns: Sequence[sa.ColumnElement[Any]], event_ids: Sequence[str]
    ) -> list[Sequence[Any]]:
        """``columns`` of the rows whose ``event_id`` is among ``event_ids`` (any order)."""
        t = self.table
        query = sa.select(*columns).where(t.c.event_id.in_(list(event_ids)))
        return list(conn.execute(query).all())

    def live_leases(self, conn: Connection, *, owners: int = 20) -> LiveLeases:
        """Leases not yet expired: how many, until when, and some of their tokens."""
        t = self.table
        live = sa.and_(t.c.state == int(State.LEASED), t.c.lease_until > self.now())
        count, until = conn.execute(
            sa.select(sa.func.count(), sa.func.max(t.c.lease_until)).where(live)
        ).one()
        tokens = conn.execute(
            sa.select(t.c.lease_owner).where(live).distinct().limit(owners)
        ).scalars()
        return LiveLeases(int(count), until, [str(o) for o in tokens if o])

    def insert_rows(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert whole rows (migrate), as one executemany."""
        # One executemany: multi-row INSERTs on PyMySQL, a pipeline on psycopg
        # (measured faster than SQLAlchemy's multi-row VALUES there).
        conn.execute(sa.insert(self.table), list(rows))

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
        # Rows another session holds are skipped, not waited for (a frozen
        # relay must not stall the others' maintenance).
        pick = self.lock_rows(sa.select(t.c.id).where(old_sent).order_by(t.c.id).limit(batch))
        with self.transaction(conn):
            ids = list(conn.execute(pick).scalars())
            if not ids:
                return 0
            stmt = sa.delete(t).where(self.id_in(ids), t.c.state == int(State.SENT))
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

    def inbox_guard(self, conn: Connection, consumer: str, event_id: str) -> None:  # noqa: B027
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


def delete_in_batches(
    delete_batch: Callable[[int], int], *, batch: int, max_batches: int | None = None
) -> int:
    """Run ``delete_batch(batch)`` (one short transaction each) until little is left.

    Stops when a call deletes fewer than ``batch`` rows or after
    ``max_batches`` calls; returns the rows deleted. Bounded batches keep
    every transaction short (no lock escalation, no long-held locks), so
    relays and producers never wait behind a large delete.
    """
    total = done = 0
    while max_batches is None or done < max_batches:
        deleted = delete_batch(batch)
        total += deleted
        done += 1
        if deleted < batch:
            break
    return total


# -- registry ------------------------------------------------------------------

#: Backend name -> "module:Class", imported only when asked for, so a user
#: with one driver installed never needs the others.
REGISTRY: dict[str, str] = {
    "postgresql": "outbox_core.dialects.postgresql:PostgresqlDialect",
    "mysql": "outbox_core.dialects.mysql:MysqlDialect",
    "mariadb": "outbox_core.dialects.mysql:MysqlDialect",
    "mssql": "outbox_core.dialects.mssql:MssqlDialect",
    "sqlite": "outbox_core.dialects.sqlite:SqliteDialect",
}


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
        token: str,
        ordered: bool,
        window: sa.ColumnElement[bool] | None = None,
    ) -> sa.Executable:
        """Pick up to ``limit`` rows (skipping rows other claims hold), lease and return them."""

    def claim(
        self, conn: Connection, *, limit: int, lease: float, token: str, ordered: bool
    ) -> list[Event]:
        """Lease up to ``limit`` rows in one statement (after the key walk in ordered mode)."""
        with self.transaction(conn):
            window = self.key_window(conn, limit=limit, run_length=1) if ordered else None
            if ordered and window is None:
                return []
            stmt = self.claim_statement(
                limit=limit, lease=lease, token=token, ordered=ordered, window=window
            )
            return self.claim_returning(conn, stmt, token)


def dialect_families() -> list[str]:
    """One registry name per dialect class (``mariadb`` is ``mysql``'s alias)."""
    seen: dict[str, str] = {}
    for name, target in REGISTRY.items():
        seen.setdefault(target, name)
    return list(seen.values())


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
