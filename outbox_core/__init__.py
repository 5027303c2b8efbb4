"""Transactional outbox for PostgreSQL, MySQL/MariaDB, SQL Server and SQLite.

Write events in your own transaction with :meth:`Outbox.enqueue`; deploy
``outbox relay`` to publish them, at least once, in commit order per key.

Names are imported on first use, so ``dialects`` and ``brokers`` can import
``outbox_core.errors`` without pulling in the facade (no import cycles).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Settings": "config",
    "load_settings": "config",
    "mask_url": "redaction",
    "AdoptionRefused": "errors",
    "BrokerError": "errors",
    "ConfigurationError": "errors",
    "DatabaseError": "errors",
    "DuplicateEventId": "errors",
    "EventError": "errors",
    "InvalidEventId": "errors",
    "InvalidIdentifier": "errors",
    "OutboxError": "errors",
    "PayloadError": "errors",
    "TableMissing": "errors",
    "UnknownBroker": "errors",
    "UnknownDialect": "errors",
    "UnsupportedDatabase": "errors",
    "CycleResult": "message",
    "Event": "message",
    "NewEvent": "message",
    "Outcome": "message",
    "OutcomeKind": "message",
    "State": "message",
    "Outbox": "outbox",
    "Status": "outbox",
    "Relay": "relay",
    "RetryPolicy": "retry",
    "Inbox": "inbox",
    "cleanup_inbox": "inbox",
    "diagnose": "doctor",
    "Finding": "doctor",
    "Severity": "doctor",
    "OutboxTables": "schema",
}

__all__ = [
    "BrokerError",
    "ConfigurationError",
    "CycleResult",
    "DatabaseError",
    "Event",
    "EventError",
    "Finding",
    "Inbox",
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
    "Severity",
    "State",
    "Status",
    "TableMissing",
    "UnknownBroker",
    "UnknownDialect",
    "UnsupportedDatabase",
    "cleanup_inbox",
    "diagnose",
    "load_settings",
    "mask_url",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'outbox_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"outbox_core.{module}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from outbox_core.config import Settings, load_settings
    from outbox_core.doctor import Finding, Severity, diagnose
    from outbox_core.errors import (
        BrokerError,
        ConfigurationError,
        DatabaseError,
        EventError,
        InvalidIdentifier,
        OutboxError,
        PayloadError,
        TableMissing,
        UnknownBroker,
        UnknownDialect,
        UnsupportedDatabase,
    )
    from outbox_core.inbox import Inbox, cleanup_inbox
    from outbox_core.message import CycleResult, Event, NewEvent, Outcome, OutcomeKind, State
    from outbox_core.outbox import Outbox, Status
    from outbox_core.redaction import mask_url
    from outbox_core.relay import Relay
    from outbox_core.retry import RetryPolicy
    from outbox_core.schema import OutboxTables
