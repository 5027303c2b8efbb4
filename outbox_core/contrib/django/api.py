"""``outbox`` and ``inbox``: the toolkit on Django's own connections.

>>> from outbox_core.contrib.django import outbox
>>> with transaction.atomic():
...     order = Order.objects.create(total=Decimal("12.50"))
...     outbox.enqueue("order.created", {"id": order.pk}, key=f"order-{order.pk}")

Each call writes on ``connections[using]`` (default: the database router's
choice for the outbox, else ``settings.OUTBOX["DATABASE"]``, else
``default``), in the transaction the caller is in: a ``transaction.atomic()``
block (not the one ``TestCase`` wraps each test in), or one opened by
``transaction.set_autocommit(False)``. The :class:`Outbox`
behind each database (its dialect, checks and relays) comes from
``settings.OUTBOX`` and ``DATABASES``.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, router
from sqlalchemy.pool import NullPool

from outbox_core.contrib.django.conf import current_settings
from outbox_core.contrib.django.databases import database_url
from outbox_core.contrib.django.hints import django_wording
from outbox_core.contrib.django.port import DjangoTransaction, in_transaction
from outbox_core.errors import ConfigurationError, TableMissing
from outbox_core.inbox import Inbox, normalize_event_id, validate_consumer
from outbox_core.outbox import Outbox


@dataclass(frozen=True)
class EnqueuedEvent:
    """One event as ``enqueue`` wrote it (what :func:`~.testing.capture_events` collects)."""

    event_id: str
    topic: str
    payload: Any
    key: str | None
    headers: Mapping[str, str] | None
    using: str


#: Lists collecting enqueued events (``testing.capture_events``).
_captures: list[list[EnqueuedEvent]] = []


def add_capture(target: list[EnqueuedEvent]) -> Callable[[], None]:
    """Collect every event enqueued from now on into ``target``; returns the undo."""
    _captures.append(target)
    return lambda: _captures.remove(target)


class _Binding:
    """The outbox on one Django database: the toolkit's Outbox and Inbox, and its settings."""

    def __init__(self, alias: str) -> None:
        conf = self.conf = current_settings()
        self.alias = alias
        relay = conf.relay_settings()
        # NullPool: the outbox's own engine (a first look at the table, admin
        # replays) holds no connection that would keep Django's test database
        # from being dropped.
        self.outbox = Outbox(
            database_url(alias),
            table=conf.table,
            notify=relay.notify,
            block_on_dead=relay.block_on_dead,
            max_payload_bytes=relay.max_payload_bytes,
            json_default=conf.json_default(),
            engine_options={"poolclass": NullPool},
        )
        self.inbox = Inbox(self.outbox)

    def port(self) -> DjangoTransaction:
        return DjangoTransaction(connections[self.alias])


_bindings: dict[tuple[str, str], _Binding] = {}
_lock = threading.Lock()


def routed_alias() -> str | None:
    """The alias a database router gives the outbox model for writes (None: no router says)."""
    from outbox_core.contrib.django.models import OutboxEvent

    for r in router.routers:
        method = getattr(r, "db_for_write", None)
        chosen = method(OutboxEvent) if method is not None else None
        if chosen:
            return str(chosen)
    return None


def outbox_alias(using: str | None = None) -> str:
    """``using``, else the router's choice, else ``settings.OUTBOX["DATABASE"]``, else default."""
    if using is not None:
        if using not in connections.settings:
            raise ConfigurationError(
                f"database alias {using!r} is not in DATABASES ({', '.join(connections.settings)})"
            )
        return using
    return routed_alias() or current_settings().database or DEFAULT_DB_ALIAS


def binding(using: str | None = None) -> _Binding:
    """The outbox on ``using``'s database (built on first use, again when settings change)."""
    alias = outbox_alias(using)
    # Django renames the database in place for tests: the key follows what it connects to.
    s = connections[alias].settings_dict
    where = tuple(str(s.get(k)) for k in ("ENGINE", "NAME", "HOST", "PORT", "USER", "PASSWORD"))
    key = (alias, repr(where))
    conf = current_settings()
    found = _bindings.get(key)
    if found is None or found.conf is not conf:
        with _lock:
            found = _bindings.get(key)
            if found is None or found.conf is not conf:
                found = _bindings[key] = _Binding(alias)
    return found


def outbox_for(using: str | None = None) -> Outbox:
    """The toolkit's :class:`~outbox_core.Outbox` for a Django database (status, replay, relays)."""
    return binding(using).outbox


def _require_atomic(what: str, alias: str) -> None:
    """Refuse a call with no transaction of the caller's open (before anything is written)."""
    conn = connections[alias]
    if in_transaction(conn):
        return
    testcase = conn.in_atomic_block  # only TestCase's own blocks are open
    raise ConfigurationError(
        f"{what} must run inside transaction.atomic() (database {alias!r}): outside it "
        "each statement commits on its own, so the event would be kept even if your "
        f"business write fails. Wrap the write and the {what} in "
        f"`with transaction.atomic(using={alias!r}):`"
        + (
            " (the atomic block Django's TestCase wraps each test in does not count: "
            "the code under test needs its own)"
            if testcase
            else ""
        )
    )


@contextlib.contextmanager
def _migrate_hint() -> Iterator[None]:
    """A missing table is created by Django's migrations: the error says so."""
    try:
        yield
    except TableMissing as exc:
        raise TableMissing(django_wording(str(exc))) from None


class DjangoOutbox:
    """The outbox on Django's connections: ``enqueue`` and ``enqueue_many`` inside ``atomic()``."""

    def enqueue(
        self,
        topic: str,
        payload: Any,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        using: str | None = None,
        *,
        delay: float | timedelta | None = None,
        event_id: str | uuid.UUID | None = None,
    ) -> str:
        """Add an event to the current atomic block of ``using``; return its ``event_id``.

        It commits or rolls back with that block (a rolled-back savepoint
        takes it along). Outside ``transaction.atomic()`` (or a transaction
        opened by ``transaction.set_autocommit(False)``) it is refused with
        :class:`~outbox_core.errors.ConfigurationError`; a payload that cannot
        be stored raises ``PayloadError`` and nothing is written. ``event_id``
        is your own id for the event (a UUID; default: a new one): one already
        in the table raises ``DuplicateEventId``, the transaction usable.
        """
        b = binding(using)
        _require_atomic("outbox.enqueue", b.alias)
        producer = b.outbox.producer
        event = producer.event(
            topic, payload, key=key, headers=headers, delay=delay, event_id=event_id
        )
        with _migrate_hint():
            event_id = producer.enqueue(b.port(), event, notify=b.outbox.notify)
        for target in list(_captures):
            target.append(
                EnqueuedEvent(event_id, topic, event.payload, key, event.headers, b.alias)
            )
        return event_id

    def enqueue_many(
        self, events: Iterable[Mapping[str, Any]], using: str | None = None
    ) -> list[str]:
        """Add many events (mappings of ``enqueue``'s arguments) in a few statements.

        Every event is checked before anything is written (see
        :meth:`outbox_core.Outbox.enqueue_many`); returns their ids in order.
        """
        b = binding(using)
        _require_atomic("outbox.enqueue_many", b.alias)
        port = b.port()
        producer = b.outbox.producer
        with _migrate_hint():
            built = producer.build_many(port, events)
            producer.enqueue_many(port, built, notify=b.outbox.notify)
        for target in list(_captures):
            target.extend(
                EnqueuedEvent(e.event_id, e.topic, e.payload, e.key, e.headers, b.alias)
                for e in built
            )
        return [e.event_id for e in built]

    def __repr__(self) -> str:
        return "<outbox on Django's connections>"


class DjangoInbox:
    """The inbox on Django's connections: which events each consumer already processed."""

    def record(self, consumer: str, event_id: str | uuid.UUID, using: str | None = None) -> bool:
        """Record ``event_id`` for ``consumer`` in the current atomic block; True the first time.

        Call it first in the ``transaction.atomic()`` block that applies the
        effect; when it returns False the event was already processed: skip
        the effect. Outside an atomic block it is refused.
        """
        b = binding(using)
        _require_atomic("inbox.record", b.alias)
        inbox = b.inbox
        consumer = validate_consumer(consumer)
        event = normalize_event_id(event_id)
        # MySQL: without the named lock Inbox.record takes (Django has no hook to
        # release it at rollback), a duplicate racing a transaction that rolls
        # back may get InnoDB's deadlock error; the redelivery then succeeds.
        statement = inbox.dialect.inbox.insert(consumer, event)
        return b.port().execute_rowcount(statement, {}) == 1

    def seen(self, consumer: str, event_id: str | uuid.UUID, using: str | None = None) -> bool:
        """``not record(...)``: True if the event was already processed. Records it too."""
        return not self.record(consumer, event_id, using)

    def __repr__(self) -> str:
        return "<inbox on Django's connections>"


#: ``from outbox_core.contrib.django import outbox``
outbox = DjangoOutbox()
#: ``from outbox_core.contrib.django import inbox``
inbox = DjangoInbox()
