"""Whether something the relay depends on answers, as the relay last saw it, and since when.

The broker breaker keeps one for the broker, the connections one for the
database; ``/healthz``, ``outbox status`` and the observers read them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class ServiceState:
    """Up or down, since when, and why it is down."""

    up: bool = True
    #: ``time.time()`` of the last change (the relay's start while it never changed).
    since: float = field(default_factory=time.time)
    #: Why it is down (the error that started the outage, or the last one).
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``/healthz``, ``outbox status``)."""
        return {
            "up": self.up,
            "since": datetime.fromtimestamp(self.since, UTC).isoformat(timespec="seconds"),
            "seconds": round(max(0.0, time.time() - self.since), 1),
            "error": self.error,
        }


#: The broker's state (see :class:`~outbox_core.relay.breaker.Breaker`).
BrokerState = ServiceState
#: The database's state (see :class:`~outbox_core.relay.connections.Connections`).
DatabaseState = ServiceState
