"""One exception hierarchy for the toolkit.

Driver exceptions never escape raw from the public API: they are wrapped in
:class:`DatabaseError` with the operation named and any URL masked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from outbox_core.redaction import redact


class OutboxError(Exception):
    """Base class of every error raised by the toolkit."""


class ConfigurationError(OutboxError, ValueError):
    """A setting, URL or argument is invalid."""


class InvalidIdentifier(ConfigurationError):
    """A table or schema name is not a plain SQL identifier."""


class AdoptionRefused(ConfigurationError):
    """A team's table cannot be adopted (``install --columns``) as it is; nothing was changed."""


class UnknownDialect(ConfigurationError):
    """The database backend has no dialect strategy; the message lists the known ones."""


class UnknownBroker(ConfigurationError):
    """The broker URL scheme has no broker; the message lists the known ones."""


class UnsupportedDatabase(OutboxError):
    """The database server lacks a capability the outbox needs (the reason is given)."""


class EventError(OutboxError, ValueError):
    """An event given to ``enqueue`` is invalid; nothing was written."""


class PayloadError(EventError, TypeError):
    """The payload or headers cannot be serialised to JSON; the message names the field."""


class InvalidEventId(EventError):
    """The ``event_id`` given to ``enqueue`` is not a UUID; nothing was written."""


class DuplicateEventId(EventError):
    """An ``event_id`` given to ``enqueue`` is already in the outbox table; nothing was written.

    The caller's transaction stays usable: the failed insert was undone on
    its own (a savepoint). ``event_ids`` holds the id found in the table
    where the database named it, else every id that call gave.
    """

    def __init__(self, message: str, event_ids: tuple[str, ...]) -> None:
        super().__init__(message)
        #: The duplicate id (or the ids the call gave, when the database did not say which).
        self.event_ids = event_ids

    def __reduce__(self) -> tuple[type[DuplicateEventId], tuple[str, tuple[str, ...]]]:
        return (type(self), (str(self), self.event_ids))


class TableMissing(OutboxError):
    """The outbox table does not exist on the database (``outbox install`` creates it)."""


class DatabaseError(OutboxError):
    """A database operation failed; wraps the driver error.

    ``transient`` is True when the failure says nothing about the statement:
    the connection was lost or could not be made, the server is shutting
    down or starting up, a lock wait or deadlock was cut short. Running the
    statement again on a fresh connection may succeed.
    """

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        # Refined by the relay with the database's own knowledge (SessionSetup.transient).
        self.transient = unreachable
        #: The database could not be reached: the connection was lost or could not be made.
        self.unreachable = unreachable


class BrokerError(OutboxError):
    """A broker could not be created or used."""


@contextmanager
def translate_errors(operation: str) -> Iterator[None]:
    """Re-raise SQLAlchemy / driver errors as :class:`DatabaseError`, passwords masked.

    The toolkit's own operations (claim, settle, status, migrate, ...) wrap
    their statements in it, so callers catch one exception type whatever the
    driver, and no URL with a password reaches a log line.
    """
    import sqlalchemy as sa

    try:
        yield
    except sa.exc.SQLAlchemyError as exc:
        detail = getattr(exc, "orig", None) or exc
        # SQLAlchemy marks a lost connection (its dialect's own list of driver
        # codes); which other errors are of the moment is each database's
        # knowledge (SessionSetup.transient, asked by the relay).
        raise DatabaseError(
            redact(f"{operation} failed: {detail}"),
            unreachable=bool(getattr(exc, "connection_invalidated", False)),
        ) from exc
