"""The inbox: idempotent consumers, deduplicated in the consumer's own transaction.

The outbox delivers every event at least once, so a consumer sometimes gets
one twice (a relay died before marking it sent, or the broker redelivered a
message whose acknowledgement was lost). The inbox table ``<table>_inbox
(consumer, event_id, processed_at)`` remembers which events each consumer
has processed. Record the event id first, in the same transaction as the
business effect, and apply the effect only when the id is new::

    inbox = Inbox(engine)  # or Inbox.for_outbox(outbox), Inbox("postgresql+psycopg://...")

    with engine.begin() as conn:
        if inbox.record(conn, "billing", properties.message_id):
            charge_customer(conn, payload)  # first time: apply the effect
        # else: already processed; the effect committed with the first delivery
    channel.basic_ack(method.delivery_tag)  # only after the commit

The record and the effect commit together or not at all: a rolled-back
transaction records nothing, so the redelivery is processed again. Two
consumers handling the same id at once cannot both win: the second insert
waits for the first transaction and then reports a duplicate (SQLite
serialises writers instead).

Call :meth:`Inbox.record` first in the transaction: it takes the lock that
makes a concurrent duplicate wait, and nothing needs undoing when it returns
``False``. It never commits. Database errors are SQLAlchemy's, as for
``Outbox.enqueue``: they belong to your transaction. Use READ COMMITTED (the
default everywhere but MySQL, where REPEATABLE READ also works); on
PostgreSQL a stricter level turns a concurrent duplicate into a
serialization failure that you retry.

Consumer names are compared with the database's collation: on MySQL/MariaDB
and SQL Server with their default case-insensitive collations ``Billing`` and
``billing`` are the same consumer, elsewhere they differ. Use one spelling.
Event ids are normalised to the canonical lower-case UUID form on every
database.

Old rows are removed by :meth:`Inbox.cleanup` (or :func:`cleanup_inbox`);
keep them longer than any redelivery can take, or a very late duplicate is
processed again.
"""

from __future__ import annotations

import unicodedata
import uuid
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.orm import Session

from outbox_core.dialects.base import delete_in_batches
from outbox_core.errors import (
    ConfigurationError,
    DatabaseError,
    EventError,
    TableMissing,
    translate_errors,
)
from outbox_core.outbox import Outbox
from outbox_core.schema import DEFAULT_TABLE

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    from outbox_core.dialects.base import Dialect

#: Longest consumer name: the width of the inbox table's ``consumer`` column.
MAX_CONSUMER = 128


def validate_consumer(consumer: str) -> str:
    """Return ``consumer`` if it is a usable consumer name, else raise ``ConfigurationError``.

    1 to 128 characters, no leading or trailing whitespace, no control characters.
    """
    if not isinstance(consumer, str):
        raise ConfigurationError(
            f"inbox consumer must be a string naming the consumer, not {type(consumer).__name__}"
        )
    if not consumer.strip():
        raise ConfigurationError(
            "inbox consumer must not be empty: name the consuming service, e.g. 'billing'"
        )
    if len(consumer) > MAX_CONSUMER:
        raise ConfigurationError(
            f"inbox consumer {consumer[:20]!r}... is {len(consumer)} characters long; "
            f"at most {MAX_CONSUMER} fit the inbox table"
        )
    # Trailing spaces would make two names equal on MySQL (PAD SPACE collations)
    # but different elsewhere.
    if consumer != consumer.strip():
        raise ConfigurationError(
            f"inbox consumer {consumer!r} must not start or end with whitespace"
        )
    if any(unicodedata.category(ch) == "Cc" for ch in consumer):
        raise ConfigurationError(f"inbox consumer {consumer!r} must not contain control characters")
    return consumer


def normalize_event_id(event_id: str | uuid.UUID) -> str:
    """The canonical form (36 lower-case characters) of a UUID string, else ``EventError``.

    The outbox gives every event a UUID; RabbitMQ consumers find it in
    ``properties.message_id``, webhook receivers in the ``webhook-id`` header.
    """
    if isinstance(event_id, uuid.UUID):
        return str(event_id)
    if event_id is None:
        raise EventError(
            "event_id is missing (None): the message has no id to deduplicate on "
            "(RabbitMQ: properties.message_id, set by the outbox relay)"
        )
    if not isinstance(event_id, str):
        raise EventError(f"event_id must be a UUID string, not {type(event_id).__name__}")
    try:
        return str(uuid.UUID(event_id))
    except ValueError:
        shown = event_id if len(event_id) <= 80 else event_id[:80] + "..."
        raise EventError(
            f"event_id {shown!r} is not a UUID: the outbox's event ids look like "
            "'0b7c6f2e-5a1d-4c1e-9a57-3f1d2c4b5a69'"
        ) from None


def _rowcount(result: Any) -> int:
    """The rows an insert affected (0 or 1); the drivers the toolkit supports all report it."""
    count = getattr(result, "rowcount", None)
    if not isinstance(count, int) or count < 0:
        raise DatabaseError(
            "inbox record failed: the database driver did not report the rows inserted"
        )
    return count


class Inbox:
    """The inbox table of an outbox: which events each consumer has already processed.

    Build it from an :class:`~outbox_core.Outbox` (``Inbox(outbox)`` or
    ``Inbox.for_outbox(outbox)``: same engine, same table names), or from a
    database URL or ``Engine`` with the outbox's ``table`` (default
    ``outbox``; the inbox table is ``<table>_inbox``) and ``schema``.
    ``outbox install`` creates the inbox table with the outbox table; a
    consumer-only service can call :meth:`install`.

    The API, all inside the caller's transaction:

    * :meth:`record` returns ``True`` the first time ``(consumer, event_id)``
      is recorded (apply the effect) and ``False`` for a duplicate (skip it);
    * :meth:`seen` is its negation (it records too);
    * :meth:`record_async` / :meth:`seen_async` for ``AsyncConnection`` and
      ``AsyncSession``.
    """

    def __init__(
        self,
        db: Outbox | str | URL | Engine | AsyncEngine,
        *,
        table: str | None = None,
        schema: str | None = None,
        dialect: str | None = None,
    ) -> None:
        if isinstance(db, Outbox):
            if (table is not None and table != db.table.name) or (
                schema is not None and schema != db.table.schema
            ):
                raise ConfigurationError(
                    "Inbox(outbox) uses the outbox's table and schema; do not pass different ones"
                )
            self.outbox = db
            self._owns_outbox = False
        else:
            self.outbox = Outbox(db, table=table or DEFAULT_TABLE, schema=schema, dialect=dialect)
            self._owns_outbox = True
        #: Engines whose inbox table was found: looked up once per engine.
        self._tables_seen: set[Engine] = set()

    @classmethod
    def for_outbox(cls, outbox: Outbox) -> Inbox:
        """The inbox of ``outbox``: its engine, dialect and table names."""
        return cls(outbox)

    def __repr__(self) -> str:
        return f"Inbox({self.outbox!r}, inbox table={self.table.fullname!r})"

    @property
    def table(self) -> sa.Table:
        """The inbox table (``<table>_inbox``)."""
        return self.outbox.tables.inbox

    @property
    def dialect(self) -> Dialect:
        """The database strategy that builds the native insert-if-absent."""
        return self.outbox.dialect

    def install(self) -> None:
        """Create the inbox table and its index if they are missing (not the outbox table)."""
        with translate_errors("inbox install"), self.outbox.engine.begin() as conn:
            self.table.create(conn, checkfirst=True)

    def dispose(self) -> None:
        """Close the connections of an engine this inbox created (not an outbox's)."""
        if self._owns_outbox:
            self.outbox.dispose()

    # -- record -------------------------------------------------------------------------

    def insert_statement(self, consumer: str, event_id: str | uuid.UUID) -> sa.Insert:
        """The validated native insert-if-absent (1 row: new; 0 rows: duplicate)."""
        stmt = self.dialect.inbox.insert(validate_consumer(consumer), normalize_event_id(event_id))
        # SQLAlchemy only keeps the driver's rowcount of UPDATE and DELETE unless told to.
        return stmt.execution_options(preserve_rowcount=True)

    def record(self, conn: Connection | Session, consumer: str, event_id: str | uuid.UUID) -> bool:
        """Record that ``consumer`` processes ``event_id``; ``True`` if it is the first time.

        ``conn`` is the ``Connection`` or ``Session`` of the transaction that
        applies the business effect. Call this first in that transaction;
        when it returns ``False`` the event was already processed (and
        committed): skip the effect, commit or roll back, and acknowledge the
        message. This never commits.

        Raises ``ConfigurationError`` for an empty or over-long consumer name
        and ``EventError`` for an event id that is not a UUID; nothing is
        written then.
        """
        if not isinstance(conn, Connection | Session):
            raise ConfigurationError(
                "record needs the Connection or Session of your transaction, "
                f"not {type(conn).__name__} (use record_async for async ones)"
            )
        stmt = self.insert_statement(consumer, event_id)
        bind = conn if isinstance(conn, Connection) else conn.connection()
        self._check_table(bind)
        self.dialect.inbox.guard(bind, consumer, normalize_event_id(event_id))
        return _rowcount(conn.execute(stmt)) == 1

    def _check_table(self, conn: Connection) -> None:
        """A missing inbox table is refused before its INSERT fails.

        A failed INSERT would abort the caller's whole transaction on
        PostgreSQL; this catalog read leaves it usable.
        """
        if conn.engine in self._tables_seen:
            return
        table = self.table
        with translate_errors("inbox: reading the catalog"):
            found = sa.inspect(conn).has_table(table.name, schema=table.schema)
        if not found:
            raise TableMissing(
                f"inbox: table {table.fullname!r} does not exist: create it with "
                "Inbox.install() (the inbox table alone), `outbox install` or your migrations"
            )
        self._tables_seen.add(conn.engine)

    def seen(self, conn: Connection | Session, consumer: str, event_id: str | uuid.UUID) -> bool:
        """``not record(...)``: ``True`` if the event was already processed. Records it too."""
        return not self.record(conn, consumer, event_id)

    async def record_async(
        self,
        conn: AsyncConnection | AsyncSession,
        consumer: str,
        event_id: str | uuid.UUID,
    ) -> bool:
        """Like :meth:`record`, for an ``AsyncConnection`` or ``AsyncSession``."""
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

        if not isinstance(conn, AsyncConnection | AsyncSession):
            raise ConfigurationError(
                "record_async needs the AsyncConnection or AsyncSession of your transaction, "
                f"not {type(conn).__name__}"
            )

        def record(sync: Connection | Session) -> bool:
            return self.record(sync, consumer, event_id)

        return await conn.run_sync(record)

    async def seen_async(
        self,
        conn: AsyncConnection | AsyncSession,
        consumer: str,
        event_id: str | uuid.UUID,
    ) -> bool:
        """``not await record_async(...)``. Records the event too."""
        return not await self.record_async(conn, consumer, event_id)

    # -- retention ----------------------------------------------------------------------

    def cleanup(
        self, *, older_than: float, batch: int = 1000, max_batches: int | None = None
    ) -> int:
        """Delete inbox rows processed more than ``older_than`` seconds ago; return the count.

        Works in transactions of at most ``batch`` rows (each statement binds
        no more than the database takes: SQL Server's 2,100 parameters), until
        nothing old is left or ``max_batches``
        transactions ran. Keep ``older_than`` above the longest time a message
        can take to be redelivered.
        """
        if older_than < 0:
            raise ConfigurationError("inbox cleanup: older_than must not be negative")
        if batch < 1:
            raise ConfigurationError("inbox cleanup: batch must be at least 1")
        with translate_errors("inbox cleanup"), self.outbox.engine.connect() as conn:
            return delete_in_batches(
                lambda n: self.dialect.inbox.cleanup(conn, older_than=older_than, batch=n),
                batch=batch,
                max_batches=max_batches,
            )


def cleanup_inbox(outbox: Outbox, older_than: float, batch: int = 1000) -> int:
    """Delete the inbox rows of ``outbox`` processed more than ``older_than`` seconds ago.

    For ``outbox cleanup --inbox-older-than 2d``; ``batch`` rows per transaction.
    """
    return Inbox.for_outbox(outbox).cleanup(older_than=older_than, batch=batch)
