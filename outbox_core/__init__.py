"""Transactional outbox for PostgreSQL, MySQL/MariaDB, SQL Server and SQLite.

Write events in your own transaction with :meth:`Outbox.enqueue`; deploy
``outbox relay`` to publish them, at least once, in commit order per key.
"""

from outbox_core.config import Settings, load_settings, mask_url
from outbox_core.errors import (
    BrokerError,
    ConfigurationError,
    DatabaseError,
    EventError,
    InvalidIdentifier,
    OutboxError,
    PayloadError,
    UnknownBroker,
    UnknownDialect,
    UnsupportedDatabase,
)
from outbox_core.message import CycleResult, Event, NewEvent, Outcome, OutcomeKind, State
from outbox_core.outbox import Outbox, Status
from outbox_core.relay import Relay
from outbox_core.retry import RetryPolicy
from outbox_core.schema import OutboxTables

__all__ = [
    "BrokerError",
    "ConfigurationError",
    "CycleResult",
    "DatabaseError",
    "Event",
    "EventError",
    "InvalidIdentifier",
    "NewEvent",
    "Outbox",
    "OutboxError",
    "OutboxTables",
    "Outcome",
    "OutcomeKind",
    "PayloadError",
    "Relay",
    "RetryPolicy",
    "Settings",
    "State",
    "Status",
    "UnknownBroker",
    "UnknownDialect",
    "UnsupportedDatabase",
    "load_settings",
    "mask_url",
]
