"""Enqueue, written once against the transaction port.

:class:`Producer` turns the caller's arguments into checked events, asks the
dialect for the statements that insert them (the first event of a
transaction also carries the wake-up, in the same statement), runs them
through a :class:`~outbox_core.transaction.TransactionPort`, and wakes this
process's relays once the transaction commits. Every check runs before
anything is written, so the caller's transaction stays usable.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from outbox_core import tracing
from outbox_core.errors import EventError, translate_errors
from outbox_core.message import NewEvent, build_new_event
from outbox_core.transaction import TransactionPort

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from outbox_core.dialects.base import Dialect
    from outbox_core.relay import Relay

#: The arguments of one event in ``enqueue_many``.
EVENT_FIELDS = frozenset({"topic", "payload", "key", "headers", "delay"})


class Producer:
    """The producing side of one outbox: checks, statements, wake-ups."""

    def __init__(self, dialect: Dialect, *, fallback: Callable[[], Connection]) -> None:
        self.dialect = dialect
        #: Where the server's capabilities are read when a port has no SQLAlchemy
        #: connection of its own (the outbox's engine).
        self._fallback = fallback
        #: Relays of this outbox running in this process, woken after a commit.
        self.local_relays: weakref.WeakSet[Relay] = weakref.WeakSet()

    def enqueue(self, port: TransactionPort, event: NewEvent, *, notify: bool) -> str:
        """Write ``event`` in the port's transaction; return its ``event_id``."""
        self.check(port, event)
        first = port.first_event(self)
        statement, params = self.dialect.enqueue.call(event, notify=notify and first)
        port.execute(statement, params)
        if first:
            self._wake_after_commit(port)
        return event.event_id

    def enqueue_many(self, port: TransactionPort, events: list[NewEvent], *, notify: bool) -> None:
        """Write checked ``events`` in order, in a few statements."""
        if not events:
            return
        first = port.first_event(self)
        calls = self.dialect.enqueue.many_calls(events, notify=notify and first, driver=port.driver)
        for statement, params in calls:
            port.execute(statement, params)
        if first:
            self._wake_after_commit(port)

    def build_many(
        self, port: TransactionPort, specs: Iterable[Mapping[str, Any]]
    ) -> list[NewEvent]:
        """Build and check every event of ``enqueue_many`` before anything is written.

        An event that cannot be stored raises :class:`EventError` (or
        ``PayloadError``) naming its position and field.
        """
        built: list[NewEvent] = []
        for i, spec in enumerate(specs):
            if not isinstance(spec, Mapping):
                raise EventError(
                    f"events[{i}]: each event is a mapping of enqueue's arguments "
                    f"(topic, payload, key, headers, delay), not {type(spec).__name__}"
                )
            unknown = sorted(set(spec) - EVENT_FIELDS)
            missing = sorted({"topic", "payload"} - set(spec))
            if unknown or missing:
                problem = f"unknown {', '.join(unknown)}" if unknown else ""
                if missing:
                    problem += ("; " if problem else "") + f"missing {', '.join(missing)}"
                raise EventError(
                    f"events[{i}]: {problem} (an event has topic, payload, key, headers, delay)"
                )
            try:
                event = build_new_event(
                    spec["topic"],
                    spec["payload"],
                    key=spec.get("key"),
                    headers=tracing.with_trace_context(spec.get("headers")),
                    delay=spec.get("delay"),
                )
                self.check(port, event)
            except EventError as exc:
                raise type(exc)(f"events[{i}]: {exc}") from exc
            built.append(event)
        return built

    def check(self, port: TransactionPort, event: NewEvent) -> None:
        """What this database cannot store is refused before anything is written."""
        storage = self.dialect.storage
        if not storage.initialized:
            with translate_errors("reading the server's capabilities"):
                bind = port.bind
                if bind is not None:
                    storage.initialize(bind)
                else:
                    with self._fallback() as conn:
                        storage.initialize(conn)
        storage.check_event(event)

    def _wake_after_commit(self, port: TransactionPort) -> None:
        """Wake this process's relays when the transaction commits (none: nothing to do)."""
        if self.local_relays:
            relays = list(self.local_relays)
            port.after_commit(lambda: _wake(relays))


def _wake(relays: list[Relay]) -> None:
    for relay in relays:
        relay.wake()
