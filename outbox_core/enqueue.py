"""Enqueue, written once against the transaction port.

:class:`Producer` turns the caller's arguments into checked events, asks the
dialect for the statements that insert them (the first event of a
transaction also carries the wake-up, in the same statement), runs them
through a :class:`~outbox_core.transaction.TransactionPort`, and wakes this
process's relays once the transaction commits. Every check runs before
anything is written, so the caller's transaction stays usable.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from outbox_core import tracing
from outbox_core.errors import (
    ConfigurationError,
    DuplicateEventId,
    EventError,
    PayloadError,
    TableMissing,
    translate_errors,
)
from outbox_core.jsoncheck import JsonDefault
from outbox_core.message import NewEvent, build_new_event
from outbox_core.transaction import TransactionPort

if TYPE_CHECKING:
    import uuid
    from collections.abc import Sequence
    from datetime import timedelta

    from sqlalchemy.engine import Connection, Engine

    from outbox_core.dialects.base import Dialect
    from outbox_core.ports.asyncdb import AsyncTransaction
    from outbox_core.relay import Relay

#: The arguments of one event in ``enqueue_many``.
EVENT_FIELDS = frozenset({"topic", "payload", "key", "headers", "delay", "event_id"})


log = logging.getLogger("outbox")


class Producer:
    """The producing side of one outbox: checks, statements, wake-ups."""

    def __init__(
        self,
        dialect: Dialect,
        *,
        fallback: Callable[[], Connection],
        json_default: JsonDefault | None = None,
        max_payload_bytes: int | None = None,
        portable_topics: bool = True,
    ) -> None:
        self.dialect = dialect
        #: Topics held to the portable grammar (``message.PORTABLE_TOPIC``).
        self.portable_topics = portable_topics
        #: Largest payload with its headers, as UTF-8 JSON (None: no bound of the outbox's own).
        self.max_payload_bytes = max_payload_bytes
        #: Converts payload values JSON cannot hold (``Outbox(json_default=...)``).
        self.json_default = json_default
        #: Where the server's capabilities are read when a port has no SQLAlchemy
        #: connection of its own (the outbox's engine).
        self._fallback = fallback
        #: Relays of this outbox running in this process, woken after a commit.
        self.local_relays: weakref.WeakSet[Relay] = weakref.WeakSet()
        #: Engines on which the outbox table was seen (checked once per pool).
        self._tables_seen: weakref.WeakSet[Engine] = weakref.WeakSet()
        #: The same for ports without a connection of their own (read on the fallback).
        self._fallback_seen = False

    @property
    def fallback_checked(self) -> bool:
        """The server's capabilities were read on the fallback engine (by a first enqueue).

        Until then, an enqueue on a port without a SQLAlchemy connection of
        its own first reads them there; afterwards it only builds statements.
        """
        return self._fallback_seen

    def event(
        self,
        topic: str,
        payload: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        delay: float | timedelta | None = None,
        event_id: uuid.UUID | str | None = None,
    ) -> NewEvent:
        """A checked event: trace context added to the headers, the payload encoded.

        ``event_id``: the caller's own id (a UUID, see
        :func:`~outbox_core.message.check_event_id`); None: a new one.
        """
        return build_new_event(
            topic,
            payload,
            key=key,
            headers=tracing.with_trace_context(headers),
            delay=delay,
            json_default=self.json_default,
            portable_topics=self.portable_topics,
            event_id=event_id,
        )

    def enqueue(self, port: TransactionPort, event: NewEvent, *, notify: bool) -> str:
        """Write ``event`` in the port's transaction; return its ``event_id``.

        An id the caller gave that is already in the table raises
        :class:`~outbox_core.errors.DuplicateEventId`, the transaction usable.
        """
        self.check_transaction(port)
        self.check(port, event)
        first = port.first_event(self)
        enqueue = self.dialect.enqueue
        if event.id_given:
            calls = [enqueue.call(event, notify=False)]
            self._write_guarded(port, calls, [event], notify=notify and first)
        else:
            statement, params = enqueue.call(event, notify=notify and first)
            port.execute(statement, params)
        if first:
            self._wake_after_commit(port)
        return event.event_id

    def enqueue_many(self, port: TransactionPort, events: list[NewEvent], *, notify: bool) -> None:
        """Write checked ``events`` in order, in a few statements.

        With any id the caller gave, all of them or none (see :meth:`enqueue`).
        """
        if not events:
            return
        self.check_transaction(port)
        first = port.first_event(self)
        enqueue = self.dialect.enqueue
        if self.guarded(events):
            calls = enqueue.many_calls(events, notify=False, driver=port.driver)
            self._write_guarded(port, calls, events, notify=notify and first)
        else:
            calls = enqueue.many_calls(events, notify=notify and first, driver=port.driver)
            for statement, params in calls:
                port.execute(statement, params)
        if first:
            self._wake_after_commit(port)

    @staticmethod
    def guarded(events: Sequence[NewEvent]) -> bool:
        """Some id was given by the caller: the inserts run in a savepoint."""
        return any(event.id_given for event in events)

    def _write_guarded(
        self,
        port: TransactionPort,
        calls: Iterable[tuple[sa.Executable, Any]],
        events: Sequence[NewEvent],
        *,
        notify: bool,
    ) -> None:
        """The inserts of events with the caller's ids, undone alone if one is a duplicate.

        The wake-up goes before the savepoint, on its own: undone with a
        duplicate, it would be missing while the port's marks say it was sent.
        """
        enqueue = self.dialect.enqueue
        wake_up = enqueue.notify_statement() if notify else None
        if wake_up is not None:
            port.execute(wake_up, {})
        for statement in enqueue.guard_begin():
            port.execute(statement, {})
        try:
            for statement, params in calls:
                port.execute(statement, params)
        except Exception as exc:
            try:
                self._undo_guarded(port)
            except Exception:
                log.debug("undoing a failed enqueue's savepoint failed", exc_info=True)
                raise exc from None
            duplicate = self.duplicate(exc, events)
            if duplicate is None:
                raise
            raise duplicate from exc
        for statement in enqueue.guard_end():
            port.execute(statement, {})

    async def flush(self, port: AsyncTransaction, events: Sequence[NewEvent]) -> None:
        """Await an async port's recorded statements; a duplicate id undone as in ``enqueue``."""
        try:
            await port.flush()
        except Exception as exc:
            if not self.guarded(events):
                raise
            self._undo_guarded(port)
            try:
                await port.flush()
            except Exception:
                log.debug("undoing a failed enqueue's savepoint failed", exc_info=True)
                raise exc from None
            duplicate = self.duplicate(exc, events)
            if duplicate is None:
                raise
            raise duplicate from exc

    def _undo_guarded(self, port: TransactionPort) -> None:
        """Back to the savepoint of the guarded inserts: the caller's transaction usable."""
        for statement in self.dialect.enqueue.guard_undo():
            port.execute(statement, {})

    def duplicate(self, error: Exception, events: Sequence[NewEvent]) -> DuplicateEventId | None:
        """What to raise for ``error`` in guarded inserts when it is a duplicate id, else None."""
        enqueue = self.dialect.enqueue
        given = [e.event_id for e in events if e.id_given]
        found = enqueue.duplicate_event_id(error, given)
        if found is None:
            return None
        where = f"the outbox table {enqueue.table.fullname!r}"
        usable = "nothing of this enqueue was written and your transaction is still usable"
        if found:
            return DuplicateEventId(
                f"event_id {found!r} is already in {where}: event ids must be unique (a retried "
                f"request? an id used twice?); {usable}",
                (found,),
            )
        shown = ", ".join(repr(i) for i in given[:5]) + (", ..." if len(given) > 5 else "")
        return DuplicateEventId(
            f"an event_id given ({shown}) is already in {where}: event ids must be unique; "
            f"{usable}",
            tuple(given),
        )

    def build_many(
        self, port: TransactionPort, specs: Iterable[Mapping[str, Any]]
    ) -> list[NewEvent]:
        """Build and check every event of ``enqueue_many`` before anything is written.

        An event that cannot be stored raises :class:`EventError` (or
        ``PayloadError``, ``InvalidEventId``) naming its position and field;
        an ``event_id`` given twice raises :class:`DuplicateEventId`.
        """
        built: list[NewEvent] = []
        given: dict[str, int] = {}
        for i, spec in enumerate(specs):
            if not isinstance(spec, Mapping):
                raise EventError(
                    f"events[{i}]: each event is a mapping of enqueue's arguments "
                    f"(topic, payload, key, headers, delay, event_id), not {type(spec).__name__}"
                )
            unknown = sorted(set(spec) - EVENT_FIELDS)
            missing = sorted({"topic", "payload"} - set(spec))
            if unknown or missing:
                problem = f"unknown {', '.join(unknown)}" if unknown else ""
                if missing:
                    problem += ("; " if problem else "") + f"missing {', '.join(missing)}"
                raise EventError(
                    f"events[{i}]: {problem} (an event has topic, payload, key, headers, delay, "
                    "event_id)"
                )
            try:
                event = self.event(
                    spec["topic"],
                    spec["payload"],
                    key=spec.get("key"),
                    headers=spec.get("headers"),
                    delay=spec.get("delay"),
                    event_id=spec.get("event_id"),
                )
                self.check(port, event)
            except EventError as exc:
                raise type(exc)(f"events[{i}]: {exc}") from exc
            if event.id_given:
                before = given.setdefault(event.event_id, i)
                if before != i:
                    raise DuplicateEventId(
                        f"events[{i}]: event_id {event.event_id!r} was given to events[{before}] "
                        "too: event ids must be unique; nothing was written",
                        (event.event_id,),
                    )
            built.append(event)
        return built

    def check_transaction(self, port: TransactionPort) -> None:
        """Refuse a connection whose statements commit on their own: the event would too."""
        if port.autocommit():
            raise ConfigurationError(
                "enqueue needs the caller's transaction, but this connection is in autocommit "
                "mode: the event would be committed on its own, even if your business write "
                "fails. Enqueue inside engine.begin() / session.begin(), or on a connection "
                "without isolation_level='AUTOCOMMIT'"
            )

    def check(self, port: TransactionPort, event: NewEvent) -> None:
        """What this database cannot store, or a missing table, is refused before any write."""
        bind = port.bind
        if bind is not None:
            if bind.engine not in self._tables_seen:
                with translate_errors("reading the server's capabilities"):
                    self._first_look(bind)
                self._tables_seen.add(bind.engine)
        elif not self._fallback_seen:
            # A port with no SQLAlchemy connection: look once, on the outbox's own engine.
            with translate_errors("reading the server's capabilities"), self._fallback() as conn:
                self._first_look(conn)
            self._fallback_seen = True
        self._check_size(event)
        self.dialect.storage.check_event(event)

    def _check_size(self, event: NewEvent) -> None:
        limit = self.max_payload_bytes
        headers = event.headers_json or ""
        # A character is at most 4 bytes of UTF-8: most payloads need no encoding here.
        if limit is None or 4 * (len(event.payload_json) + len(headers)) <= limit:
            return
        size = len(event.payload_json.encode("utf-8")) + len(headers.encode("utf-8"))
        if size > limit:
            raise PayloadError(
                f"payload is {size:,} bytes as UTF-8 JSON with its headers; this outbox takes "
                f"at most {limit:,} (max_payload_bytes): store the body elsewhere and enqueue "
                "a reference, or raise max_payload_bytes where your broker takes more "
                "(RabbitMQ: max_message_size, 16 MiB by default; Kafka and NATS: 1 MiB)"
            )

    def _first_look(self, conn: Connection) -> None:
        """Read the server's capabilities; refuse a missing table before its INSERT fails.

        A failed INSERT would abort the caller's whole transaction on
        PostgreSQL; this catalog read leaves it usable.
        """
        storage = self.dialect.storage
        if not storage.initialized:
            storage.initialize(conn)
        table = self.dialect.table
        inspector = sa.inspect(conn)
        if not inspector.has_table(table.name, schema=table.schema):
            schema = f" --schema {table.schema}" if table.schema else ""
            raise TableMissing(
                f"enqueue: table {table.fullname!r} does not exist: create it with "
                f"`outbox install --db <url> --table {table.name}{schema}` "
                "(or Outbox.install(), or your migrations)"
            )
        columns = {c["name"].lower() for c in inspector.get_columns(table.name, table.schema)}
        if "key_partition" not in columns and self.dialect.enqueue.with_partition:
            # Deployed before `outbox install` ran: keep working, as before.
            log.warning(
                "table %s has no key_partition column (an earlier version created it): "
                "events are written without their partition, which ordered relays then "
                "compute; run `outbox install` (or the migration) to add it",
                table.fullname,
            )
            self.dialect.enqueue.without_partition()

    def _wake_after_commit(self, port: TransactionPort) -> None:
        """Wake this process's relays when the transaction commits (none: nothing to do)."""
        if self.local_relays:
            relays = list(self.local_relays)
            port.after_commit(lambda: _wake(relays))


def _wake(relays: list[Relay]) -> None:
    for relay in relays:
        relay.wake()
