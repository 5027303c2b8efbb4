"""The ``Outbox`` facade: one object per outbox table, whatever the database.

>>> outbox = Outbox("postgresql+psycopg://localhost/app")
>>> outbox.install()
>>> with engine.begin() as conn:
...     conn.execute(orders.insert().values(id=1))
...     outbox.enqueue(conn, "order.created", {"order_id": 1}, key="order-1")
>>> outbox.relay("memory://").run()
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.orm import Session

from outbox_core.brokers.base import Broker, create_broker
from outbox_core.columns import ColumnMap
from outbox_core.config import DEFAULT_MAX_PAYLOAD, Settings
from outbox_core.dialects.base import Dialect, delete_in_batches, get_dialect
from outbox_core.dialects.base.presence import PresenceRow
from outbox_core.dialects.base.values import aware
from outbox_core.enqueue import Producer
from outbox_core.errors import ConfigurationError, TableMissing, translate_errors
from outbox_core.jsoncheck import JsonDefault
from outbox_core.message import NewEvent
from outbox_core.partitions import parse
from outbox_core.ports import async_transaction_port, transaction_port
from outbox_core.redaction import mask_url
from outbox_core.relay import Relay
from outbox_core.retry import RetryPolicy
from outbox_core.schema import OutboxTables
from outbox_core.urls import missing_driver_error, sync_url

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

T = TypeVar("T")


@dataclass(frozen=True)
class DeadTopic:
    """Dead events of one topic, with the newest error."""

    topic: str
    count: int
    last_error: str | None


@dataclass(frozen=True)
class RelayShare:
    """An ordered relay in the membership table (``outbox status``)."""

    relay_id: str
    host: str
    #: Its partitions, as ranges (``0-127``), and how many.
    partitions: str
    count: int
    heartbeat_age: float
    #: The number of the split it holds.
    epoch: int


@dataclass
class Status:
    """A snapshot of the outbox table (``outbox status``)."""

    counts: dict[str, int]
    oldest_pending_age: float | None
    dead: list[DeadTopic] = field(default_factory=list)
    #: Events created / sent in the last 60 seconds (sent: not counted with delete-on-send).
    created_last_minute: int = 0
    sent_last_minute: int = 0
    #: Seconds since the newest ``sent_at`` (None: nothing sent, or delete-on-send).
    last_sent_age: float | None = None
    #: ``outbox status --broker``: ``{"url", "up", "error"}`` from a probe of the broker.
    broker: dict[str, Any] | None = None
    #: Ordered relays by key partitions: each one's share and heartbeat age.
    relays: list[RelayShare] = field(default_factory=list)
    #: Every running relay, whatever its mode (the presence table): newest first.
    fleet: list[PresenceRow] = field(default_factory=list)
    #: ``--source wal``: the slot, its lag and its relay's report (``SlotStatus`` as a dict).
    log_tailing: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


class Outbox:
    """The outbox on one table of one database.

    ``db`` is a URL (``postgresql+psycopg://...``, ``mysql+pymysql://...``,
    ``mssql+pyodbc://...``, ``sqlite:///file.db``; async URLs are accepted and
    mapped to their sync driver for the relay) or an existing ``Engine``.
    The dialect comes from the URL's backend; ``dialect=`` overrides it.
    ``columns`` relays a table of the team's own layout as it is
    (``"event_id=id,key=aggregate_id,topic=event_type"``: see
    :class:`~outbox_core.columns.ColumnMap`).
    ``json_default`` converts payload values JSON has no type for (``Decimal``,
    ``datetime``, ``UUID``, dataclasses, pydantic models: see
    :func:`outbox_core.encoding.encode_value`); every check applies to the result.
    ``max_payload_bytes`` bounds a payload with its headers as UTF-8 JSON (16
    MiB by default; None: no bound of the outbox's own). ``portable_topics``
    (on by default) refuses a topic that is not words of ASCII letters,
    digits, ``_`` and ``-`` joined by dots, the grammar every broker routes
    alike.
    """

    def __init__(
        self,
        db: str | URL | Engine | AsyncEngine,
        *,
        table: str = "outbox",
        schema: str | None = None,
        columns: ColumnMap | str | Mapping[str, str] | None = None,
        dialect: str | None = None,
        block_on_dead: bool = True,
        notify: bool = True,
        engine_options: Mapping[str, Any] | None = None,
        json_default: JsonDefault | None = None,
        max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD,
        portable_topics: bool = True,
    ) -> None:
        self.tables = OutboxTables.create(table, schema, columns=columns)
        #: The outbox's one set of settings: its relays run with them unless
        #: given their own. ``notify`` (PostgreSQL: ``enqueue`` sends NOTIFY in the
        #: caller's transaction, relays LISTEN) can be turned off under very heavy
        #: write load (NOTIFY takes a global lock at commit).
        self.settings = Settings(
            table=table,
            schema=schema,
            columns=None if self.tables.columns.is_default else self.tables.columns,
            block_on_dead=block_on_dead,
            notify=notify,
            max_payload_bytes=max_payload_bytes,
            portable_topics=portable_topics,
        )
        self._engine: Engine | None = None
        self._owns_engine = False
        self._engine_options = dict(engine_options or {})
        if isinstance(db, Engine):
            self._engine = db
            self.url = db.url
        elif isinstance(db, str | URL):
            self.url = sync_url(db)
        elif hasattr(db, "sync_engine"):  # AsyncEngine: the relay needs a sync driver
            self.url = sync_url(db.url)
        else:
            raise ConfigurationError(
                f"Outbox needs a database URL or an Engine, not {type(db).__name__}"
            )
        backend = dialect or self.url.get_backend_name()
        self.dialect: Dialect = get_dialect(backend)(self.tables)
        self.producer = Producer(
            self.dialect,
            fallback=lambda: self.engine.connect(),
            json_default=json_default,
            max_payload_bytes=self.settings.max_payload_bytes,
            portable_topics=portable_topics,
        )

    @property
    def notify(self) -> bool:
        """``enqueue`` wakes relays with NOTIFY where the database has it (the setting)."""
        return self.settings.notify

    def __repr__(self) -> str:
        url = mask_url(self.url)
        return f"Outbox({url!r}, table={self.table.name!r})"

    @property
    def table(self) -> sa.Table:
        """The outbox table."""
        return self.tables.outbox

    @property
    def engine(self) -> Engine:
        """The engine for installs, status and relays (created from the URL on first use)."""
        if self._engine is None:
            options: dict[str, Any] = {"pool_pre_ping": True}
            options.update(self.dialect.session.engine_options())
            options.update(self._engine_options)
            try:
                self._engine = sa.create_engine(self.url, **options)
            except ImportError as exc:
                raise missing_driver_error(self.url, exc) from exc
            self._owns_engine = True
        return self._engine

    def dispose(self) -> None:
        """Close the connections of an engine this outbox created."""
        if self._engine is not None and self._owns_engine:
            self._engine.dispose()
            self._engine = None

    # -- setup --------------------------------------------------------------------------

    def check(self, *, ordered: bool = False, partitioned: bool = False) -> None:
        """Verify the server supports the outbox (and ordered claims) and the tables exist.

        ``partitioned``: ordered relays by key partitions also need the
        membership table. Raises ``UnsupportedDatabase`` naming the version
        or setting needed, or :class:`TableMissing` with the ``outbox
        install`` command that creates what is missing.
        """
        needed = [self.table] + ([self.tables.relays] if partitioned else [])
        with translate_errors("check"), self.engine.connect() as conn:
            self.dialect.check(conn)
            if ordered:
                self.dialect.check_ordered(conn)
            inspector = sa.inspect(conn)
            missing = [t for t in needed if not inspector.has_table(t.name, schema=t.schema)]
        if missing:
            url = mask_url(self.url)
            schema = f" --schema {self.table.schema}" if self.table.schema else ""
            what = " and ".join(repr(t.fullname) for t in missing)
            raise TableMissing(
                f"table {what} not found on {url}: run "
                f"`outbox install --db {url} --table {self.table.name}{schema}` first"
                + (
                    " (it adds what an earlier version lacks)"
                    if missing[0] is not self.table
                    else ""
                )
            )

    def install(self, *, existing: str = "pending") -> None:
        """Check the server, then create the outbox and inbox tables if missing.

        With ``columns`` the table is the team's own: only the toolkit's bookkeeping
        is added (:meth:`~outbox_core.dialects.base.adoption.Adoption.adopt`), its rows
        staying pending or, ``existing="sent"``, made sent.
        """
        with translate_errors("install"), self.engine.connect() as conn:
            self.dialect.check(conn)
            self.dialect.install(conn, existing=existing)

    # -- enqueue --------------------------------------------------------------------------

    def enqueue(
        self,
        conn: Connection | Session | Any,
        topic: str,
        payload: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        delay: float | timedelta | None = None,
        event_id: uuid.UUID | str | None = None,
    ) -> str:
        """Add an event to the caller's transaction and return its ``event_id``.

        ``conn`` is the SQLAlchemy ``Connection`` or ``Session`` of the business
        transaction, or a DB-API connection of psycopg 3, psycopg2, PyMySQL,
        mysqlclient, sqlite3 or pyodbc (not in autocommit mode: the event may
        be its transaction's first statement); the event commits or rolls
        back with it (this never commits). The payload must be JSON-serialisable: otherwise
        :class:`~outbox_core.errors.PayloadError` names the field and nothing
        is written.

        ``event_id``: the caller's own UUID (default: a new one), every broker's
        message id; :class:`~outbox_core.errors.InvalidEventId` before any SQL, or
        :class:`~outbox_core.errors.DuplicateEventId` with the transaction still usable.
        """
        port = transaction_port(conn, "enqueue", self.dialect.name)
        event = self.producer.event(
            topic, payload, key=key, headers=headers, delay=delay, event_id=event_id
        )
        return self.producer.enqueue(port, event, notify=self.notify)

    def enqueue_many(
        self, conn: Connection | Session | Any, events: Iterable[Mapping[str, Any]]
    ) -> list[str]:
        r"""Add many events to the caller's transaction in a few statements; return their ids.

        Each item is a mapping of :meth:`enqueue`'s arguments: ``topic`` and
        ``payload``, and optionally ``key``, ``headers``, ``delay`` and
        ``event_id`` (an id given twice in one call raises
        :class:`~outbox_core.errors.DuplicateEventId` before any SQL; with an
        id already in the table, none of the events is written). Events
        go in as multi-row ``INSERT``\ s (up to 1,000 rows each), in the
        order given, so each key's events keep that order. Every event is
        checked before anything is written: one that cannot be stored raises
        :class:`~outbox_core.errors.EventError` (or ``PayloadError``) naming
        its position and field, and none of them is written. Like
        :meth:`enqueue`, this never commits.
        """
        port = transaction_port(conn, "enqueue_many", self.dialect.name)
        built = self.producer.build_many(port, events)
        self.producer.enqueue_many(port, built, notify=self.notify)
        return [e.event_id for e in built]

    async def enqueue_async(
        self,
        conn: AsyncConnection | AsyncSession | Any,
        topic: str,
        payload: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        delay: float | timedelta | None = None,
        event_id: uuid.UUID | str | None = None,
    ) -> str:
        """Like :meth:`enqueue`, for an async connection.

        ``conn`` is a SQLAlchemy ``AsyncConnection`` or ``AsyncSession`` (run
        through :meth:`enqueue` on its sync connection), an asyncpg
        connection inside ``async with conn.transaction():``, or a psycopg
        ``AsyncConnection`` in a transaction. The same checks, the wake-up
        sent in the transaction, in-process relays woken after commit.
        """
        if _is_sqlalchemy_async(conn):

            def enqueue(sync: Connection | Session) -> str:
                return self.enqueue(
                    sync, topic, payload, key=key, headers=headers, delay=delay, event_id=event_id
                )

            return str(await conn.run_sync(enqueue))
        port = async_transaction_port(conn, "enqueue_async", self.dialect.name)
        event = self.producer.event(
            topic, payload, key=key, headers=headers, delay=delay, event_id=event_id
        )
        await self._off_loop_once(lambda: self.producer.enqueue(port, event, notify=self.notify))
        await self.producer.flush(port, [event])
        return event.event_id

    async def enqueue_many_async(
        self, conn: AsyncConnection | AsyncSession | Any, events: Iterable[Mapping[str, Any]]
    ) -> list[str]:
        """Like :meth:`enqueue_many`, for the async connections :meth:`enqueue_async` takes."""
        if _is_sqlalchemy_async(conn):

            def enqueue_many(sync: Connection | Session) -> list[str]:
                return self.enqueue_many(sync, events)

            return list(await conn.run_sync(enqueue_many))
        port = async_transaction_port(conn, "enqueue_many_async", self.dialect.name)

        def build() -> list[NewEvent]:
            built = self.producer.build_many(port, events)
            self.producer.enqueue_many(port, built, notify=self.notify)
            return built

        built = await self._off_loop_once(build)
        await self.producer.flush(port, built)
        return [e.event_id for e in built]

    async def _off_loop_once(self, work: Callable[[], T]) -> T:
        """Run ``work`` in a thread until the server's capabilities were read, then inline.

        The first enqueue reads them (and looks for the table) on the outbox's
        own, synchronous engine: that must not block the event loop. Later
        ones only build statements.
        """
        if self.producer.fallback_checked:
            return work()
        return await asyncio.to_thread(work)

    # -- relay -----------------------------------------------------------------------------

    def relay(
        self,
        broker: str | Broker,
        *,
        settings: Settings | None = None,
        retry_policy: RetryPolicy | None = None,
        name: str | None = None,
        broker_options: Mapping[str, Any] | None = None,
        **knobs: Any,
    ) -> Relay:
        """A relay publishing this outbox to ``broker`` (a URL or a Broker).

        It runs with ``settings`` as given, else this outbox's own
        (:attr:`settings`: its ``notify`` and ``block_on_dead`` included);
        knobs (``batch_size``, ``lease``, ``ordered``, ``max_attempts``, ...)
        are :class:`~outbox_core.config.Settings` fields applied on top.
        """
        base = self.settings if settings is None else settings
        merged = base.replace(**knobs) if knobs else base
        if isinstance(broker, str):
            broker = create_broker(broker, **dict(broker_options or {}))
        relay = Relay(
            self.engine, self.dialect, broker, merged, name=name, retry_policy=retry_policy
        )
        self.producer.local_relays.add(relay)
        return relay

    # -- operations ---------------------------------------------------------------------

    def status(self) -> Status:
        """Counts per state, age of the oldest pending event, dead events per topic."""
        with translate_errors("status"), self.engine.connect() as conn:
            counts = self.dialect.reads.state_counts(conn)
            activity = self.dialect.reads.activity(conn)
            dead_rows = self.dialect.reads.dead_by_topic(conn)
            relays = self._relay_shares(conn)
            fleet = self._fleet(conn)
        now, oldest, last_sent = (
            activity.now,
            activity.oldest_pending_created,
            activity.last_sent_at,
        )
        age = since_sent = None
        if oldest is not None:
            age = max(0.0, (aware(now) - aware(oldest)).total_seconds())
        if last_sent is not None:
            since_sent = max(0.0, (aware(now) - aware(last_sent)).total_seconds())
        dead = [DeadTopic(topic, n, error) for topic, n, error in dead_rows]
        return Status(
            counts=counts,
            oldest_pending_age=age,
            dead=dead,
            created_last_minute=activity.created_last_minute,
            sent_last_minute=activity.sent_last_minute,
            last_sent_age=since_sent,
            relays=relays,
            fleet=fleet,
        )

    def relays(self) -> list[RelayShare]:
        """The ordered relays in the membership table: each one's share and heartbeat age."""
        with translate_errors("status"), self.engine.connect() as conn:
            return self._relay_shares(conn)

    def _relay_shares(self, conn: Connection) -> list[RelayShare]:
        relays = self.tables.relays
        if not sa.inspect(conn).has_table(relays.name, schema=relays.schema):
            return []  # no ordered relay has run here
        return [
            RelayShare(
                m.relay_id,
                m.host,
                m.partitions or "-",
                len(parse(m.partitions)),
                max(0.0, m.age),
                m.epoch,
            )
            for m in self.dialect.partitions.members(conn)
        ]

    def fleet(self) -> list[PresenceRow]:
        """Every running relay, whatever its mode: its row in the presence table.

        Each :class:`~outbox_core.dialects.base.presence.PresenceRow` has the
        relay's id, host, pid and mode (``none``, ``partitions``, ``heads`` or
        ``wal``), its uptime and heartbeat age (seconds, on the database's
        clock) and what it published and made dead since it started and
        published in the last minute; the newest relay first. A killed relay's
        row stays, its heartbeat aging, until a relay removes it (an hour).
        Empty when the table is missing (``outbox install`` adds it).
        """
        with translate_errors("status"), self.engine.connect() as conn:
            return self._fleet(conn)

    def _fleet(self, conn: Connection) -> list[PresenceRow]:
        presence = self.dialect.presence
        return presence.fleet(conn) if presence.installed(conn) else []

    def cleanup(
        self, *, older_than: float, batch: int = 1000, max_batches: int | None = None
    ) -> int:
        """Delete sent events older than ``older_than`` seconds, ``batch`` rows per transaction."""
        with translate_errors("cleanup"), self.engine.connect() as conn:
            return delete_in_batches(
                lambda n: self.dialect.cleanup(conn, older_than=older_than, batch=n),
                batch=batch,
                max_batches=max_batches,
            )

    def replay(
        self,
        *,
        ids: list[int] | None = None,
        topic: str | None = None,
        key: str | None = None,
        all: bool = False,
    ) -> int:
        """Return dead events to pending (by id, topic or key; ``all=True`` for every one)."""
        if ids is None and topic is None and key is None and not all:
            raise ConfigurationError("replay needs ids, a topic, a key, or all=True")
        with translate_errors("replay"), self.engine.connect() as conn:
            return self.dialect.replay(conn, ids=ids, topic=topic, key=key)


def _is_sqlalchemy_async(conn: object) -> bool:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    return isinstance(conn, AsyncConnection | AsyncSession)
